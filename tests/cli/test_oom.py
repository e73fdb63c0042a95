"""An out-of-memory error in each phase of a ``dfpo-train`` run ends in one line naming the phase, the sizes and the
settings that lower it, with no traceback, and leaves the output directory's files byte for byte as they were
(a checkpoint and a user's file; an error after the first step finds the earlier run's checkpoint moved aside).
The errors are raised by monkeypatching the phase's model call (tests only)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny import save_tiny_chat_model, write_tiny_recipe
from transformers import AutoModelForCausalLM, LlamaForCausalLM, LlamaModel

from dfpo_trl.cli.main import main
from dfpo_trl.groups.prepass import PrePass

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "trl_hooks"))
import test_vllm_colocate  # noqa: E402

stand_in_vllm = test_vllm_colocate.stand_in_vllm  # the fixture, shared

pytestmark = pytest.mark.usefixtures("one_thread")


def out_of_memory(*args: Any, **kwargs: Any) -> Any:
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


def raise_in_grad_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    forward = LlamaModel.forward  # the inner model: accelerate may wrap the outer one's forward on the instance

    def patched(self: Any, *args: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled():  # the loss micro-step's forward: old log-probs and pre-pass are no-grad
            out_of_memory()
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(LlamaModel, "forward", patched)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_chat_model(tmp_path_factory.mktemp("tiny_oom"))


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def run_until_oom(tmp_path: Path, model_dir: Path, capsys: pytest.CaptureFixture[str], after_first_step: bool = False,
                  **changes: Any) -> str:
    """The run ends out of memory; an earlier run's checkpoint is where it was, or, when the error came after this
    (fresh) run's first step, in previous_run/ (moved, as every earlier run's results then are: cli.md)."""
    out = tmp_path / "out"
    (out / "checkpoint-1").mkdir(parents=True)
    (out / "checkpoint-1" / "model.safetensors").write_bytes(b"\x00weights\xff")
    (out / "notes.txt").write_text("mine\n")
    before = snapshot(out)
    if after_first_step:
        before = {("previous_run/" if name.startswith("checkpoint-") else "") + name: data
                  for name, data in before.items()}
    argv = write_tiny_recipe(tmp_path, model_dir, out, **changes)
    capsys.readouterr()
    assert main(argv) == 1
    assert snapshot(out) == before
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("dfpo-train:")]
    assert len(lines) == 1 and lines[0] == err.strip().splitlines()[-1]
    line = lines[0]
    assert line.startswith("dfpo-train: error: out of memory in the ")
    batch = changes.get("per_device_train_batch_size", 4)
    for size in ("completions (G = 4)", "max_completion_length 4", f"per_device_train_batch_size {batch}"):
        assert size in line
    assert f"Nothing in {out} was removed; its checkpoints stay" in line
    return line


def test_transformers_generation(tmp_path: Path, model_dir: Path, capsys: pytest.CaptureFixture[str],
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)  # restored after: dfpo-train sets it in-process
    monkeypatch.setattr(LlamaForCausalLM, "generate", out_of_memory)
    line = run_until_oom(tmp_path, model_dir, capsys, skip_eval=True)
    assert "out of memory in the generation (transformers generate) at step 0 " in line
    assert "--steps_per_generation (now 2: 8 completions per generate call)" in line
    assert "PYTORCH_CUDA_ALLOC_CONF" not in line  # dfpo-train set expandable segments itself (allocator.py)


def test_expandable_segments_are_suggested_when_the_user_turned_them_off(
        tmp_path: Path, model_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")
    monkeypatch.setattr(LlamaForCausalLM, "generate", out_of_memory)
    line = run_until_oom(tmp_path, model_dir, capsys, skip_eval=True)
    assert line.endswith("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (fragmentation). Nothing in "
                         f"{tmp_path / 'out'} was removed; its checkpoints stay")


def test_loss_micro_step(tmp_path: Path, model_dir: Path, capsys: pytest.CaptureFixture[str],
                         monkeypatch: pytest.MonkeyPatch) -> None:
    raise_in_grad_forward(monkeypatch)
    line = run_until_oom(tmp_path, model_dir, capsys, skip_eval=True, gradient_checkpointing=False)
    assert "out of memory in the loss micro-step (forward and backward) at step 0 " in line
    assert "--per_device_train_batch_size 2 with --group_layout pre_pass" in line
    assert "--gradient_checkpointing true, --max_completion_length (now 4)" in line  # suggested only when off


def test_dfpo_pre_pass(tmp_path: Path, model_dir: Path, capsys: pytest.CaptureFixture[str],
                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(PrePass, "forward", out_of_memory)
    line = run_until_oom(tmp_path, model_dir, capsys, True, skip_eval=True, group_layout="pre_pass",
                         per_device_train_batch_size=2)  # groups of 4 split over micro-steps: the pre-pass runs
    assert "out of memory in the DFPO pre-pass at step 1 " in line  # the first off-policy step
    assert "--prepass_batch_size (now 8 rows per no-grad chunk)" in line


def test_held_out_greedy_evaluation(tmp_path: Path, model_dir: Path, capsys: pytest.CaptureFixture[str],
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(LlamaForCausalLM, "generate", out_of_memory)
    line = run_until_oom(tmp_path, model_dir, capsys)
    assert "out of memory in the held-out evaluation at step 0 " in line
    assert "--eval_batch_size (now 4); --eval_max_new_tokens (now 4); --skip_eval true" in line


def test_vllm_generation(tmp_path: Path, model_dir: Path, capsys: pytest.CaptureFixture[str],
                         monkeypatch: pytest.MonkeyPatch, stand_in_vllm: Any) -> None:
    stand_in_vllm(AutoModelForCausalLM.from_pretrained(model_dir))
    monkeypatch.setattr(test_vllm_colocate.StandInEngine, "generate", out_of_memory)
    line = run_until_oom(tmp_path, model_dir, capsys, use_vllm=True, vllm_mode="colocate", skip_eval=True)
    assert "out of memory in the generation (vLLM) at step 0 " in line
    assert "--vllm_gpu_memory_utilization (now 0.3" in line


def test_held_out_avg_at_k_through_vllm(tmp_path: Path, model_dir: Path, capsys: pytest.CaptureFixture[str],
                                        monkeypatch: pytest.MonkeyPatch, stand_in_vllm: Any) -> None:
    stand_in_vllm(AutoModelForCausalLM.from_pretrained(model_dir))
    monkeypatch.setattr(test_vllm_colocate.StandInEngine, "generate", out_of_memory)
    line = run_until_oom(tmp_path, model_dir, capsys, use_vllm=True, vllm_mode="colocate")
    assert "out of memory in the held-out evaluation (generation (vLLM)) at step 0 " in line
    # the recipe leaves per_device_eval_batch_size unset: k = 4 x the 4 held-out problems = 16 rows, capped at the
    # training rollout's 8 (dfpo_trl.testing's tiny recipe: per_device_train_batch_size 4 x steps_per_generation 2)
    assert "--per_device_eval_batch_size (now 8); --num_generations_eval (k of avg@k, now 4)" in line


def test_held_out_avg_at_k_forwards_name_the_engine_share_and_the_training_batch(
        tmp_path: Path, model_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        stand_in_vllm: Any) -> None:
    """Out of memory in the avg@k evaluation's forwards (after its vLLM generation): the eval batch does not set their
    memory (each forward has the training batch's rows), so the line names the engine's share and that batch."""
    from dfpo_trl import DFPOTrainer

    stand_in_vllm(AutoModelForCausalLM.from_pretrained(model_dir))
    helper = DFPOTrainer._get_per_token_logps_and_entropies

    def patched(self: Any, model: Any, *args: Any, **kwargs: Any) -> Any:
        if not self.model.training:  # the evaluation's old log-probs and loss forwards
            out_of_memory()
        return helper(self, model, *args, **kwargs)

    monkeypatch.setattr(DFPOTrainer, "_get_per_token_logps_and_entropies", patched)
    line = run_until_oom(tmp_path, model_dir, capsys, use_vllm=True, vllm_mode="colocate")
    assert "out of memory in the held-out evaluation at step 0 " in line
    assert ("lower it with --vllm_gpu_memory_utilization (now 0.3; the engine's share of the GPU, the rest is the "
            "trainer's); --per_device_train_batch_size (now 4: the rows of each of the evaluation's forwards); "
            "--skip_eval true.") in line
