"""``dfpo-train`` sets PyTorch's expandable segments when the user chose no allocator setting
(dfpo_trl/cli/allocator.py): not over the user's variable (shell or recipe ``env:``), not with vLLM's sleep mode,
and before torch starts CUDA."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dfpo_trl.cli.allocator import EXPANDABLE_SEGMENTS, default_allocator


def recipe(tmp_path: Path, **fields: object) -> str:
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({"max_steps": 1, **fields}))
    return str(path)


def test_set_when_the_user_chose_nothing(tmp_path: Path) -> None:
    environ: dict[str, str] = {}
    assert default_allocator([recipe(tmp_path)], environ)
    assert environ == {"PYTORCH_CUDA_ALLOC_CONF": EXPANDABLE_SEGMENTS}


@pytest.mark.parametrize("name", ["PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"])
def test_the_users_variable_wins(tmp_path: Path, name: str) -> None:
    environ = {name: "expandable_segments:False"}
    assert not default_allocator([recipe(tmp_path)], environ)
    assert environ == {name: "expandable_segments:False"}
    environ = {}
    assert not default_allocator([recipe(tmp_path, env={name: "backend:cudaMallocAsync"})], environ)
    assert environ == {}  # the recipe's env: sets it (TRL's parser), not this


def test_not_with_vllms_sleep_mode(tmp_path: Path) -> None:
    environ: dict[str, str] = {}
    assert not default_allocator([recipe(tmp_path, vllm_enable_sleep_mode=True)], environ)
    assert not default_allocator([recipe(tmp_path), "--vllm_enable_sleep_mode", "true"], environ)
    assert not default_allocator([recipe(tmp_path), "--vllm-enable-sleep-mode=True"], environ)
    assert environ == {}
    assert default_allocator([recipe(tmp_path, vllm_enable_sleep_mode=True), "--vllm_enable_sleep_mode", "false"],
                             environ)  # the flag beats the recipe


def test_dfpo_train_sets_it_before_torch_is_imported(tmp_path: Path) -> None:
    """The variable is in the environment when the program first imports torch (torch reads it when CUDA starts,
    which the recipe's parse already does through the bf16 check): a run that stops after the parse, on a hub model
    that cannot be reached offline (a local path that is not there is refused before torch), shows what the
    environment held at that import."""
    code = (
        "import os, sys\n"
        "seen = {}\n"
        "class Watch:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'torch' and 'at_torch' not in seen:\n"
        "            seen['at_torch'] = os.environ.get('PYTORCH_CUDA_ALLOC_CONF')\n"
        "        return None\n"
        "sys.meta_path.insert(0, Watch())\n"
        "from dfpo_trl.cli.main import main\n"
        "assert 'torch' not in sys.modules\n"
        f"code = main([{recipe(tmp_path, model_name_or_path='no-such-org/no-such-model-dfpo')!r}])\n"
        "print('exit', code, 'at torch import:', seen.get('at_torch'))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HOME=str(tmp_path / "hf"))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"at torch import: {EXPANDABLE_SEGMENTS}" in out.stdout, out.stdout + out.stderr[-2000:]
