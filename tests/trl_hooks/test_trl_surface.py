"""TRL 1.16's ``GRPOConfig`` surface under ``DFPOConfig`` (docs/source/reference/trl.md): no DFPO field
shadows one of TRL's, ``use_liger_kernel`` is refused with a DFPO option and left to TRL without one, and our
optional extras carry TRL 1.16's own bounds."""

from __future__ import annotations

import dataclasses
import re
from importlib.metadata import requires
from pathlib import Path
from typing import Any

import pytest
from tiny import base_args
from trl import GRPOConfig

from dfpo_trl import DFPOConfig
from dfpo_trl.config.fields import HAS_ACTIVATION_CHECKPOINTING

ROOT = Path(__file__).resolve().parents[2]
# The inherited fields DFPOConfig redeclares (docs/source/concepts/decisions.md, "TRL features on top"), on every
# transformers. gradient_checkpointing: its help names both spellings; on transformers >= 5.24 its default None means
# "on", TRL's default, without transformers' deprecation warning, and on older releases its default is TRL's True.
# dataloader_pin_memory: None means on where torch has an accelerator (transformers' True) and off where it has none
# (data loading only: tests/test_dropin.py trains the same run as GRPOTrainer).
REDECLARED = {"gradient_checkpointing", "dataloader_pin_memory"}


def _default(spec: dataclasses.Field) -> Any:
    if spec.default is not dataclasses.MISSING:
        return spec.default
    if spec.default_factory is not dataclasses.MISSING:
        return spec.default_factory()
    return dataclasses.MISSING


def test_no_dfpo_field_shadows_a_grpo_config_field() -> None:
    """DFPO's own fields are new names; every inherited field keeps TRL's type, default and help, except the two
    redeclared on purpose, whose resolved values are TRL's where the machine has an accelerator."""
    trl_fields = {spec.name: spec for spec in dataclasses.fields(GRPOConfig)}
    ours = {spec.name: spec for spec in dataclasses.fields(DFPOConfig)}
    assert set(trl_fields) <= set(ours)
    declared_here = {name for name in DFPOConfig.__annotations__ if name in ours}
    new = declared_here - set(trl_fields)
    assert new and all(name not in trl_fields for name in new)
    changed = {
        name for name, spec in trl_fields.items()
        if (ours[name].type, repr(_default(ours[name])), ours[name].metadata.get("help"))
        != (spec.type, repr(_default(spec)), spec.metadata.get("help"))
    }
    assert changed == REDECLARED, changed
    assert declared_here - new == REDECLARED  # nothing else of TRL's is redeclared, even identically
    config = DFPOConfig(**base_args())
    if HAS_ACTIVATION_CHECKPOINTING:
        assert config.activation_checkpointing is True  # on, as GRPOConfig's default True
    else:
        assert config.gradient_checkpointing is True


ACTIVE = [
    pytest.param(dict(importance_sampling_level="sequence", loss_type="grpo", group_transform="min_replace"),
                 "group_transform='min_replace'", id="transform"),
    pytest.param(dict(importance_sampling_level="token", loss_type="dapo", symmetric_clip=True),
                 "symmetric_clip=True", id="grpo_fix"),
    pytest.param(dict(importance_sampling_level="token", loss_type="dapo", token_weighting="delta"),
                 "token_weighting='delta'", id="delta"),
]


@pytest.mark.parametrize(("options", "named"), ACTIVE)
def test_liger_kernel_with_a_dfpo_option_is_refused_naming_both(options: dict[str, Any], named: str) -> None:
    with pytest.raises(ValueError) as error:
        DFPOConfig(**base_args(use_liger_kernel=True, **options))
    message = str(error.value)
    assert "use_liger_kernel=True" in message and named in message
    assert "Set use_liger_kernel=False" in message and "\n" not in message
    DFPOConfig(**base_args(**options))  # the same options without Liger are accepted


def test_liger_kernel_without_a_dfpo_option_is_left_to_trl() -> None:
    """DFPO off: TRL's own loss, so TRL's own handling of the flag (its deprecation warning, its layer kernels)."""
    assert DFPOConfig(**base_args(use_liger_kernel=True)).use_liger_kernel is True


def _extra(requirements: list[str], extra: str) -> dict[str, str]:
    """{package: specifier} of one extra, from ``Requires-Dist`` lines (``name<spec>; extra == "x"``)."""
    out = {}
    for line in requirements:
        spec, _, marker = line.partition(";")
        if re.search(rf"extra\s*==\s*['\"]{extra}['\"]", marker):
            name = re.match(r"[A-Za-z0-9_.-]+", spec.strip()).group(0).lower()
            out[name] = ",".join(sorted(spec.strip()[len(name):].replace(" ", "").split(","))).strip(",")
    return out


def _our_extras() -> dict[str, list[str]]:
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]


@pytest.mark.parametrize("extra", ["vllm", "deepspeed"])
def test_extras_carry_trls_own_bounds(extra: str) -> None:
    """Our ``vllm`` and ``deepspeed`` extras ask for what TRL 1.16's extras of those names ask for (TRL's vLLM range
    is the one ``trl.import_utils.is_vllm_available`` accepts without a warning)."""
    ours = _extra([f"{line}; extra == '{extra}'" for line in _our_extras()[extra]], extra)
    theirs = _extra(requires("trl") or [], extra)
    assert theirs and ours == {name: spec for name, spec in theirs.items() if name != "transformers"}, (ours, theirs)


def test_peft_extra_starts_at_or_above_trls() -> None:
    """PEFT: ours may start higher than TRL's extra (0.17 does not import under transformers 5), never lower."""
    from packaging.version import Version

    def lowest(spec: str) -> Version:
        return Version(re.search(r">=([0-9.]+)", spec).group(1))

    ours = _extra([f"{line}; extra == 'peft'" for line in _our_extras()["peft"]], "peft")["peft"]
    assert lowest(ours) >= lowest(_extra(requires("trl") or [], "peft")["peft"])


@pytest.mark.parametrize("loss_type", ["cispo", "sapo", "vespo"])
def test_loss_types_without_the_clipped_surrogate_are_refused_with_a_transform(loss_type: str) -> None:
    from dfpo_trl.config.options import CLIPPED_LOSS_TYPES

    assert loss_type not in CLIPPED_LOSS_TYPES
    with pytest.raises(ValueError, match=rf"loss_type='{loss_type}' does not use.*Set loss_type to one of"):
        DFPOConfig(**base_args(importance_sampling_level="sequence", loss_type=loss_type,
                               group_transform="min_replace"))


def test_every_test_the_feature_table_names_exists() -> None:
    """The reference page "TRL features and versions" names its tests as `file.py::test_name` under tests/: each file
    exists and defines that test, so the table cannot point at a test that was renamed or removed."""
    page = (ROOT / "docs" / "source" / "reference" / "trl.md").read_text()
    start = page.index("## Features")
    section = page[start:page.index("\n## ", start + 1)]
    named = re.findall(r"`([\w/]+\.py)::(\w+)`", section)
    assert len(named) >= 20, named
    missing = [f"{path}::{name}" for path, name in named
               if not (ROOT / "tests" / path).is_file()
               or not re.search(rf"^def {name}\(", (ROOT / "tests" / path).read_text(), flags=re.MULTILINE)]
    assert not missing, missing
