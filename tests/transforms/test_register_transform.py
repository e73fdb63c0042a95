"""register_transform: a user's in-group transform, registered by decorator or call, is validated like a built-in,
reaches the loss through DFPOTrainer, gets the same metrics, and is visible to DFPOConfig and dfpo-train only while
registered (docs/source/guides/custom_transform.md). Every test leaves the registry as it found it (the `clean_registry`
fixture)."""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from tiny import capturing, loss_and_grads, make_trainer, random_batch, record_row_weights, with_old_logps
from tolerance import assert_close_to_rounding

import dfpo_trl
from dfpo_trl import DFPOConfig, DFPOTrainer, register_transform, registered_transforms, unregister_transform
from dfpo_trl.objectives.plan import ObjectivePlan
from dfpo_trl.transforms import (
    GROUP_TRANSFORMS,
    TRANSFORMS,
    get_transform,
    min_replace_on_subset,
)
from dfpo_trl.transforms.probe import probe_problem
from dfpo_trl.transforms.registry import _BUILTINS

pytestmark = pytest.mark.usefixtures("one_thread", "clean_registry")

GSPO = dict(importance_sampling_level="sequence", epsilon=0.2, epsilon_high=0.28, steps_per_generation=2)
SEQ = dict(output_dir="/tmp/dfpo-test-out", use_cpu=True, importance_sampling_level="sequence")


@pytest.fixture
def clean_registry() -> Iterator[None]:
    """Remove what a test registered and restore a built-in it replaced, so no other test sees it."""
    before = dict(TRANSFORMS)
    yield
    for name in [n for n, entry in TRANSFORMS.items() if not entry.builtin]:
        unregister_transform(name)
    assert TRANSFORMS == before


def half_min(w: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
    """Toy "equal" transform: every member gets half the group minimum (a scaled Min-Replace, eq. 50)."""
    return 0.5 * w.amin(dim=-1, keepdim=True).expand_as(w)


def median_rebalance(w: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
    """Toy "zero_sum" transform (docs/source/guides/custom_transform.md): cap at the group median, then scale the
    heavier advantage side down so that Σ_i Â_i s̃_i = 0 (as eq. 52–55 do after their floor)."""
    capped = torch.minimum(w, w.median(dim=-1, keepdim=True).values)
    positive, negative = advantages > 0, advantages < 0
    mass_p = (advantages * capped * positive).sum(dim=-1, keepdim=True)
    mass_n = (-advantages * capped * negative).sum(dim=-1, keepdim=True)
    alpha = torch.where(mass_p > mass_n, mass_n / mass_p.clamp(min=1e-30), 1.0)
    beta = torch.where(mass_n > mass_p, mass_p / mass_n.clamp(min=1e-30), 1.0)
    return capped * torch.where(positive, alpha, torch.where(negative, beta, 1.0))


def toy_group(trainer: DFPOTrainer) -> dict:
    """Two members sharing their first two tokens (eq. 33–37's G = 2, T = 3 toy), ratios inside the clip range."""
    ids = torch.tensor([[16, 17, 5], [16, 17, 6]])
    log_ratio = torch.log(torch.tensor([[1.01, 0.99, 1.05], [1.01, 0.99, 0.97]]))
    return with_old_logps(trainer, ids, torch.ones(2, 3, dtype=torch.long), torch.tensor([-1.0, 1.0]), log_ratio)


# ------------------------------------------------------------------------------------------------ registering


def test_decorator_and_call_register_the_function_and_return_it():
    decorated = register_transform("half_min", balances="equal")(half_min)
    assert decorated is half_min
    assert register_transform("median_rebalance", median_rebalance, balances="zero_sum") is median_rebalance
    assert registered_transforms() == (*GROUP_TRANSFORMS, "half_min", "median_rebalance")
    entry = TRANSFORMS["half_min"]
    assert (entry.balance, entry.nonnegative, entry.builtin, entry.retargetable) == ("equal", True, False, False)
    assert "half_min" in entry.source  # who registered it, for error messages
    assert TRANSFORMS["median_rebalance"].retargetable
    assert dfpo_trl.register_transform is register_transform


def test_builtins_pass_the_registration_probe():
    """The probe that guards users' declarations accepts every built-in's own (no false alarms)."""
    for name in GROUP_TRANSFORMS:
        assert probe_problem(TRANSFORMS[name]) is None, name


@pytest.mark.parametrize(
    ("fn", "properties", "message"),
    [
        (lambda w, a: 0.9 * w, dict(balances="zero_sum"), r"declares balances='zero_sum' but \|sum_i A_i w_i\| ="),
        (half_min, dict(balances="zero_sum"), r"balances='zero_sum'.*gradient coefficients a"),  # only centred Â
        (lambda w, a: w, dict(balances="equal"), r"declares balances='equal' but the weights of group"),
        (lambda w, a: w - 1.0, dict(balances="none"), r"declares nonnegative=True but returned"),
        (lambda w, a: w * a.sum(-1, keepdim=True) / (a * a).sum(-1, keepdim=True), dict(balances="none",
         nonnegative=False), r"NaN or Inf in groups \[5\] \(the group whose advantages are all 0\)"),
        (lambda w, a: w[:, :1], dict(balances="none"), r"returned shape \(6, 1\) .* one weight per member"),
        (lambda w, a: w.tolist(), dict(balances="none"), r"must return a floating-point tensor, got list"),
        (lambda w, a: 1 / 0, dict(balances="none"), r"raised ZeroDivisionError"),
        (half_min, dict(balances="equal", subset_balance=lambda w, a, members: w),
         r"subset_balance must balance but \|sum_i A_i w_i\| = .* gradient coefficients a and survivors U"),
    ],
)
def test_a_declared_property_the_function_breaks_is_refused_at_registration(fn, properties, message):
    with pytest.raises((ValueError, TypeError), match=message):
        register_transform("broken", fn, **properties)
    assert "broken" not in TRANSFORMS


@pytest.mark.parametrize(
    ("name", "kwargs", "error", "message"),
    [
        ("half-min", {}, ValueError, r"name='half-min' is not a valid name; use a Python identifier"),
        ("", {}, ValueError, r"name='' is not a valid name"),
        (3, {}, ValueError, r"name=3 is not a valid name"),
        ("min_replace", {}, ValueError, r"'min_replace' is a built-in transform; pass replace=True"),
        ("none", dict(replace=True), ValueError, r"'none' is GSPO itself .* cannot be replaced"),
        ("toy", dict(balances="zero-sum"), ValueError,
         r"balances='zero-sum' is not a balance condition; use 'zero_sum'"),
        ("toy", dict(balances=True), ValueError, r"balances=True is not a balance condition"),
        ("toy", dict(nonnegative="yes"), ValueError, r"nonnegative='yes' must be True or False"),
        ("toy", dict(subset_balance=min_replace_on_subset, balances="none"), ValueError,
         r"subset_balance is the balanced form .* balances='none' declares no balance"),
        ("toy", dict(subset_balance=0.5), TypeError, r"subset_balance must be callable"),
    ],
)
def test_registration_errors_name_the_problem_and_the_fix(name, kwargs, error, message):
    with pytest.raises(error, match=message):
        register_transform(name, half_min, **{"balances": "equal", **kwargs})
    with pytest.raises(TypeError, match="fn must be callable"):
        register_transform("toy", "zero_sum", balances="zero_sum")
    assert registered_transforms() == GROUP_TRANSFORMS


def test_names_are_not_overwritten_unless_replace_and_unregister_restores_builtins():
    register_transform("half_min", half_min, balances="equal")
    with pytest.raises(ValueError, match=r"'half_min' is already registered \(registered: .*half_min\); pass "
                                         r"replace=True"):
        register_transform("half_min", median_rebalance, balances="zero_sum")
    register_transform("half_min", median_rebalance, balances="zero_sum", replace=True)
    assert TRANSFORMS["half_min"].balance == "zero_sum"
    register_transform("min_replace", half_min, balances="equal", replace=True)
    assert not TRANSFORMS["min_replace"].builtin
    unregister_transform("min_replace")
    assert TRANSFORMS["min_replace"] is _BUILTINS["min_replace"]
    with pytest.raises(ValueError, match="'orth_proj' is built in and cannot be removed"):
        unregister_transform("orth_proj")
    unregister_transform("half_min")
    with pytest.raises(ValueError, match=r"no such transform; registered: none, min_replace"):
        unregister_transform("half_min")


def test_the_function_gets_sanitised_compute_dtype_inputs_and_its_result_is_checked_at_every_call():
    seen = []

    def spy(w: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
        seen.append((w.dtype, advantages.dtype, torch.isfinite(w).all().item(), torch.isnan(advantages).any().item()))
        return w if w.size(0) < 3 else w[:1]  # a wrong shape the probe (6 groups) finds, here left unchecked

    register_transform("spy", spy, balances="none", check=False)
    w = torch.tensor([[1.0, float("nan")], [float("inf"), 0.5]], dtype=torch.bfloat16)
    out = get_transform("spy").apply(w, torch.tensor([[1.0, float("nan")], [-1.0, 1.0]]), 0.5, 1e-6)
    assert seen == [(torch.float32, torch.float32, True, False)] and out.dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"group transform 'spy' returned shape \(1, 2\) .* for w of shape \(3, 2\)"):
        get_transform("spy").apply(torch.ones(3, 2), torch.zeros(3, 2), 0.5, 1e-6)


# ------------------------------------------------------------------------------------------------ config, CLI


def test_config_reads_the_registry_when_it_is_built_and_lists_the_registered_names():
    register_transform("median_rebalance", median_rebalance, balances="zero_sum")
    with pytest.raises(ValueError) as info:
        DFPOConfig(**SEQ, group_transform="half_min")
    message = str(info.value)
    assert "group_transform='half_min' is not a DFPO transform; use one of 'none', 'min_replace'" in message
    assert all(repr(name) in message for name in registered_transforms())
    assert "'median_rebalance'" in message and "dfpo_trl.register_transform" in message
    register_transform("half_min", half_min, balances="equal")
    assert DFPOConfig(**SEQ, group_transform="half_min").group_transform == "half_min"
    unregister_transform("half_min")
    with pytest.raises(ValueError, match="is not a DFPO transform"):
        DFPOConfig(**SEQ, group_transform="half_min")


def test_gradient_target_reads_the_declared_balance():
    register_transform("half_min", half_min, balances="equal")
    register_transform("median_rebalance", median_rebalance, balances="zero_sum")
    register_transform("half_min_subset", half_min, balances="equal",
                       subset_balance=lambda w, a, members: 0.5 * min_replace_on_subset(w, a, members))
    register_transform("shrink", lambda w, a: 0.9 * w, balances="none")
    gradient = dict(**SEQ, cancellation_target="gradient")
    with pytest.raises(ValueError, match=r"group_transform='half_min' declares balances='equal' without a subset_"
                                         r"balance.*'truncate_rebalance', 'median_rebalance', 'half_min_subset'"):
        DFPOConfig(**gradient, group_transform="half_min")
    with pytest.raises(ValueError, match=r"group_transform='shrink' has none; use one of .*'median_rebalance'"):
        DFPOConfig(**gradient, group_transform="shrink")
    for name in ("median_rebalance", "half_min_subset"):
        assert not ObjectivePlan.from_config(DFPOConfig(**gradient, group_transform=name)).form.flip_to_score


def test_weights_that_may_go_negative_take_orth_projs_path_under_the_gradient_target():
    register_transform("signed", lambda w, a: w - (a * w).sum(-1, keepdim=True) / (a * a).sum(-1, keepdim=True).clamp(
        min=1e-30) * a, balances="zero_sum", nonnegative=False)  # Orth-Proj (eq. 18) as a user writes it
    gradient = dict(**SEQ, cancellation_target="gradient", group_transform="signed")
    assert ObjectivePlan.from_config(DFPOConfig(**gradient)).form.flip_to_score
    weights = DFPOConfig(**{**gradient, "cancellation_target": "weights"})
    assert not ObjectivePlan.from_config(weights).form.flip_to_score
    with pytest.raises(ValueError, match=r"group_transform='signed' \(weights may be < 0\) with "
                                         r"cancellation_target='gradient' cannot be combined with off_policy_mask"):
        DFPOConfig(**gradient, off_policy_mask_threshold=0.5)



def test_off_policy_mask_is_refused_with_a_registered_balance_under_the_weights_target():
    """TRL's off-policy mask drops rows after the transform balanced the whole group: refused for any transform
    that declares a balance, built-in or registered, and accepted for one without."""
    register_transform("half_min", half_min, balances="equal")
    register_transform("shrink", lambda w, a: 0.9 * w, balances="none")
    with pytest.raises(ValueError, match=r"group_transform='half_min' with cancellation_target='weights' cannot be "
                                         r"combined with off_policy_mask_threshold"):
        DFPOConfig(**SEQ, group_transform="half_min", off_policy_mask_threshold=0.5)
    assert DFPOConfig(**SEQ, group_transform="shrink", off_policy_mask_threshold=0.5).group_transform == "shrink"

def write_plugin(tmp_path: Path, request: pytest.FixtureRequest, name: str, body: str) -> None:
    """A plugin module ``name`` in ``tmp_path``, importable during the test and forgotten after it."""
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(body))
    sys.path.insert(0, str(tmp_path))
    request.addfinalizer(lambda: (sys.path.remove(str(tmp_path)), sys.modules.pop(name, None)))


PLUGIN = """
    from dfpo_trl import register_transform

    @register_transform("plugin_half_min", balances="equal")
    def plugin_half_min(w, advantages):
        return 0.5 * w.amin(dim=-1, keepdim=True).expand_as(w)
"""


def test_cli_imports_plugins_before_checking_the_recipe(tmp_path, request, capsys):
    from dfpo_trl.cli.args import RecipeError
    from dfpo_trl.cli.main import main
    from dfpo_trl.cli.parser import parse_args

    write_plugin(tmp_path, request, "dfpo_toy_plugin", PLUGIN)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("use_cpu: true\nimportance_sampling_level: sequence\ngroup_transform: plugin_half_min\n"
                      "plugins: dfpo_toy_plugin\n")
    script_args, args, _ = parse_args([str(recipe)])
    assert args.group_transform == "plugin_half_min" and script_args.plugins == ["dfpo_toy_plugin"]
    # the flag form, and the help listing what the plugin registered
    _, args, _ = parse_args([str(recipe), "--plugins", "dfpo_toy_plugin", "--group_transform", "min_replace"])
    assert args.group_transform == "min_replace"
    with pytest.raises(SystemExit):
        main(["--plugins", "dfpo_toy_plugin", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "Registered by plugins: 'plugin_half_min' (balances: equal)" in help_text
    with pytest.raises(RecipeError, match=r"plugins: cannot import 'no_such_plugin_module'"):
        parse_args([str(recipe), "--plugins", "no_such_plugin_module"])


def test_cli_without_the_plugin_names_the_fix_and_a_failing_plugin_is_one_line(tmp_path, request):
    from dfpo_trl.cli.args import RecipeError
    from dfpo_trl.cli.parser import parse_args

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("use_cpu: true\nimportance_sampling_level: sequence\ngroup_transform: plugin_half_min\n")
    with pytest.raises(RecipeError, match=r"'plugin_half_min' is not a DFPO transform.*--plugins MODULE"):
        parse_args([str(recipe)])
    write_plugin(tmp_path, request, "dfpo_bad_plugin", """
        from dfpo_trl import register_transform
        register_transform("bad", lambda w, a: w, balances="equal")
    """)
    with pytest.raises(RecipeError, match=r"importing 'dfpo_bad_plugin' failed at .*dfpo_bad_plugin.py:\d+: "
                       r"ValueError: .*balances='equal'"):
        parse_args([str(recipe), "--plugins", "dfpo_bad_plugin"])


# ------------------------------------------------------------------------------------------------ the trainer


def test_trainer_trains_with_the_registered_coefficients():
    """The loss's gradient on every token is -Â_i s̃_i / (L_i B) for survivors of the clip (ratio form, eq. 59–62,
    with s̄ = s unclipped), with s̃ = half the group's minimum s̄: the registered function's output, exactly."""
    register_transform("half_min", half_min, balances="equal")
    trainer = make_trainer(capturing(DFPOTrainer), DFPOConfig, **GSPO, loss_type="grpo", group_transform="half_min")
    used = record_row_weights(trainer)
    ids, mask, adv, log_ratio = random_batch()
    batch = with_old_logps(trainer, ids, mask, adv, log_ratio)
    loss_and_grads(trainer, batch)
    (rows,) = used
    assert torch.equal(rows.s_tilde, half_min(rows.s_bar.view(-1, 4), None).reshape(-1))
    assert rows.survives.any() and not rows.survives.all()  # both branches of the clip are exercised
    c = trainer.captured.grad
    expected = -adv * rows.s_tilde * rows.survives / (mask.sum(1) * ids.size(0))
    assert_close_to_rounding(c, expected[:, None] * mask)
    metrics = trainer._metrics["train"]
    assert {"asym/before", "asym/after", "transform/orth_residual", "transform/phi_min"} <= set(metrics)
    assert_close_to_rounding(metrics["transform/phi_min"][-1], (rows.s_tilde / rows.s_bar).min().item(),
                             dtype=torch.float32)


@pytest.mark.parametrize("target", ["weights", "gradient"])
def test_registered_zero_sum_transform_cancels_shared_tokens(target):
    register_transform("median_rebalance", median_rebalance, balances="zero_sum")
    trainer = make_trainer(capturing(DFPOTrainer), DFPOConfig, **GSPO, loss_type="grpo", num_generations=2,
                           group_transform="median_rebalance", cancellation_target=target)
    loss_and_grads(trainer, toy_group(trainer))
    c = trainer.captured.grad
    assert c[:, :2].abs().max() > 1e-4 and c[:, 2].abs().min() > 1e-4
    assert_close_to_rounding(c[:, :2].sum(0), torch.zeros(2), scale=c[:, :2].abs().sum(0))
    metrics = trainer._metrics["train"]
    assert_close_to_rounding(metrics["cancellation/shared_prefix_residual"][-1], 0.0, scale=1.0, dtype=torch.float32)
    assert metrics["transform/orth_residual"][-1] < 1e-6


def test_an_unchecked_false_balance_shows_in_the_residual_metric():
    """check=False skips the probe: the declaration is then the user's promise, and transform/orth_residual (mean
    over groups of |Σ_i Â_i s̃_i|) reports what the function really does."""
    register_transform("liar", lambda w, a: 0.9 * w, balances="zero_sum", check=False)
    trainer = make_trainer(DFPOTrainer, DFPOConfig, **GSPO, loss_type="grpo", group_transform="liar")
    used = record_row_weights(trainer)
    ids, mask, adv, log_ratio = random_batch()
    loss_and_grads(trainer, with_old_logps(trainer, ids, mask, adv, log_ratio))
    (rows,) = used
    expected = (adv * rows.s_tilde).view(-1, 4).sum(-1).abs().mean()
    assert expected > 1e-2
    assert_close_to_rounding(trainer._metrics["train"]["transform/orth_residual"][-1], expected.item(),
                             scale=(adv * rows.s_tilde).abs().sum().item(), dtype=torch.float32)


def test_the_worked_example_of_the_docs_registers_what_it_says():
    """docs/source/guides/custom_transform.md's plugin module, run as written: it registers "median_rebalance" as
    zero_sum and non-negative, and it is the toy the trainer tests above use."""
    import re

    text = (Path(__file__).resolve().parents[2] / "docs" / "source" / "guides" / "custom_transform.md").read_text()
    module = next(b for b in re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL) if "@register_transform" in b)
    namespace: dict = {}
    exec(compile(module, "docs/source/guides/custom_transform.md", "exec"), namespace)
    entry = TRANSFORMS["median_rebalance"]
    assert (entry.balance, entry.nonnegative, entry.retargetable) == ("zero_sum", True, True)
    gen = torch.Generator().manual_seed(3)
    w, adv = torch.exp(0.3 * torch.randn(5, 4, generator=gen)), torch.randn(5, 4, generator=gen)
    assert torch.equal(namespace["median_rebalance"](w, adv), median_rebalance(w, adv))
    assert torch.equal(get_transform("median_rebalance").apply(w, adv, 0.5, 1e-6), median_rebalance(w, adv))
