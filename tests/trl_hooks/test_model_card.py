"""The model card a DFPO run writes names DFPO, carries the dfpo tag and cites the DFPO paper (and DelTA when DelTA
weights the tokens), not the GRPO/DeepSeekMath card inherited from TRL's GRPOTrainer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from huggingface_hub import ModelCard
from tiny import addition_dataset, base_args, last_digit_reward, tiny_model, tiny_tokenizer
from trl import GRPOConfig, GRPOTrainer

from dfpo_trl import DFPOConfig, DFPOTrainer
from dfpo_trl.trl_hooks.model_card import DELTA_PAPER, DFPO_PAPER

pytestmark = pytest.mark.usefixtures("one_thread")

DELTA = dict(token_weighting="delta", loss_type="dapo")


def build(trainer_cls: type, config_cls: type, output_dir: Path, **overrides: Any) -> Any:
    return trainer_cls(
        model=tiny_model(),
        reward_funcs=last_digit_reward,
        args=config_cls(**base_args(output_dir=str(output_dir), **overrides)),
        train_dataset=addition_dataset(),
        processing_class=tiny_tokenizer(),
    )


def written_card(trainer: Any) -> tuple[str, list[str]]:
    """The card's text and its tags, as TRL wrote them to output_dir/README.md."""
    path = Path(trainer.args.output_dir) / "README.md"
    return path.read_text(encoding="utf-8"), list(ModelCard.load(path).data.tags)


def assert_dfpo_card(text: str, tags: list[str]) -> None:
    assert "This model was trained with DFPO, a method introduced in" in text
    assert f"[{DFPO_PAPER['title']}](https://huggingface.co/papers/2604.13088)" in text
    assert "Cite DFPO as:" in text and "ding2026designconditions" in text
    assert "Fei Ding and Yongkang Zhang and Youwei Wang and Zijian Zeng" in text
    assert {"trl", "dfpo"} <= set(tags) and "grpo" not in tags
    assert "trained with GRPO" not in text and "DeepSeekMath" not in text and "shao2024deepseekmath" not in text


def test_card_without_delta_names_and_cites_dfpo_only(tmp_path: Path) -> None:
    trainer = build(DFPOTrainer, DFPOConfig, tmp_path / "run", group_transform="min_replace",
                    importance_sampling_level="sequence", loss_type="grpo", steps_per_generation=2)
    trainer.create_model_card(model_name="tiny-dfpo")
    text, tags = written_card(trainer)
    assert_dfpo_card(text, tags)
    assert "delta" not in tags
    assert "DelTA" not in text and "zhang2026deltadiscriminativetokencredit" not in text
    assert trainer.model.model_tags == ["trl", "dfpo"]  # what a hub push adds to the card's tags


def test_card_with_delta_adds_its_tag_sentence_and_citation(tmp_path: Path) -> None:
    trainer = build(DFPOTrainer, DFPOConfig, tmp_path / "run", **DELTA)
    trainer.create_model_card(model_name="tiny-dfpo-delta")
    text, tags = written_card(trainer)
    assert_dfpo_card(text, tags)
    assert "delta" in tags and trainer.model.model_tags == ["trl", "dfpo", "delta"]
    assert f"[{DELTA_PAPER['title']}](https://huggingface.co/papers/2605.21467)" in text
    assert "Cite DelTA as:" in text and "zhang2026deltadiscriminativetokencredit" in text
    assert "Kaiyi Zhang and Wei Wu and Yankai Lin" in text
    # DFPO's citation, then DelTA's, then TRL's; each once (the card is rewritten, not appended to)
    assert text.index("Cite DFPO as:") < text.index("Cite DelTA as:") < text.index("Cite TRL as:")
    trainer.create_model_card(model_name="tiny-dfpo-delta")
    text, _ = written_card(trainer)
    assert text.count("Cite DelTA as:") == 1 and text.count("Its per-token weights come from DelTA") == 1


def test_a_checkpoint_writes_the_dfpo_card(tmp_path: Path) -> None:
    """TRL writes the card when it saves a checkpoint: one optimizer step with DelTA on, saved."""
    trainer = build(DFPOTrainer, DFPOConfig, tmp_path / "run", max_steps=1, save_strategy="steps", save_steps=1,
                    **DELTA)
    trainer.train()
    assert (tmp_path / "run" / "checkpoint-1").is_dir()
    text, tags = written_card(trainer)
    assert_dfpo_card(text, tags)
    assert "delta" in tags and "Cite DelTA as:" in text


def test_grpo_trainer_keeps_its_own_card(tmp_path: Path) -> None:
    """DFPO's attributes are its own: a GRPOTrainer built after a DFPOTrainer with DelTA still writes GRPO's card."""
    build(DFPOTrainer, DFPOConfig, tmp_path / "dfpo", **DELTA)
    trainer = build(GRPOTrainer, GRPOConfig, tmp_path / "grpo")
    trainer.create_model_card(model_name="tiny-grpo")
    text, tags = written_card(trainer)
    assert "trained with GRPO" in text and "grpo" in tags
    assert "dfpo" not in tags and "delta" not in tags and "DFPO" not in text and "DelTA" not in text
