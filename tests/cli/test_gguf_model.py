"""``--model_name_or_path model.gguf``: a local GGUF file converted once to a transformers checkpoint, as the
embedded default is (the end-token fix included), cached, and converted again only when the file changes.

The GGUF is written here with the ``gguf`` package: a two-layer Llama of hidden size 16 with random weights, and the
tokenizer (vocabulary, merges, chat template, special tokens) copied from the embedded SmolLM2 GGUF, whose
metadata the reader maps without loading its weights. Its end token is written as ``<|im_start|>`` (id 1), the wrong
one transformers' reader gives SmolLM2, so the conversion's end-token fix has something to fix."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest

from dfpo_trl.cli.args import ModelUnavailableError
from dfpo_trl.cli.embedded import find_embedded_gguf, gguf_converted, gguf_model_path

HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 16, 2, 4, 2, 32


def write_tiny_gguf(path: Path) -> Path:
    import gguf

    reader = gguf.GGUFReader(find_embedded_gguf())

    def value(key: str):  # noqa: ANN202 - the field's Python value
        return reader.fields[key].contents()

    vocab = int(value("llama.vocab_size"))
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny llama for tests")
    writer.add_context_length(128)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(HIDDEN // HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    writer.add_tokenizer_model(value("tokenizer.ggml.model"))
    writer.add_tokenizer_pre(value("tokenizer.ggml.pre"))
    writer.add_token_list(value("tokenizer.ggml.tokens"))
    writer.add_token_types(value("tokenizer.ggml.token_type"))
    writer.add_token_merges(value("tokenizer.ggml.merges"))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)  # <|im_end|>, as SmolLM2's GGUF says; transformers' reader may still give id 1
    writer.add_pad_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(value("tokenizer.chat_template"))
    rng = np.random.default_rng(0)

    def tensor(name: str, *shape: int) -> None:
        writer.add_tensor(name, (0.02 * rng.standard_normal(shape)).astype(np.float32))

    tensor("token_embd.weight", vocab, HIDDEN)
    writer.add_tensor("output_norm.weight", np.ones(HIDDEN, dtype=np.float32))
    head = HIDDEN // HEADS
    for i in range(LAYERS):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(HIDDEN, dtype=np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(HIDDEN, dtype=np.float32))
        tensor(f"blk.{i}.attn_q.weight", HIDDEN, HIDDEN)
        tensor(f"blk.{i}.attn_k.weight", KV_HEADS * head, HIDDEN)
        tensor(f"blk.{i}.attn_v.weight", KV_HEADS * head, HIDDEN)
        tensor(f"blk.{i}.attn_output.weight", HIDDEN, HIDDEN)
        tensor(f"blk.{i}.ffn_gate.weight", FFN, HIDDEN)
        tensor(f"blk.{i}.ffn_up.weight", FFN, HIDDEN)
        tensor(f"blk.{i}.ffn_down.weight", HIDDEN, FFN)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf")


def test_a_local_gguf_is_converted_once_with_the_end_token_fixed(tiny_gguf: Path, cache: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert not gguf_converted(tiny_gguf, cache)
    checkpoint = gguf_model_path(tiny_gguf, cache)
    assert checkpoint.parent == cache and checkpoint.name.startswith("gguf-tiny-llama-")
    assert gguf_converted(tiny_gguf, cache)
    marker = json.loads((checkpoint / "dfpo_embedded.json").read_text())
    assert marker["source"] == str(tiny_gguf.resolve())
    written = (checkpoint / "config.json").stat().st_mtime_ns
    assert gguf_model_path(tiny_gguf, cache) == checkpoint  # cached: not converted again
    assert (checkpoint / "config.json").stat().st_mtime_ns == written

    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    assert (model.config.hidden_size, model.config.num_hidden_layers) == (HIDDEN, LAYERS)
    assert tokenizer.eos_token == "<|im_end|>" and model.config.eos_token_id == 2  # fixed from <|im_start|>
    assert not getattr(model, "is_quantized", False) and "quantization_config" not in model.config.to_dict()
    assert tokenizer.apply_chat_template([{"role": "user", "content": "2 + 3?"}], tokenize=False,
                                         add_generation_prompt=True).endswith("assistant\n")


def test_model_name_or_path_takes_a_gguf_file(tiny_gguf: Path, cache: Path, tmp_path: Path,
                                              caplog: pytest.LogCaptureFixture) -> None:
    from trl import ModelConfig

    from dfpo_trl.cli.model import resolve_model

    with caplog.at_level(logging.INFO, logger="dfpo_trl"):
        path, label = resolve_model(ModelConfig(model_name_or_path=str(tiny_gguf)), cache_dir=str(cache))
    assert Path(path).is_dir() and (Path(path) / "model.safetensors").is_file() and label == str(tiny_gguf)
    assert f"GGUF model checkpoint: {path}" in caplog.text
    tiny_gguf.touch()  # a changed file is converted again
    assert not gguf_converted(tiny_gguf, cache)
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"not a gguf")
    with pytest.raises(ModelUnavailableError, match=r"model_name_or_path='.*broken.gguf': this GGUF cannot be "
                       r"converted"):
        resolve_model(ModelConfig(model_name_or_path=str(broken)), cache_dir=str(tmp_path))
