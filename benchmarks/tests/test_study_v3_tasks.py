"""dfpo_bench.study_v3_tasks: the count-equalising rewards give each rewarded form the same total advantage in a
group (TRL's advantage under scale_rewards none: r − mean r), leave the group mean and the unrewarded rows alone, and
the strict task rewards other wordings 0."""

from __future__ import annotations

import statistics

import pytest

from dfpo_bench import study_v3_tasks as v3  # noqa: E402


def centred(values: list[float]) -> list[float]:
    mean = statistics.fmean(values)
    return [v - mean for v in values]


@pytest.mark.parametrize("rewards, forms", [
    ([1, 1, 1, 0, 1, 0, 0, 0], [0, 0, 0, None, 1, None, None, None]),  # 3 "sum" : 1 "answer"
    ([1, 1, 1, 1, 1, 0, 1, 0], [1, 0, 1, 1, 1, None, 1, None]),  # 1 : 5
    ([1, 1, 0, 0], [0, 1, None, None]),  # already equal: unchanged
])
def test_each_rewarded_form_gets_the_same_total_advantage(rewards: list[int], forms: list[int | None]) -> None:
    new = v3.count_equalised_rewards([float(r) for r in rewards], forms)
    a_old, a_new = centred([float(r) for r in rewards]), centred(new)
    assert statistics.fmean(new) == pytest.approx(statistics.fmean(rewards), rel=1e-12)
    totals = {f: sum(a for a, g in zip(a_new, forms, strict=True) if g == f) for f in {0, 1}}
    assert totals[0] == pytest.approx(totals[1], rel=1e-12)
    n_r, p = sum(rewards), sum(rewards) / len(rewards)
    assert totals[0] == pytest.approx(n_r * (1 - p) / 2, rel=1e-12)
    for i, r in enumerate(rewards):  # unrewarded rows: the same advantage −p
        if r == 0:
            assert a_new[i] == pytest.approx(a_old[i], rel=1e-12)
        else:  # rewarded: w_f (1 − p), w_f = n_R / (2 n_f)
            n_f = sum(1 for j, g in enumerate(forms) if rewards[j] and g == forms[i])
            assert a_new[i] == pytest.approx(n_r / (2 * n_f) * (1 - p), rel=1e-12)


def test_one_form_or_none_rewarded_leaves_the_rewards_alone() -> None:
    assert v3.count_equalised_rewards([1.0, 1.0, 0.0], [0, 0, None]) == pytest.approx([1.0, 1.0, 0.0], rel=1e-12)
    assert v3.count_equalised_rewards([0.0, 0.0], [None, None]) == [0.0, 0.0]
    with pytest.raises(ValueError, match="0/1 rewards"):
        v3.count_equalised_rewards([0.5, 1.0], [None, 0])


def test_the_correction_reward_works_per_group_of_row_ids() -> None:
    task = v3.equalised()
    texts = ["The sum is 8.", "The sum is 8.", "The answer is 8.", "8", "The sum is 3.", "The answer is 3.", "x", "y"]
    completions = [[{"role": "assistant", "content": t}] for t in texts]
    answer, row_id = [8] * 4 + [3] * 4, [0] * 4 + [1] * 4
    strict = task.reward_funcs[0](prompts=[None] * 8, completions=completions, answer=answer)
    assert strict == [1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 0.0, 0.0]  # other wordings get 0, not 0.5
    fix = task.reward_funcs[1](prompts=[None] * 8, completions=completions, answer=answer, row_id=row_id)
    total = [s + c for s, c in zip(strict, fix, strict=True)]
    assert total[:4] == pytest.approx(v3.count_equalised_rewards(strict[:4], [0, 0, 1, None]), rel=1e-12)
    assert fix[4:] == pytest.approx([0.0] * 4, abs=1e-12)  # 1 : 1 already
    assert sum(fix[:4]) == pytest.approx(0.0, abs=1e-12)  # the group's mean reward is unchanged
    rows = v3.strict().build_dataset("train", 5, seed=1)
    assert rows["row_id"] == [0, 1, 2, 3, 4]
