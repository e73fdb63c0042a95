"""``dfpo-train --reward_funcs`` with a reward model, as TRL's ``GRPOTrainer`` accepts one: a local directory or a hub
id stays a string that TRL loads with ``AutoModelForSequenceClassification`` (``num_labels=1``). A tiny sequence
classifier is built and saved in the test; no network. What cannot load is refused in one line before any model
loads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from tiny import save_tiny_chat_model, tiny_tokenizer, write_tiny_recipe
from transformers import LlamaConfig, LlamaForSequenceClassification

import dfpo_trl.cli.train as app_train
from dfpo_trl.cli.main import main

pytestmark = pytest.mark.usefixtures("one_thread")

RUN = dict(skip_eval=True, eval_size=None, eval_max_new_tokens=None, eval_batch_size=None, train_size=8,
           temperature=None, epsilon=0.2, epsilon_high=0.28)  # changes to dfpo_trl.testing's tiny recipe


def save_reward_model(path: Path, tokenizer: bool = True, chat_template: bool = True) -> Path:
    """A tiny random Llama sequence classifier (one score) and, unless told not to, its tokenizer with a chat
    template (TRL renders chat prompts for a reward model through it), saved to ``path``."""
    torch.manual_seed(1)
    words = tiny_tokenizer()
    if chat_template:
        words.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    config = LlamaConfig(vocab_size=len(words), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64, num_labels=1,
                         pad_token_id=words.pad_token_id)
    LlamaForSequenceClassification(config).save_pretrained(path)
    if tokenizer:
        words.save_pretrained(path)
    return path


def test_reward_model_directory_goes_through_the_cli_into_the_trainer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reward_dir = save_reward_model(tmp_path / "tiny_rm")
    policy = save_tiny_chat_model(tmp_path / "policy")
    built: list[Any] = []

    class Keeping(app_train.DFPOTrainer):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            built.append(self)

    monkeypatch.setattr(app_train, "DFPOTrainer", Keeping)
    argv = [*write_tiny_recipe(tmp_path, policy, tmp_path / "out", **RUN), "--reward_funcs", str(reward_dir)]
    assert main(argv) == 0
    trainer, = built
    model, = trainer.reward_funcs
    assert isinstance(model, LlamaForSequenceClassification) and model.config.num_labels == 1
    saved = LlamaForSequenceClassification.from_pretrained(reward_dir)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), saved.state_dict().values(),
                                                 strict=True))
    assert trainer.reward_func_names == ["tiny_rm"]
    logged = [entry["rewards/tiny_rm/mean"] for entry in trainer.state.log_history if "rewards/tiny_rm/mean" in entry]
    assert logged and all(torch.isfinite(torch.tensor(logged)))


def _one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith(("INFO ", "WARNING "))]
    assert len(lines) == 1 and lines[0].startswith("dfpo-train: error: "), err
    return lines[0]


def _no_model(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_model(*args: object, **kwargs: object) -> None:
        raise AssertionError("the policy was looked up before the reward model was checked")

    monkeypatch.setattr(app_train, "resolve_model", no_model)


def test_unreachable_hub_reward_model_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    _no_model(monkeypatch)
    argv = [*write_tiny_recipe(tmp_path, output_dir=tmp_path / "out", **RUN), "--reward_funcs",
            "no-such-org/no-such-reward-model-dfpo"]
    assert main(argv) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "reward model (reward_funcs) 'no-such-org/no-such-reward-model-dfpo'" in line
    assert "no network access" in line and "reward_funcs: /path/to/reward_model" in line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("make", "said"), [
    pytest.param(lambda path: save_reward_model(path, tokenizer=False),
                 "has no tokenizer (tokenizer.json or tokenizer_config.json)", id="no tokenizer"),
    pytest.param(lambda path: path, "is not a directory", id="missing"),
    pytest.param(lambda path: save_reward_model(path, chat_template=False), "has no chat template",
                 id="no chat template"),
])
def test_reward_model_directory_that_cannot_load_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], make: Any, said: str
) -> None:
    _no_model(monkeypatch)
    target = make(tmp_path / "rm")
    capsys.readouterr()  # what saving it printed
    argv = [*write_tiny_recipe(tmp_path, output_dir=tmp_path / "out", **RUN), "--reward_funcs", str(target)]
    assert main(argv) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert f"reward_funcs: {str(target)!r}" in line and said in line
