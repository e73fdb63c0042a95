"""The saved model's files get the permissions the umask gives, like every other file a run writes:
transformers writes ``model.safetensors`` through a private temporary file (0600)."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

from dfpo_trl.cli.outputs import save_model


class _Saver:
    """What save_model calls of a trainer: ``save_model(output_dir)``, here transformers' own save of a tiny model."""

    def __init__(self, model: Any) -> None:
        self.model = model

    def save_model(self, output_dir: str) -> None:
        self.model.save_pretrained(output_dir)


def test_saved_model_files_follow_the_umask(tmp_path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    out = tmp_path / "out"
    out.mkdir()
    previous = os.umask(0o022)
    try:
        saved = save_model(_Saver(model), str(out))
        mine = out / "notes.txt"
        mine.write_text("a file written with open()")
    finally:
        os.umask(previous)
    assert "model.safetensors" in saved and "config.json" in saved
    modes = {name: stat.S_IMODE((out / name).stat().st_mode) for name in saved}
    assert set(modes.values()) == {stat.S_IMODE(mine.stat().st_mode)} == {0o644}, modes
