"""A TRL that moves under DFPO stops it loudly.

Each test simulates a TRL change in a fresh interpreter that patches ``trl.GRPOTrainer`` *before* importing
``dfpo_trl``, as an upgraded TRL would present itself, and checks what DFPO does: a renamed hook or parameter
stops the import with an error naming the supported TRL range, reordered parameters are still read by name, a
version outside the tested range warns, and a TRL loss that no longer lets DFPO rewrite its inputs raises at the
first loss instead of silently training GSPO.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HELPERS = textwrap.dedent(
    """
    import functools, inspect, sys, warnings
    import torch
    import trl
    from trl import GRPOTrainer
    """
)
TRAINER = textwrap.dedent(
    """
    from tiny import make_trainer, random_batch, with_old_logps
    from dfpo_trl import DFPOConfig, DFPOTrainer
    GSPO = dict(importance_sampling_level="sequence", loss_type="grpo", steps_per_generation=2)
    """
)


def run_python(patch: str, body: str, with_trainer: bool = False) -> subprocess.CompletedProcess:
    """Run ``body`` in a fresh interpreter after ``patch`` changed TRL (and, if asked, DFPO's test helpers)."""
    code = HELPERS + textwrap.dedent(patch) + (TRAINER if with_trainer else "") + textwrap.dedent(body)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300,
                          cwd=ROOT)


def assert_refused(result: subprocess.CompletedProcess, *fragments: str) -> None:
    assert result.returncode != 0, result.stdout + result.stderr
    assert "TRLCompatibilityError" in result.stderr, result.stderr
    for fragment in (">=1.16.0,<1.17", *fragments):
        assert fragment in result.stderr, result.stderr


def test_renamed_compute_loss_stops_the_import():
    """TRL renaming ``_compute_loss`` used to turn every transform into GSPO's exact loss, silently."""
    result = run_python(
        """
        GRPOTrainer._compute_policy_loss = GRPOTrainer._compute_loss
        del GRPOTrainer._compute_loss
        """,
        "from dfpo_trl import DFPOConfig\n",
    )
    assert_refused(result, "GRPOTrainer._compute_loss does not exist")


def test_a_removed_trl_helper_stops_the_import():
    result = run_python(
        """
        import trl.trainer.utils
        del trl.trainer.utils.split_tensor_dict
        """,
        "from dfpo_trl import DFPOConfig\n",
    )
    assert_refused(result, "a TRL helper is gone", "split_tensor_dict")


@pytest.mark.parametrize("patch, fragment", [
    ("del VLLMGeneration.sync_weights", "VLLMGeneration.sync_weights does not exist"),
    ("del VLLMGeneration._init_vllm", "VLLMGeneration._init_vllm does not exist"),
    ("VLLMGeneration.generate = lambda self, prompt_ids, images, num_generations, profiler=None: None",
     "VLLMGeneration.generate has parameters (prompt_ids, images, num_generations, profiler)"),
])
def test_a_vllm_backend_without_a_watched_method_stops_the_import(patch: str, fragment: str):
    """The watchdog overrides TRL's VLLMGeneration (trl_hooks/sync_watchdog.py): a TRL whose backend lost one of
    those methods, or renamed a parameter DFPO passes by position, would bypass the deadline silently."""
    result = run_python(f"from trl.generation.vllm_generation import VLLMGeneration\n{patch}\n",
                        "from dfpo_trl import DFPOConfig\n")
    assert_refused(result, fragment)


def test_renamed_parameter_of_the_log_prob_helper_stops_the_import():
    result = run_python(
        """
        original = GRPOTrainer._get_per_token_logps_and_entropies
        def renamed(self, model, input_ids, attention_mask, num_logits_to_keep, batch_size=None, **kwargs):
            return original(self, model, input_ids, attention_mask, num_logits_to_keep, batch_size, **kwargs)
        GRPOTrainer._get_per_token_logps_and_entropies = renamed
        """,
        "from dfpo_trl import DFPOConfig\n",
    )
    assert_refused(result, "_get_per_token_logps_and_entropies has parameters", "logits_to_keep")


def test_reordered_parameters_of_compute_loss_stop_the_import():
    """DFPO's override declares (model, inputs) and TRL passes them by position: a swap must not go unnoticed."""
    result = run_python(
        """
        original = GRPOTrainer._compute_loss
        def swapped(self, inputs, model):
            return original(self, model, inputs)
        GRPOTrainer._compute_loss = swapped
        """,
        "from dfpo_trl import DFPOConfig\n",
    )
    assert_refused(result, "_compute_loss has parameters (inputs, model)", "in this order")


def test_reordered_parameters_of_the_log_prob_helper_are_read_by_name():
    """TRL reordering ``_get_per_token_logps_and_entropies``'s parameters (and its callers with it): DFPO's own
    calls pass names, and its hooks read ``logits_to_keep`` by name, so DelTA's captured hidden states still line
    up with the completion tokens. (Position 2 used to be taken for ``logits_to_keep``.)"""
    result = run_python(
        """
        original = GRPOTrainer._get_per_token_logps_and_entropies
        def reordered(self, model, logits_to_keep, input_ids, attention_mask, batch_size=None, **kwargs):
            return original(self, model, input_ids, attention_mask, logits_to_keep, batch_size, **kwargs)
        GRPOTrainer._get_per_token_logps_and_entropies = reordered
        """,
        """
        trainer = make_trainer(DFPOTrainer, DFPOConfig, importance_sampling_level="token", loss_type="dapo",
                               token_weighting="delta", steps_per_generation=2)
        ids, mask, adv, _ = random_batch()
        output = dict(prompt_ids=torch.full((8, 3), 13), prompt_mask=torch.ones(8, 3, dtype=torch.long),
                      completion_ids=ids, completion_mask=mask, advantages=adv)
        capture = trainer.capture_hidden_states(output)
        assert capture.hidden.shape[:2] == ids.shape, capture.hidden.shape
        print("OK", tuple(capture.hidden.shape))
        """,
        with_trainer=True,
    )
    assert result.returncode == 0, result.stderr
    assert "OK (8, 6, 32)" in result.stdout


def test_untested_trl_version_warns_when_every_check_passes():
    result = run_python(
        """
        trl.__version__ = "1.17.0"
        """,
        """
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import dfpo_trl.trl_hooks.compat as compat
        names = [type(w.message).__name__ for w in caught if isinstance(w.message, compat.UntestedTRLWarning)]
        print(names, [str(w.message) for w in caught if isinstance(w.message, compat.UntestedTRLWarning)])
        """,
    )
    assert result.returncode == 0, result.stderr
    assert "['UntestedTRLWarning']" in result.stdout
    assert "trl 1.17.0 is installed" in result.stdout and ">=1.16.0,<1.17" in result.stdout


BYPASS = """
original = GRPOTrainer._compute_loss
def bypassing(self, model, inputs):
    # A TRL whose loss computes its log-probs without the hooked helper (e.g. renamed internally).
    self.__dict__["_get_per_token_logps_and_entropies"] = functools.partial(
        GRPOTrainer._get_per_token_logps_and_entropies, self)
    try:
        return original(self, model, inputs)
    finally:
        del self.__dict__["_get_per_token_logps_and_entropies"]
GRPOTrainer._compute_loss = bypassing
"""


@pytest.mark.parametrize(
    ("options", "raises"),
    [('dict(group_transform="min_replace")', True), ('dict(group_transform="orth_proj")', True),
     ("dict()", False)],
)
def test_a_loss_that_skips_the_rewrite_raises_when_dfpo_is_on(options, raises):
    result = run_python(
        BYPASS,
        f"""
        trainer = make_trainer(DFPOTrainer, DFPOConfig, **GSPO, **{options})
        ids, mask, adv, log_ratio = random_batch()
        try:
            trainer.compute_loss(trainer.model, with_old_logps(trainer, ids, mask, adv, log_ratio))
        except Exception as exc:
            print("RAISED", type(exc).__name__, exc)
        else:
            print("NO ERROR")
        """,
        with_trainer=True,
    )
    assert result.returncode == 0, result.stderr
    if raises:
        assert "RAISED TRLCompatibilityError" in result.stdout, result.stdout
        assert "group_transform=" in result.stdout and ">=1.16.0,<1.17" in result.stdout
    else:
        assert "NO ERROR" in result.stdout, result.stdout
