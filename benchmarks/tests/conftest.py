"""Fixtures of the benchmarks' tests. They repeat tests/conftest.py's: neither test folder imports the other, and
being about the test process, not DFPO, they have no home in ``dfpo_trl.testing``."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def transformers_logging_restored() -> Iterator[None]:
    """A job run in-process (``common.quiet()``) sets transformers' verbosity for the whole process; a later test
    that reads transformers' warnings must still see them, whatever ran before it."""
    import transformers

    verbosity = transformers.logging.get_verbosity()
    yield
    transformers.logging.set_verbosity(verbosity)


@pytest.fixture
def gpu_recipes_parse_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """GPU recipes set bf16, which TrainingArguments refuses on a CPU-only machine at parse time; parsing is what
    is tested, so the GPU check answers yes."""
    import transformers.training_args as training_args

    monkeypatch.setattr(training_args, "is_torch_bf16_gpu_available", lambda: True)
