"""The colocated vLLM engine as ``dfpo-train`` starts it (dfpo_trl/cli/engine.py), on the CPU through the stand-in
engine of ``tests/trl_hooks/test_vllm_colocate.py``: the context it is given when ``vllm_max_model_length`` is
unset, its usage statistics off, and vLLM's start-up refusals, raised by the stand-in in vLLM's own words, as one
line naming the fields and the values that fix them, exit code 1 and the output directory as it was."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from tiny import save_tiny_chat_model, write_tiny_recipe
from transformers import AutoModelForCausalLM, AutoTokenizer

from dfpo_trl.cli.data import prompt_tokens
from dfpo_trl.cli.engine import engine_length, engine_start_message, quiet_vllm_environment
from dfpo_trl.cli.main import main

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "trl_hooks"))
import test_vllm_colocate  # noqa: E402
from test_vllm_colocate import StandInEngine  # noqa: E402

stand_in_vllm = test_vllm_colocate.stand_in_vllm  # the fixture, shared

pytestmark = pytest.mark.usefixtures("one_thread")

# vLLM's refusals as its releases word them (vllm/v1/core/kv_cache_utils.py, vllm/v1/worker, vllm/config/model.py)
KV_TEXT = (
    "To serve at least one request with the model's max seq len (40960), 5.62 GiB KV cache is needed, which is "
    "larger than the available KV cache memory (3.37 GiB). Based on the available memory, the estimated maximum "
    "model length is 24528. Try increasing `gpu_memory_utilization` or decreasing `max_model_len` when initializing "
    "the engine. See https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more details."
)
KV_TEXT_OLDER = (
    "To serve at least one request with the models's max seq len (40960), (5.62 GiB KV cache is needed, which is "
    "larger than the available KV cache memory (3.37 GiB). Based on the available memory, the estimated maximum "
    "model length is 24528. Try increasing `gpu_memory_utilization` or decreasing `max_model_len` when initializing "
    "the engine."
)
NO_CACHE_TEXT = (
    "No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when initializing the engine."
    " See https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more details."
)
FREE_TEXT = (
    "Free memory on device cuda:0 (12.18/23.56 GiB) on startup is less than desired GPU memory utilization (0.92, "
    "21.67 GiB). Decrease GPU memory utilization or reduce GPU memory used by other processes."
)
LENGTH_TEXT = (
    "User-specified max_model_len (65536) is greater than the derived max_model_len (max_position_embeddings=40960.0 "
    "or model_max_length=None in model's config.json). To allow overriding this maximum, set the env var "
    "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1. VLLM_ALLOW_LONG_MAX_MODEL_LEN must be used with extreme caution."
)
ARGS = SimpleNamespace(
    use_vllm=True,
    vllm_mode="colocate",
    vllm_gpu_memory_utilization=0.5,
    max_completion_length=768,
    output_dir="outputs/run",
    per_device_train_batch_size=8,
    steps_per_generation=8,
)


def pydantic_refusal(text: str) -> Exception:
    """The error vLLM's pydantic ``ModelConfig`` raises for ``text``: a ``ValidationError`` (a ValueError)."""
    import pydantic

    class ModelConfig(pydantic.BaseModel):
        max_model_len: int

        @pydantic.field_validator("max_model_len")
        @classmethod
        def check(cls, value: int) -> int:
            raise ValueError(text)

    try:
        ModelConfig(max_model_len=65536)
    except pydantic.ValidationError as exc:
        return exc
    raise AssertionError("the validator did not refuse")


@pytest.mark.parametrize("text", [KV_TEXT, KV_TEXT_OLDER], ids=["newer", "older"])
def test_kv_cache_too_small_names_the_length_the_cache_holds_and_the_share_that_fits(text: str) -> None:
    line = engine_start_message(text, ARGS, "model", total_gib=40.0)
    assert line.startswith("vLLM did not start: one request of the model's whole context, 40960 tokens")
    assert "needs 5.62 GiB of KV cache, and the engine has 3.37 GiB left" in line
    assert "vllm_gpu_memory_utilization 0.5 of the GPU's 40.0 GiB = 20.0 GiB" in line
    assert "--max_prompt_length P (the engine then holds P + max_completion_length 768, at most 24528 in all)" in line
    assert "--vllm_max_model_length 24528" in line
    # 0.5 + (5.62 - 3.37) / 40 = 0.55625, rounded up
    assert "--vllm_gpu_memory_utilization 0.56 or more (now 0.5)" in line
    assert line.endswith("Nothing in outputs/run was written or removed")
    set_line = engine_start_message(text, ARGS, "set", total_gib=None)
    assert "one request of vllm_max_model_length 40960 needs" in set_line
    assert "--vllm_max_model_length 24528 or less (with --max_completion_length, now 768, below it)" in set_line
    assert "a larger --vllm_gpu_memory_utilization (now 0.5)" in set_line


def test_no_memory_free_memory_and_length_refusals() -> None:
    line = engine_start_message(NO_CACHE_TEXT, ARGS, "run", total_gib=40.0)
    assert "leave none for its KV cache; set a larger --vllm_gpu_memory_utilization (now 0.5)" in line
    assert "8 x 8 = 64 sequences at once" in line
    line = engine_start_message(FREE_TEXT, ARGS, "run", total_gib=23.56)
    assert "the GPU has 12.18 GiB free of 23.56 GiB" in line and "asks for (21.67 GiB)" in line
    assert "--vllm_gpu_memory_utilization 0.51 or less" in line  # floor(12.18 / 23.56, 2)
    refusal = pydantic_refusal(LENGTH_TEXT)
    assert isinstance(refusal, ValueError)
    line = engine_start_message(str(refusal), ARGS, "run", total_gib=None)
    assert (
        "vllm_max_model_length 65536 (unset: max_prompt_length + max_completion_length) is longer than the "
        "model's context of 40960 tokens" in line
    )
    assert "--vllm_max_model_length 40960 or less" in line
    assert engine_start_message("CUDA error: an illegal memory access", ARGS, "run", None) is None
    older = FREE_TEXT.replace("device cuda:0 (", "device (")
    assert "12.18 GiB free" in engine_start_message(older, ARGS, "run", 23.56)


def test_engine_length_is_the_longest_prompt_sent_plus_the_completion() -> None:
    assert engine_length(512, 768) == 1280
    assert engine_length(512, 768, longest_heldout_prompt=600) == 1368  # held-out prompts are not filtered
    assert engine_length(512, 768, longest_heldout_prompt=100) == 1280
    assert engine_length(None, 768, longest_heldout_prompt=100) is None  # no bound: vLLM's default (the model's)


def test_usage_statistics_are_off_unless_the_user_set_either_variable() -> None:
    environ: dict[str, str] = {}
    assert quiet_vllm_environment(environ) and environ == {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    environ = {"VLLM_NO_USAGE_STATS": "0"}  # the user asks for the statistics: nothing is changed
    assert not quiet_vllm_environment(environ) and environ == {"VLLM_NO_USAGE_STATS": "0"}
    environ = {"DO_NOT_TRACK": "0"}
    assert not quiet_vllm_environment(environ) and environ == {"DO_NOT_TRACK": "0"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_chat_model(tmp_path_factory.mktemp("tiny_engine"))


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


COLOCATED = dict(use_vllm=True, vllm_mode="colocate", skip_eval=True, plot=False)


def test_unset_length_gives_the_engine_the_prompt_bound_plus_the_completion_and_a_set_one_wins(
    tmp_path: Path, model_dir: Path, stand_in_vllm: Any, monkeypatch: pytest.MonkeyPatch
) -> None:  # noqa: F811
    for name in ("VLLM_NO_USAGE_STATS", "DO_NOT_TRACK"):
        monkeypatch.delenv(name, raising=False)
    seen: list[dict[str, str | None]] = []
    start = StandInEngine.__init__

    def recording(self: Any, *args: Any, **kwargs: Any) -> None:
        seen.append({name: os.environ.get(name) for name in ("VLLM_NO_USAGE_STATS", "DO_NOT_TRACK")})
        start(self, *args, **kwargs)

    monkeypatch.setattr(StandInEngine, "__init__", recording)
    stand_in_vllm(AutoModelForCausalLM.from_pretrained(model_dir))
    runs = {
        "bound": dict(max_prompt_length=40),
        "set": dict(max_prompt_length=40, vllm_max_model_length=96),
        "unbounded": {},
    }
    for name, changes in runs.items():
        (tmp_path / name).mkdir()
        argv = write_tiny_recipe(tmp_path / name, model_dir, tmp_path / name / "out", **COLOCATED, **changes)
        assert main(argv) == 0
    lengths = [made.settings["max_model_len"] for made in StandInEngine.built]
    assert lengths == [40 + 4, 96, None]  # max_prompt_length + max_completion_length 4; the user's; vLLM's default
    assert seen == [{"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}] * 3  # usage statistics off in every run


def test_a_held_out_prompt_longer_than_the_bound_widens_the_engine(model_dir: Path) -> None:
    from datasets import Dataset

    from dfpo_trl import DFPOConfig
    from dfpo_trl.cli.args import DFPOScriptArguments
    from dfpo_trl.cli.train import size_engine
    from dfpo_trl.testing import tiny_config_kwargs

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    heldout = Dataset.from_dict(
        {
            "prompt": [
                [{"role": "user", "content": "Compute 3 + 4 and 5 + 6 and 7 + 8"}],
                [{"role": "user", "content": "Compute 1 + 2"}],
            ]
        }
    )
    longest = max(prompt_tokens(p, tokenizer, None) for p in heldout["prompt"])
    args = DFPOConfig(**tiny_config_kwargs(use_vllm=True, vllm_mode="colocate"))
    assert size_engine(args, DFPOScriptArguments(max_prompt_length=longest - 5), heldout, tokenizer) == "run"
    assert args.vllm_max_model_length == longest + args.max_completion_length  # the held-out prompt, not the bound
    args = DFPOConfig(**tiny_config_kwargs(use_vllm=True, vllm_mode="colocate"))
    assert size_engine(args, DFPOScriptArguments(max_prompt_length=longest + 5), heldout, tokenizer) == "run"
    assert args.vllm_max_model_length == longest + 5 + args.max_completion_length
    server = DFPOConfig(**tiny_config_kwargs(use_vllm=True, vllm_mode="server"))
    assert size_engine(server, DFPOScriptArguments(max_prompt_length=10), None, None) == "model"
    assert server.vllm_max_model_length is None  # the server sizes its own engine


@pytest.mark.parametrize(
    "text, expected",
    [
        (
            KV_TEXT,
            "one request of vllm_max_model_length 40960 (unset: max_prompt_length + max_completion_length) needs "
            "5.62 GiB of KV cache",
        ),
        (NO_CACHE_TEXT, "leave none for its KV cache"),
        (FREE_TEXT, "the GPU has 12.18 GiB free of 23.56 GiB"),
        (LENGTH_TEXT, "is longer than the model's context of 40960 tokens"),
    ],
    ids=["kv_cache", "no_cache", "free_memory", "length"],
)
def test_a_refusal_to_start_ends_the_run_in_one_line_and_leaves_output_dir_as_it_was(
    tmp_path: Path,
    model_dir: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    stand_in_vllm: Any,
    text: str,
    expected: str,
) -> None:  # noqa: F811
    stand_in_vllm(AutoModelForCausalLM.from_pretrained(model_dir))

    def refuse(self: Any, *args: Any, **kwargs: Any) -> None:
        raise pydantic_refusal(text) if text is LENGTH_TEXT else ValueError(text)

    monkeypatch.setattr(StandInEngine, "__init__", refuse)
    out = tmp_path / "out"
    (out / "checkpoint-1").mkdir(parents=True)
    (out / "checkpoint-1" / "model.safetensors").write_bytes(b"\x00weights\xff")
    (out / "notes.txt").write_text("mine\n")
    before = snapshot(out)
    argv = write_tiny_recipe(tmp_path, model_dir, out, **COLOCATED, max_prompt_length=40)
    capsys.readouterr()
    assert main(argv) == 1
    assert snapshot(out) == before
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("dfpo-train:")]
    assert len(lines) == 1 and lines[0] == err.strip().splitlines()[-1]
    assert lines[0].startswith("dfpo-train: error: vLLM did not start: ") and expected in lines[0]
    assert lines[0].endswith(f"Nothing in {out} was written or removed")


def test_another_error_building_the_engine_is_not_rewritten(
    tmp_path: Path, model_dir: Path, monkeypatch: pytest.MonkeyPatch, stand_in_vllm: Any
) -> None:  # noqa: F811
    stand_in_vllm(AutoModelForCausalLM.from_pretrained(model_dir))

    def fail(self: Any, *args: Any, **kwargs: Any) -> None:
        raise ValueError("some other engine problem")

    monkeypatch.setattr(StandInEngine, "__init__", fail)
    argv = write_tiny_recipe(tmp_path, model_dir, tmp_path / "out", **COLOCATED)
    with pytest.raises(ValueError, match="some other engine problem"):
        main(argv)
