"""LoRA through peft: DFPOTrainer trains only the adapter, and with no transform it is TRL's GSPO on LoRA."""

from __future__ import annotations

import math

import pytest
import torch
from tiny import (
    addition_dataset,
    base_args,
    last_digit_reward,
    loss_and_grads,
    random_batch,
    tiny_model,
    tiny_tokenizer,
    with_old_logps,
)
from trl import GRPOConfig, GRPOTrainer

from dfpo_trl import DFPOConfig, DFPOTrainer

peft = pytest.importorskip("peft")

GSPO = dict(importance_sampling_level="sequence", epsilon=0.2, epsilon_high=0.28, per_device_train_batch_size=4,
            num_generations=2)


pytestmark = pytest.mark.usefixtures("one_thread")


def lora_config() -> peft.LoraConfig:
    return peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                           task_type="CAUSAL_LM")


def lora_trainer(trainer_cls: type, config_cls: type, **overrides):
    trainer = trainer_cls(
        model=tiny_model(0), reward_funcs=last_digit_reward, args=config_cls(**base_args(**overrides)),
        train_dataset=addition_dataset(), processing_class=tiny_tokenizer(), peft_config=lora_config(),
    )
    trainer.model.train()
    return trainer


def is_lora(name: str) -> bool:
    return "lora_" in name


@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_lora_training_changes_only_the_adapter(beta, tmp_path):
    """A few off-policy min_replace steps on a LoRA model (with β-KL, TRL's reference is the adapter-disabled
    base): finite losses, DFPO metrics logged, the transform acts, LoRA weights move, base weights do not."""
    trainer = lora_trainer(
        DFPOTrainer, DFPOConfig, **GSPO, loss_type="grpo", steps_per_generation=4, group_transform="min_replace",
        max_steps=4, temperature=1.5, learning_rate=0.05, beta=beta, output_dir=str(tmp_path),
    )
    assert isinstance(trainer.model, peft.PeftModel)
    trainable = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert trainable and all(is_lora(n) for n in trainable)
    assert {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in trainable} == {"q_proj", "v_proj"}
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    after = dict(trainer.model.named_parameters())
    for name, value in before.items():
        if not is_lora(name):
            assert torch.equal(after[name], value), name
    assert any(not torch.equal(after[n], before[n]) for n in trainable)
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 4
    assert all(math.isfinite(h["loss"]) and math.isfinite(h["grad_norm"]) for h in logs)
    for key in ("reward", "asym/before", "asym/after", "transform/phi_min", "transform/orth_residual"):
        assert any(key in h for h in logs), key
    assert min(h["transform/phi_min"] for h in logs) < 1.0  # off-policy micro-steps: the transform acts
    if beta:
        assert all(math.isfinite(h["kl"]) for h in logs)


def set_adapter(trainer, seed: int = 3) -> None:
    """The same non-zero LoRA weights in every trainer (peft starts B at 0, which would zero A's gradient)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(trainer.model.named_parameters()):
            if is_lora(name):
                p.copy_(0.2 * torch.randn(p.shape, generator=g))


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_lora_none_equals_trl_gspo_loss_and_adapter_gradient(loss_type):
    """group_transform='none' on a LoRA model: the same loss and the same gradient of every LoRA parameter as
    trl.GRPOTrainer with the same peft config, on a batch with clipped sequences; base weights get none."""
    ours = lora_trainer(DFPOTrainer, DFPOConfig, **GSPO, loss_type=loss_type, steps_per_generation=2)
    theirs = lora_trainer(GRPOTrainer, GRPOConfig, **GSPO, loss_type=loss_type, steps_per_generation=2)
    for trainer in (ours, theirs):
        set_adapter(trainer)
        trainer.current_gradient_accumulation_steps = 1
    batch = with_old_logps(theirs, *random_batch(group_size=2))
    loss_ours, grads_ours = loss_and_grads(ours, batch)
    loss_theirs, grads_theirs = loss_and_grads(theirs, batch)
    # DFPO off runs TRL's loss with the same operations: bit for bit
    assert torch.equal(loss_ours, loss_theirs), (loss_ours, loss_theirs)
    assert grads_ours.keys() == grads_theirs.keys()
    assert grads_ours and all(is_lora(n) for n in grads_ours)
    assert any(g.abs().max() > 1e-6 for n, g in grads_ours.items() if "lora_A" in n)
    for name in grads_ours:
        assert torch.equal(grads_ours[name], grads_theirs[name]), name


def test_lora_transform_changes_the_adapter_gradient():
    """The same hand batch with min_replace gives a different adapter gradient: DFPO acts through LoRA too."""
    grads = {}
    for transform in ("none", "min_replace"):
        trainer = lora_trainer(DFPOTrainer, DFPOConfig, **GSPO, loss_type="grpo", steps_per_generation=2,
                               group_transform=transform)
        set_adapter(trainer)
        trainer.current_gradient_accumulation_steps = 1
        _, g = loss_and_grads(trainer, with_old_logps(trainer, *random_batch(group_size=2)))
        grads[transform] = torch.cat([v.flatten() for _, v in sorted(g.items())])
    assert (grads["none"] - grads["min_replace"]).abs().max() > 1e-5
