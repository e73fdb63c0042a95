"""Held-out avg@k through TRL's evaluation path with colocated vLLM, on the CPU through the stand-in engine of
``test_vllm_colocate``: the callback's avg@k is the mean over problems of the mean reward of the k completions per
problem that the engine returned during each evaluation (before, along and after training)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from tiny import addition_dataset, base_args, last_digit_reward, tiny_model, tiny_tokenizer

from dfpo_trl import DFPOConfig, DFPOTrainer
from dfpo_trl.cli.args import RecipeError
from dfpo_trl.cli.vllm_eval import avg_at_k_callback, check_eval_batch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import test_vllm_colocate  # noqa: E402
from test_vllm_colocate import COLOCATE, StandInEngine  # noqa: E402

stand_in_vllm = test_vllm_colocate.stand_in_vllm  # the fixture, shared

pytestmark = pytest.mark.usefixtures("one_thread")


def test_avg_at_k_is_the_mean_over_problems_of_the_engines_k_rewards(stand_in_vllm: Any) -> None:  # noqa: F811
    policy, tokenizer = tiny_model(), tiny_tokenizer()
    stand_in_vllm(policy)
    k, problems = 4, addition_dataset(n=5, seed=3)
    args = DFPOConfig(**base_args(**{**COLOCATE, "max_steps": 2, "num_generations_eval": k,
                                     "per_device_eval_batch_size": 8}))
    reward_funcs: list[Any] = [last_digit_reward]
    callback = avg_at_k_callback(None, problems, reward_funcs, args, every=1)
    trainer = DFPOTrainer(model=policy, reward_funcs=reward_funcs, train_dataset=addition_dataset(),
                          eval_dataset=problems, processing_class=tokenizer, args=args, callbacks=[callback])
    callback.trainer = trainer
    engine, = StandInEngine.built
    # Every completion the engine returns while the policy is in eval mode, split by evaluation.
    evaluations: list[list[tuple[list[int], list[int]]]] = []
    generate, evaluate = engine.generate, trainer.evaluate

    def recording_generate(prompts: list[dict[str, list[int]]], sampling_params: Any, **kw: Any) -> list:
        outputs = generate(prompts, sampling_params, **kw)
        if not policy.training:
            evaluations[-1].extend((list(o.prompt_token_ids), list(o.outputs[0].token_ids)) for o in outputs)
        return outputs

    def marked_evaluate(*a: Any, **kw: Any) -> Any:
        evaluations.append([])
        return evaluate(*a, **kw)

    engine.generate, trainer.evaluate = recording_generate, marked_evaluate
    trainer.train()

    answers = {p: a for p, a in zip(problems["prompt"], problems["answer"], strict=True)}
    expected = []
    for completions in evaluations:
        by_problem: dict[str, list[float]] = {}
        for prompt_ids, tokens in completions:
            prompt = tokenizer.decode(prompt_ids, skip_special_tokens=True)
            text = tokenizer.decode(tokens, skip_special_tokens=True)
            by_problem.setdefault(prompt, []).extend(last_digit_reward([prompt], [text], [answers[prompt]]))
        assert sorted(by_problem) == sorted(answers) and {len(v) for v in by_problem.values()} == {k}
        expected.append(sum(sum(v) / k for v in by_problem.values()) / len(by_problem))
    assert len(evaluations) == 3  # before, at step 1 (every=1), after the last step
    assert [value for _, value in callback.results["curve"]] == pytest.approx(expected, abs=1e-12)
    assert [step for step, _ in callback.results["curve"]] == [0, 1, 2]
    assert callback.results["metric"] == f"avg@{k}" and callback.results["n"] == len(problems)
    assert 0 < max(expected), "no completion was ever correct: the comparison cannot tell values apart"
    # TRL's own eval metrics are logged too
    assert any("eval_rewards/last_digit_reward/mean" in row for row in trainer.state.log_history)


def test_an_eval_batch_that_splits_a_problems_k_completions_is_refused() -> None:
    args = DFPOConfig(**base_args(num_generations_eval=3, per_device_eval_batch_size=8))
    with pytest.raises(RecipeError, match=r"per_device_eval_batch_size \(8\).*num_generations_eval \(3.*"
                       r"--per_device_eval_batch_size 6"):
        check_eval_batch(args)


def test_dfpo_train_with_use_vllm_reports_avg_at_k(stand_in_vllm: Any, tmp_path: Path,  # noqa: F811
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """The CLI run: avg@k in the log history, the summary, the printed lines and the figure's title."""
    import json

    from tiny import save_tiny_chat_model, write_tiny_recipe
    from transformers import AutoModelForCausalLM

    from dfpo_trl.cli.main import main

    model_dir = save_tiny_chat_model(tmp_path / "model")
    stand_in_vllm(AutoModelForCausalLM.from_pretrained(model_dir))
    out = tmp_path / "out"
    assert main(write_tiny_recipe(tmp_path, model_dir, out, use_vllm=True, vllm_mode="colocate", num_generations_eval=2,
                                  per_device_eval_batch_size=4, eval_every=1, plot=False)) == 0
    summary = json.loads((out / "dfpo_summary.json").read_text())
    heldout = summary["heldout"]
    assert heldout["metric"] == "avg@2" and [s for s, _ in heldout["curve"]] == [0, 1, 2]
    assert heldout["before"] == heldout["curve"][0][1] and heldout["after"] == heldout["curve"][-1][1]
    rows = summary["log_history"]
    assert any("eval_reward" in row for row in rows)  # TRL's own eval metrics
    assert [r["heldout/accuracy"] for r in rows if "heldout/accuracy" in r] == [heldout["curve"][1][1]]
    printed = capsys.readouterr()
    text = printed.out + printed.err
    assert "held-out avg@2 before training" in text and "held-out avg@2 at step 1" in text
    assert "held-out avg@2            " in text  # the summary's line



def test_the_default_eval_batch_sends_each_evaluation_in_one_call_with_the_same_avg_at_k(
        stand_in_vllm: Any, tmp_path: Path) -> None:  # noqa: F811
    """dfpo-train with per_device_eval_batch_size unset sends all 4 held-out problems x k = 2 in one vLLM call per
    evaluation; set to 2 (one problem per call, as TRL's default 8 does at k = 8) it makes 4 calls. Same engine
    draws in the same order: the same avg@k, before and after training, and the same training."""
    import json

    from tiny import save_tiny_chat_model, write_tiny_recipe
    from transformers import AutoModelForCausalLM

    from dfpo_trl.cli.main import main

    model_dir = save_tiny_chat_model(tmp_path / "model")
    calls: dict[str, list[int]] = {}
    summaries = {}
    for name, extra in {"one_problem_per_call": {"per_device_eval_batch_size": 2}, "default": {}}.items():
        stand_in_vllm(AutoModelForCausalLM.from_pretrained(model_dir))
        calls[name] = []
        generate = StandInEngine.generate

        def counting(self: Any, prompts: list, *args: Any, _name: str = name, _generate: Any = generate,
                     **kwargs: Any) -> list:
            calls[_name].append(len(prompts))
            return _generate(self, prompts, *args, **kwargs)

        StandInEngine.generate = counting  # restored below
        try:
            out = tmp_path / name
            assert main(write_tiny_recipe(tmp_path, model_dir, out, use_vllm=True, vllm_mode="colocate",
                                          num_generations_eval=2, plot=False, **extra)) == 0
        finally:
            StandInEngine.generate = generate
        summaries[name] = json.loads((out / "dfpo_summary.json").read_text())
    rollout = 4 * 2  # per_device_train_batch_size x steps_per_generation: the training's one call per rollout
    assert calls["one_problem_per_call"] == [2] * 4 + [rollout] + [2] * 4  # before, one rollout, after
    assert calls["default"] == [8, rollout, 8]
    slow, fast = summaries["one_problem_per_call"]["heldout"], summaries["default"]["heldout"]
    assert fast["metric"] == slow["metric"] == "avg@2"
    assert (fast["before"], fast["after"]) == (slow["before"], slow["after"])
    train = [[row.get("reward") for row in s["log_history"] if "reward" in row] for s in summaries.values()]
    assert train[0] == train[1] and train[0]


def test_the_evaluations_forwards_run_in_chunks_of_the_training_batch() -> None:
    """In evaluation TRL's log-prob helper gets the whole eval batch; DFPOTrainer's runs it in chunks of
    per_device_train_batch_size rows, with the log-probs and entropies TRL's unchunked call gives."""
    import torch
    from trl import GRPOTrainer

    from dfpo_trl.testing import tiny_trainer

    trainer = tiny_trainer(per_device_train_batch_size=4, per_device_eval_batch_size=12)
    model = trainer.model
    rows: list[int] = []
    hook = model.register_forward_pre_hook(lambda module, args, kwargs: rows.append(kwargs["input_ids"].size(0)),
                                           with_kwargs=True)
    ids = torch.randint(0, model.config.vocab_size, (12, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    model.eval()
    with torch.no_grad():
        ours = trainer._get_per_token_logps_and_entropies(model, ids, mask, 5, compute_entropy=True)
        chunks, rows[:] = list(rows), []
        theirs = GRPOTrainer._get_per_token_logps_and_entropies(trainer, model, ids, mask, 5, compute_entropy=True)
    hook.remove()
    assert chunks == [4, 4, 4] and rows == [12]
    torch.testing.assert_close(ours[0], theirs[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours[1], theirs[1], rtol=1e-5, atol=1e-6)
    model.train()
