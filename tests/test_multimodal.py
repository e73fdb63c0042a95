"""Vision-language batches are refused where DFPO would regroup or pre-pass them.

TRL's rollout for a vision-language model carries ``pixel_values`` whose rows are image patches (counted by
``image_grid_thw`` / ``num_images``), not samples. DFPO's group shuffle concatenates, permutes and splits every
tensor as if it had one row per sample, and the pre-pass forward does not pass the multimodal inputs at all: a
silently wrong batch. So the combination stops, at start-up when the model or processor is multimodal, or at
the first rollout that carries multimodal keys, with a message naming the fields.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from tiny import addition_dataset, base_args, last_digit_reward, tiny_model, tiny_tokenizer

from dfpo_trl import DFPOConfig, DFPOTrainer

pytestmark = pytest.mark.usefixtures("one_thread")
GSPO = dict(importance_sampling_level="sequence", loss_type="grpo", steps_per_generation=2)
PATCHES_PER_IMAGE = 4


def vision_rollout(rows: int, group_size: int) -> dict[str, Any]:
    """A Qwen-VL-like rollout: one image a sample, 2x2 = 4 patch rows of pixel_values per image."""
    g = torch.Generator().manual_seed(0)
    return dict(
        prompt_ids=torch.full((rows, 2), 13), prompt_mask=torch.ones(rows, 2, dtype=torch.long),
        completion_ids=torch.randint(3, 10, (rows, 3), generator=g),
        completion_mask=torch.ones(rows, 3, dtype=torch.long), advantages=torch.randn(rows, generator=g),
        num_items_in_batch=torch.tensor(3 * rows), group_ids=torch.arange(rows) // group_size,
        row_ids=torch.arange(rows), pixel_values=torch.randn(rows * PATCHES_PER_IMAGE, 6, generator=g),
        image_grid_thw=torch.tensor([[1, 2, 2]] * rows), num_images=[1] * rows,
    )


def trainer_with(model: Any = None, **settings: Any) -> DFPOTrainer:
    args = DFPOConfig(**base_args(**GSPO, **settings))
    trainer = DFPOTrainer(model=tiny_model(0) if model is None else model, reward_funcs=last_digit_reward, args=args,
                          train_dataset=addition_dataset(), processing_class=tiny_tokenizer())
    trainer.model.train()
    trainer._generate_and_score_completions = lambda _inputs: vision_rollout(8, 2)
    return trainer


@pytest.mark.parametrize(
    ("settings", "layout"),
    [
        (dict(per_device_train_batch_size=4, num_generations=2, group_transform="min_replace"), "group_granular"),
        (dict(per_device_train_batch_size=4, num_generations=2, group_granular_batches=True), "group_granular"),
        (dict(per_device_train_batch_size=2, num_generations=4, group_transform="min_replace",
              gradient_accumulation_steps=2), "pre_pass"),
    ],
)
def test_a_vision_rollout_is_refused_where_dfpo_regroups_it(settings, layout):
    trainer = trainer_with(**settings)
    assert trainer.group_layout == layout
    with pytest.raises(ValueError, match=r"the rollout carries pixel_values, image_grid_thw, num_images") as error:
        trainer._prepare_inputs(None)
    assert layout in str(error.value)


def test_a_vision_rollout_passes_through_when_dfpo_keeps_trls_order():
    """DFPO off (or GRPO-fix / DelTA): TRL's own buffering handles the patches; DFPO does not touch them."""
    trainer = trainer_with(per_device_train_batch_size=4, num_generations=2)
    assert trainer.group_layout == "per_sample"
    micro = trainer._prepare_inputs(None)
    assert micro["pixel_values"].size(0) == 4 * PATCHES_PER_IMAGE


def test_a_multimodal_model_is_refused_at_start_up():
    """What the start-up check reads: a ``vision_config`` on the model's config (every HF vision-language model
    has one) or an ``image_processor`` on the processing class."""
    model = tiny_model(0)
    model.config.vision_config = {"model_type": "siglip_vision_model"}
    with pytest.raises(ValueError, match=r"group_transform='min_replace' needs the 'group_granular' layout.*"
                                         r"pixel_values"):
        trainer_with(model, per_device_train_batch_size=4, num_generations=2, group_transform="min_replace")
    trainer = trainer_with(model, per_device_train_batch_size=4, num_generations=2)  # DFPO off: fine
    assert trainer.group_layout == "per_sample"
