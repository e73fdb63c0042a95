"""DFPOConfig refuses bad input with a message that names the field and the fix."""

from __future__ import annotations

import pytest
from tiny import base_args

from dfpo_trl import DFPOConfig

SEQ = dict(importance_sampling_level="sequence", loss_type="grpo")


def config(**overrides):
    return DFPOConfig(**base_args(**overrides))


def test_defaults_are_trl_defaults_plus_dfpo_fields():
    cfg = config()
    assert cfg.group_transform == "none" and cfg.transform_gradient == "ratio" and cfg.transform_stop_gradient
    assert not cfg.symmetric_clip and not cfg.sequence_rewrite_active


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(**SEQ, group_transform="minreplace"), r"group_transform=.minreplace. is not a DFPO transform"),
        (dict(group_transform="min_replace"), r"needs importance_sampling_level='sequence'"),
        (dict(**SEQ, transform_gradient="grad"), r"transform_gradient='grad' is not valid"),
        (dict(**SEQ, num_generations=1, per_device_train_batch_size=1), r"num_generations=1.*num_generations >= 2"),
        (dict(importance_sampling_level="sequence", loss_type="cispo", group_transform="orth_proj"),
         r"loss_type='cispo' does not use.*'dapo'"),
        (dict(**SEQ, group_transform="scale", transform_scale=0.0), r"transform_scale=0.0 must be a finite number > 0"),
        (dict(**SEQ, group_transform="truncate_rebalance", transform_truncate_floor=-1.0),
         r"transform_truncate_floor=-1.0 must be in \(0, 1\)"),
        (dict(**SEQ, transform_gradient="score", transform_stop_gradient=False),
         r"transform_stop_gradient=False .* does not apply to transform_gradient='score'"),
        (dict(**SEQ, symmetric_clip=True), r"symmetric_clip=True .* token-level.*importance_sampling_level='token'"),
        (dict(symmetric_clip=True, loss_type="sapo"), r"loss_type='sapo' does not use"),
        (dict(symmetric_clip=True, loss_type="luspo"), r"cannot be combined with loss_type=.luspo."),
        (dict(symmetric_clip=True, beta=0.1), r"beta != 0 and use_bias_correction_kl=True"),
        (dict(**SEQ, transform_gradient="score", off_policy_mask_threshold=0.5), r"off_policy_mask_threshold"),
        (dict(group_layout="redistribute"), r"group_layout='redistribute' is not valid; use one of 'auto'"),
        (dict(prepass_batch_size=0), r"prepass_batch_size=0 must be a positive integer"),
    ],
)
def test_bad_input_is_refused_with_a_named_field(overrides, message):
    with pytest.raises(ValueError, match=message):
        config(**overrides)


def test_symmetric_clip_with_kl_is_fine_without_bias_correction():
    cfg = config(symmetric_clip=True, beta=0.1, use_bias_correction_kl=False)
    assert cfg.symmetric_clip


def test_trainer_refuses_a_plain_grpo_config():
    from tiny import make_trainer
    from trl import GRPOConfig

    from dfpo_trl import DFPOTrainer

    with pytest.raises(TypeError, match="DFPOConfig"):
        make_trainer(DFPOTrainer, GRPOConfig)


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (dict(epsilon=-1.0), "epsilon"),
        (dict(epsilon=0.0), "epsilon"),
        (dict(epsilon=float("nan")), "epsilon"),
        (dict(epsilon_high=-0.1), "epsilon_high"),
        (dict(epsilon=0.2, delta=1.0), "delta"),
        (dict(steps_per_generation=0), "steps_per_generation"),
        (dict(num_iterations=0), "num_iterations"),
        (dict(gradient_accumulation_steps=0), "gradient_accumulation_steps"),
        (dict(max_completion_length=0), "max_completion_length"),
        (dict(temperature=0.0), "temperature"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-1), "top_k"),
        (dict(beta=-0.1), "beta"),
        (dict(learning_rate=-1e-5), "learning_rate"),
        (dict(learning_rate=float("inf")), "learning_rate"),
        (dict(**SEQ, group_transform="scale", transform_scale=float("inf")), "transform_scale"),
        (dict(**SEQ, group_transform="scale", transform_scale=float("nan")), "transform_scale"),
        (dict(transform_truncate_floor=2.0), "transform_truncate_floor"),
        (dict(token_weighting="delta", delta_lambda_max=float("inf")), "delta_lambda_max"),
        (dict(token_weighting="delta", delta_gamma=float("inf")), "delta_gamma"),
    ],
)
def test_out_of_range_values_are_refused_naming_the_field(overrides, field):
    with pytest.raises(ValueError, match=rf"invalid value\(s\): {field}="):
        config(**overrides)


def test_every_range_problem_is_reported_at_once():
    with pytest.raises(ValueError) as info:
        config(temperature=0.0, learning_rate=-1.0)
    assert "temperature=0.0 must be > 0" in str(info.value) and "learning_rate=-1.0 must be > 0" in str(info.value)


def test_in_range_edges_are_accepted():
    cfg = config(epsilon=1.0, epsilon_high=None, beta=0.0, top_k=0, top_p=1.0, max_completion_length=1)
    assert cfg.epsilon == 1.0


def test_checkpointing_default_on_and_either_name_without_a_deprecation_warning(recwarn):
    assert config().gradient_checkpointing is True
    assert config(gradient_checkpointing=False).gradient_checkpointing is False
    from dfpo_trl.config.fields import HAS_ACTIVATION_CHECKPOINTING

    if HAS_ACTIVATION_CHECKPOINTING:
        off = config(activation_checkpointing=False)
        assert off.activation_checkpointing is False and off.gradient_checkpointing is False
    assert not [w for w in recwarn if "checkpointing" in str(w.message)]


def test_every_builtin_transform_is_validated_and_documented():
    """One registry (dfpo_trl.transforms.TRANSFORMS) feeds config validation, the trainer and the docs: every
    built-in name is accepted by DFPOConfig and listed in its docstring and in the config reference page
    (registered ones: tests/transforms/test_register_transform.py)."""
    from dfpo_trl.config.docs import PAGE
    from dfpo_trl.transforms import GROUP_TRANSFORMS

    row = next(line for line in PAGE.read_text().splitlines() if line.startswith("| `group_transform` |"))
    docstring = DFPOConfig.__doc__.split("group_transform (")[1].split("transform_scale (")[0]
    for name in GROUP_TRANSFORMS:
        assert f'`"{name}"`' in row, name
        assert f'`"{name}"`' in docstring, name
        DFPOConfig(output_dir="/tmp/x", use_cpu=True, group_transform=name, importance_sampling_level="sequence")
    with pytest.raises(ValueError, match="is not a DFPO transform"):
        DFPOConfig(output_dir="/tmp/x", use_cpu=True, group_transform="not_registered")


def test_forcing_a_layout_the_sizes_cannot_make_exact_is_refused():
    """group_layout='redistributed' on one process (or per-device batch × processes not a multiple of G) cannot
    give every micro-step whole groups: refused at construction, naming the fields; 'pre_pass' can be forced."""
    from tiny import make_trainer

    from dfpo_trl import DFPOTrainer

    sizes = dict(**SEQ, group_transform="min_replace", per_device_train_batch_size=2, num_generations=4,
                 steps_per_generation=4, gradient_accumulation_steps=2)
    with pytest.raises(ValueError, match=r"group_layout='redistributed' needs per_device_train_batch_size × "
                                         r"num_processes = 2 × 1 to be a multiple of num_generations=4"):
        make_trainer(DFPOTrainer, DFPOConfig, **sizes, group_layout="redistributed")
    assert make_trainer(DFPOTrainer, DFPOConfig, **sizes, group_layout="pre_pass").group_layout == "pre_pass"
    assert make_trainer(DFPOTrainer, DFPOConfig, **sizes).group_layout == "pre_pass"  # auto, one process


@pytest.mark.parametrize(("prepass_batch_size", "chunks"), [(None, [8]), (3, [3, 3, 2])])
def test_pre_pass_forwards_in_chunks_of_prepass_batch_size(prepass_batch_size, chunks):
    """The pre-pass's no-grad forward runs in chunks of prepass_batch_size rows (default 4 × the per-device batch:
    no activations are kept, and under ZeRO-3 every chunk gathers the weights again); s̄ does not depend on it."""
    import torch
    from tiny import hand_batch, make_trainer
    from tolerance import assert_close_to_rounding

    from dfpo_trl import DFPOTrainer
    from dfpo_trl.groups.prepass import PrePass
    from dfpo_trl.objectives.step import WholeGroups, objective_values
    from dfpo_trl.objectives.weights import loss_mask

    trainer = make_trainer(DFPOTrainer, DFPOConfig, **SEQ, group_transform="min_replace", per_device_train_batch_size=2,
                           num_generations=4, steps_per_generation=4, gradient_accumulation_steps=2,
                           prepass_batch_size=prepass_batch_size)
    assert trainer.group_layout == "pre_pass"
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 20, (8, 5), generator=g)
    batch = hand_batch(ids, torch.ones(8, 5, dtype=torch.long), torch.randn(8, generator=g),
                       -1.0 - 0.1 * torch.rand(8, 5, generator=g))
    seen: list[int] = []

    def recording(*, input_ids, **kwargs):  # noqa: ANN001, ANN003, ANN202
        seen.append(input_ids.size(0))
        return trainer.pre_pass.log_probs(input_ids=input_ids, **kwargs)

    def s_bar(of: DFPOTrainer, logps: torch.Tensor) -> torch.Tensor:  # the objective of the two whole groups
        values = objective_values(of.plan, logps, batch["old_per_token_logps"], batch["advantages"], loss_mask(batch),
                                  WholeGroups(index=torch.arange(8).view(2, 4)), of._trl_loss())
        return values.weights.s_bar

    pre_pass = PrePass(trainer.layout.shape, trainer.plan, trainer.accelerator, trainer.dfpo_metrics,
                       recording)  # its log-prob helper: data in
    chunked = s_bar(trainer, pre_pass.policy_logps(batch, torch.arange(8), trainer.model))
    assert seen == chunks
    one_by_one = make_trainer(DFPOTrainer, DFPOConfig, **SEQ, group_transform="min_replace",
                              per_device_train_batch_size=2, num_generations=4, steps_per_generation=4,
                              gradient_accumulation_steps=2, prepass_batch_size=1)
    reference = s_bar(one_by_one, one_by_one.pre_pass.policy_logps(batch, torch.arange(8), one_by_one.model))
    assert_close_to_rounding(chunked, reference)  # forwards of other batch sizes: equal up to float32 rounding


# ------------------------------------------------------------------------------------ one rule per field
@pytest.mark.parametrize(
    ("name", "refused", "accepted"),
    [
        # Was checked twice: > 0 in one place, finite and in (0, 1) in another; now one rule, (0, 1).
        ("transform_truncate_floor", [0.0, -1.0, 1.0, 2.0, float("nan"), float("inf")], [1e-6, 0.5]),
        # Was checked twice: > 0 in one place, finite and > 0 in another; now one rule, finite and > 0.
        ("transform_scale", [0.0, -0.5, float("inf"), float("nan")], [0.5, 2.0]),
    ],
)
def test_formerly_doubled_fields_have_one_rule(name, refused, accepted):
    for value in refused:
        with pytest.raises(ValueError, match=rf"invalid value\(s\): {name}={value!r} must be") as info:
            config(**{name: value})
        assert str(info.value).count(name) == 1, info.value  # one message, not two rules' worth
    for value in accepted:
        assert getattr(config(**{name: value}), name) == value


def test_truncate_floor_must_stay_below_the_on_policy_weight():
    """Why transform_truncate_floor < 1: weights of s̄ near 1 (on-policy exactly 1) pass the floor ϵ untouched
    only while ϵ < 1; a floor at or above 1 replaces weights that need no underflow guard (eq. 52). The math and the
    config share the range, so the math refuses such a floor; s⁺ = max(s̄, 1) is what it would compute."""
    import torch

    from dfpo_trl.transforms import truncate_rebalance

    w = torch.tensor([[0.97, 1.0, 1.02, 0.99]], dtype=torch.float64)
    advantages = torch.tensor([[1.0, -1.0, 0.5, -0.5]], dtype=torch.float64)
    unguarded = truncate_rebalance(w, advantages, floor=1e-300)
    assert torch.equal(truncate_rebalance(w, advantages, floor=1e-6), unguarded)
    assert torch.equal(truncate_rebalance(w, advantages, floor=0.5), unguarded)
    assert not torch.equal(truncate_rebalance(w.clamp(min=1.0), advantages, floor=1e-6), unguarded)
    for floor in (0.0, 1.0):
        with pytest.raises(ValueError, match=r"truncate_floor=.* must be in \(0, 1\)"):
            truncate_rebalance(w, advantages, floor=floor)


def test_each_field_has_one_rule_and_its_message_names_the_field_rule_and_fix():
    from dataclasses import fields

    from dfpo_trl.config.checks import FIELD_RULES
    from dfpo_trl.config.fields import dfpo_fields

    names = [rule.field for rule in FIELD_RULES]
    assert len(names) == len(set(names))
    assert set(names) <= {f.name for f in fields(DFPOConfig)}
    unchecked = {f.name for f in dfpo_fields()} - set(names)
    assert unchecked == {"transform_stop_gradient", "symmetric_clip", "log_mechanism_metrics", "delta_random"}
    cfg = config()
    for rule in FIELD_RULES:
        assert rule.problem(cfg) is None, rule.field
        good = getattr(cfg, rule.field)
        setattr(cfg, rule.field, object())  # no rule accepts this
        message = rule.problem(cfg)
        setattr(cfg, rule.field, good)
        assert message.startswith(f"{rule.field}=<object object at ") and message.count("; ") == 1, message
        assert all(len(part) > 10 for part in message.split("; ")), message  # "field=value rule" and the fix


# ------------------------------------------------------------------------------------ one source of docs
def test_each_dfpo_field_is_documented_once_in_its_help_with_a_source():
    import re
    from pathlib import Path

    from dfpo_trl.config.fields import dfpo_fields, split_help

    root = Path(__file__).resolve().parents[2]
    for spec in dfpo_fields():
        meaning, source = split_help(spec)
        assert meaning and source and "Source:" not in meaning, spec.name
        assert not re.search(r"issue\s*#\d", spec.metadata["help"]), spec.name
        for page in re.findall(r"docs/[\w./-]+\.md", spec.metadata["help"]):
            assert (root / page).is_file(), (spec.name, page)


def test_class_docstring_is_generated_from_the_help():
    from trl import TrlParser

    from dfpo_trl.config.fields import dfpo_fields, parameters_section

    TrlParser((DFPOConfig,))  # rewrites each Field.type (int | None becomes int); the docstring must not follow
    assert DFPOConfig.__doc__.endswith(parameters_section())
    flat = " ".join(DFPOConfig.__doc__.split())
    for spec in dfpo_fields():
        assert f"{spec.name} (`" in flat and " ".join(spec.metadata["help"].split()) in flat, spec.name
    assert 'delta_gamma (`str`, *optional*, defaults to `"std"`):' in flat
    assert "group_granular_batches (`bool` or `None`, *optional*, defaults to `None`):" in flat


def test_config_reference_page_is_the_fields_help():
    """docs/source/reference/config.md is what `python -m dfpo_trl.config.docs` writes: one row per DFPO field, its
    help verbatim; after a help changes, this fails until the page is written again."""
    from dfpo_trl.config import docs as config_docs
    from dfpo_trl.config.fields import dfpo_fields, split_help

    page = config_docs.PAGE.read_text(encoding="utf-8")
    assert page == config_docs.config_page()
    table = config_docs.config_table()
    assert table in page and table.count("\n") == 1 + len(dfpo_fields())
    for spec in dfpo_fields():
        assert f"| `{spec.name}` |" in page, spec.name
        assert split_help(spec)[0].split(" (")[0].replace("|", "\\|") in page, spec.name
    assert config_docs.main(["--check"]) == 0


def test_config_reference_check_fails_on_a_stale_page(tmp_path, monkeypatch):
    """--check exits 1 when the page differs from the fields' help, and writing it again makes the check pass."""
    from dfpo_trl.config import docs as config_docs

    stale = tmp_path / "config.md"
    stale.write_text(config_docs.config_page().replace("`group_transform`", "`group_transfrom`"), encoding="utf-8")
    monkeypatch.setattr(config_docs, "PAGE", stale)
    assert config_docs.main(["--check"]) == 1
    assert config_docs.main([]) == 0 and config_docs.main(["--check"]) == 0


def test_a_batch_without_whole_groups_is_refused_in_the_clis_words(monkeypatch, tmp_path):
    """From Python as from the command line: one owner for the rule (TRL's bare "generation_batch_size (5) must be
    divisible by num_generations (4)" named no fix); the CLI heads the same words with where each field was set."""
    from dfpo_trl.cli.args import RecipeError
    from dfpo_trl.cli.precheck import precheck, stored_field_table

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    said = ("a rollout of per_device_train_batch_size 5 x 1 process x gradient_accumulation_steps 1 = 5 completions "
            "does not hold whole groups of num_generations 4 (TRL: generation_batch_size must be divisible by "
            "num_generations); set per_device_train_batch_size to a multiple of 4 (e.g. 4 or 8), or num_generations "
            "to a divisor of 5 (e.g. 5).")
    with pytest.raises(ValueError) as refused:
        config(per_device_train_batch_size=5, num_generations=4)
    assert str(refused.value) == said
    if stored_field_table() is None:  # the check before torch needs the table of these library versions
        return
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("use_cpu: true\nnum_generations: 4\n")
    with pytest.raises(RecipeError) as cli:
        precheck([str(recipe), "--per_device_train_batch_size", "5"])
    assert str(cli.value).endswith(f": {said}")


def test_unset_bf16_is_float32_on_a_machine_without_a_bfloat16_gpu():
    """The README's DFPOConfig(...) (no use_cpu, no bf16) on a CPU: TRL's bf16 default made transformers refuse the
    machine. Unset bf16 is off there; an explicit bf16=True without use_cpu is refused in one line."""
    from transformers.utils import is_torch_bf16_gpu_available

    if is_torch_bf16_gpu_available():
        assert DFPOConfig(output_dir="out").bf16 is True  # TRL's default stands
        return
    assert DFPOConfig(output_dir="out").bf16 is False
    assert DFPOConfig(output_dir="out", use_cpu=True).bf16 is True  # TRL's default, asked for on the CPU
    with pytest.raises(ValueError) as refused:
        DFPOConfig(output_dir="out", bf16=True)
    assert str(refused.value) == (
        "bf16=True needs a GPU with bfloat16 support, and this machine has none; set use_cpu=True to train in "
        "bfloat16 on the CPU, or leave bf16 unset (float32 here, TRL's bfloat16 default on such a GPU)"
    )


def test_unset_pin_memory_follows_the_accelerator_and_a_set_one_stands(monkeypatch):
    """Unset, dataloader_pin_memory is on where torch has an accelerator (transformers' default) and off where it has
    none (torch warned it could not pin); True or False given stand; transformers' use_cpu still turns it off."""
    import torch

    for available in (False, True):
        monkeypatch.setattr(torch.accelerator, "is_available", lambda available=available: available)
        assert DFPOConfig(output_dir="out").dataloader_pin_memory is available
        assert DFPOConfig(output_dir="out", dataloader_pin_memory=True).dataloader_pin_memory is True
        assert DFPOConfig(output_dir="out", dataloader_pin_memory=False).dataloader_pin_memory is False
        assert DFPOConfig(output_dir="out", use_cpu=True).dataloader_pin_memory is False


def test_ddp_timeout_reaches_the_cpu_process_group(monkeypatch):
    """transformers 5.24 hands ddp_timeout to accelerate only off the CPU: a multi-process CPU run's gloo group got
    1800 s whatever ddp_timeout said. Under a CPU launch of several processes DFPOConfig creates the group itself
    with ddp_timeout (checked end to end on two gloo "nodes" in tests/cli/test_killed_rank.py); alone, or off the
    CPU, it leaves the set-up to transformers."""
    import datetime

    import accelerate
    import torch.distributed as dist

    made: list[dict] = []
    cfg = config(ddp_timeout=20)
    monkeypatch.setattr(accelerate, "PartialState", lambda **kwargs: made.append(kwargs))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setenv("WORLD_SIZE", "1")
    cfg._cpu_group_with_ddp_timeout()
    assert made == []
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg._cpu_group_with_ddp_timeout()
    assert made == [dict(cpu=True, backend=cfg.ddp_backend, timeout=datetime.timedelta(seconds=20))]
    cfg.use_cpu = False
    monkeypatch.setenv("ACCELERATE_USE_CPU", "false")
    cfg._cpu_group_with_ddp_timeout()
    assert len(made) == 1
