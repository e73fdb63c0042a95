"""dfpo_bench.trained.cards_8b on the CPU: every row is the recipe plus the flags its header lists, and
they parse; the benchmark adds only what the GPU machine needs; the simulated card hooks the row's process alone."""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dfpo_bench.trained import cards_8b

ROOT = Path(__file__).resolve().parents[2]
HEAD = {"card": "NVIDIA H200", "date": "2026-12-02", "context_gib": 1.0, "machine_flags": ["--max_steps", "2"]}


def header_rows() -> dict[int, list[str]]:
    """card GB -> the flags the recipe's header line gives (tests/cli/test_card_rows.py holds them to dfpo-train)."""
    rows = {}
    for line in cards_8b.RECIPE.read_text().splitlines():
        if line.startswith("#   ") and " GB: " in line and line[4:].split(" GB: ")[0].isdigit():
            card, rest = line[4:].split(" GB: ", 1)
            stated = rest.split("  (")[0].strip()
            rows[int(card)] = [] if stated == "(none)" else shlex.split(stated)
    return rows


def test_the_rows_are_the_recipe_headers_plus_only_what_the_machine_cannot_do_without(
        tmp_path: Path, gpu_recipes_parse_here) -> None:
    from dfpo_trl.cli import parse_recipe
    from dfpo_trl.testing import save_tiny_chat_model

    model = str(save_tiny_chat_model(tmp_path / "model"))
    stated = header_rows()
    assert sorted(stated) == sorted({r["card_gib"] for r in cards_8b.ROWS}) == [24, 32, 40, 48, 80]
    flags = cards_8b.machine_flags("/tmp/m", "/tmp/d")
    added = [f for f in flags if f.startswith("--")]
    assert added == ["--model_name_or_path", "--dataset", "--reward_funcs", "--max_steps"]
    for row in cards_8b.ROWS:
        assert row["flags"] == stated[row["card_gib"]], row["name"]
        parse_recipe([str(cards_8b.RECIPE), *row["flags"], *cards_8b.machine_flags(model, "/tmp/d")])
        assert not set(added) & set(row["flags"])  # a row's own flags never include the machine's
        argv = cards_8b.row_argv(row, "/tmp/m", "/tmp/d")
        assert argv == [sys.executable, "-m", "dfpo_trl", str(cards_8b.RECIPE), *row["flags"], *flags]
        env = cards_8b.row_env(row, tmp_path / "site", tmp_path / "peaks.json", 29500)
        assert env["PYTHONPATH"].split(os.pathsep)[0] == str(tmp_path / "site")  # the card's module first
        assert env["DFPO_BENCH_CARD_GIB"] == str(row["card_gib"])
        assert env.get("PYTORCH_CUDA_ALLOC_CONF") == row["env"].get("PYTORCH_CUDA_ALLOC_CONF")
    assert [r["env"] for r in cards_8b.ROWS if r["env"]] == [{"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}]
    out = subprocess.run([sys.executable, "-m", "dfpo_bench.trained.cards_8b", "--dry-run", "--out", "x"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    for row in cards_8b.ROWS:
        assert f"{row['name']}: {cards_8b.user_command(row)}\n" in out.stdout
        assert f"  runs: {shlex.join(cards_8b.row_argv(row, cards_8b.MODEL_DIR, '/tmp/cards/gsm8k_offline'))}\n" \
            in out.stdout


def test_the_offline_dataset_and_the_coin_reward(tmp_path: Path) -> None:
    from dfpo_trl.cli import get_task

    cards_8b.write_dataset(tmp_path / "gsm8k", train=40, test=16)
    task = get_task("math", dataset=str(tmp_path / "gsm8k"), config="main", problem_column="question",
                    answer_column="answer")
    train, heldout = task.build_dataset("train", None, 0), task.build_dataset("test", 100, 0)
    assert len(train) == 40 and len(heldout) == 16  # eval_size 100 takes the 16 there are
    assert heldout["answer"][0].split("####")[-1].strip().isdigit()
    texts = [f"completion {i}" for i in range(64)]
    rewards = cards_8b.coin_reward(texts)
    assert rewards == cards_8b.coin_reward(texts) and set(rewards) == {0.0, 1.0}  # seeded, with variance
    assert cards_8b.coin_reward([[{"role": "assistant", "content": "completion 3"}]]) == [rewards[3]]


def test_the_card_module_hooks_torch_in_the_rows_process_only(tmp_path: Path) -> None:
    """On the CPU: after ``import torch`` the row's process has the card's ``mem_get_info`` (CUDA's own is never
    called here) and the cap queued for CUDA's start; a process it starts leaves torch alone."""
    site = cards_8b.write_site(tmp_path)
    code = ("import subprocess, sys, torch\n"
            "print('row:', torch.cuda.mem_get_info.__name__)\n"
            "child = 'import torch; print(\"child:\", torch.cuda.mem_get_info.__name__)'\n"
            "print(subprocess.run([sys.executable, '-c', child], capture_output=True, text=True).stdout.strip())\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
               DFPO_BENCH_CARD_GIB="24", DFPO_BENCH_PEAKS=str(tmp_path / "peaks.json"))
    env.pop("DFPO_BENCH_OWNER", None)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "row: card_view" in out.stdout and "child: mem_get_info" in out.stdout
    assert not (tmp_path / "peaks.json").exists()  # CUDA never started: no peaks to write


def test_the_report_reads_the_json_alone() -> None:
    rows = [{"name": "32GB", "card_gib": 32, "user_command": "dfpo-train recipes/qwen3_8b_lora.yaml", "exit": 0,
             "flags": [], "passed": True, "peak_allocated_gib": 23.3, "peak_reserved_gib": 25.4, "overhead_gib": 0.8,
             "needs_gib": 26.2, "wall_s": 120.0, "cap_gib": 31.0},
            {"name": "32GB_default_allocator", "card_gib": 32, "exit": 0, "passed": True, "cap_gib": 31.0, "flags": [],
             "user_command": "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False dfpo-train recipes/qwen3_8b_lora.yaml",
             "peak_allocated_gib": 23.4, "peak_reserved_gib": 31.0, "overhead_gib": 0.8, "needs_gib": 31.8},
            {"name": "40GB", "card_gib": 40, "user_command": "dfpo-train ...", "exit": 1, "passed": False,
             "flags": ["--earlier"], "error": "dfpo-train: error: vLLM did not start: ..."}]
    text = cards_8b.report({**HEAD, "rows": rows})
    assert "| 32 GB | `dfpo-train recipes/qwen3_8b_lora.yaml` | passes | 23.30 | 25.40 | 0.80 | 26.20 | 120 |" in text
    assert ("| 40 GB | `dfpo-train ...` | fails: dfpo-train: error: vLLM did not start: ... (earlier flags: not the "
            "recipe's row now) |") in text
    now = {row["name"]: row for row in cards_8b.ROWS}  # rows with no record, or a record of other flags
    unrun = "; ".join(f"{now[name]['card_gib']} GB (`{' '.join(now[name]['flags'])}`)"
                      for name in ("24GB", "40GB", "48GB", "80GB"))
    assert f"Not run with the recipe's flags of now: {unrun}." in text
    assert "peak reserved 25.40 GiB against 31.00 GiB (cap 31.00); both pass" in text


def test_the_report_says_a_row_without_a_result_is_none() -> None:
    now = {row["name"]: row["flags"] for row in cards_8b.ROWS}
    rows = [{"name": "32GB", "card_gib": 32, "user_command": "dfpo-train a", "exit": None, "passed": False,
             "error": None, "wall_s": 224.0, "flags": now["32GB"]},
            {"name": "80GB", "card_gib": 80, "user_command": "dfpo-train b", "exit": None, "passed": False,
             "flags": now["80GB"], "error": "not run (the deadline passed, or not asked for): run it with --rows"}]
    text = cards_8b.report({**HEAD, "rows": rows})
    assert "| 32 GB | `dfpo-train a` | no record: the run was stopped before it exited (not a result) |" in text
    assert "| 80 GB | `dfpo-train b` | not run (no record:" in text
    assert "fails" not in text


def test_the_driver_records_each_row_and_writes_after_each(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The lanes, records and JSON on the CPU, each row's program replaced by a stand-in that writes the peaks the
    card module would (a 24 GB row that fits, a 32 GB row whose needs exceed its card, a 40 GB row refused), and a
    row left out, marked not run."""
    stub = tmp_path / "stub.py"
    stub.write_text(
        "import json, os, sys\n"
        "card = float(os.environ['DFPO_BENCH_CARD_GIB'])\n"
        "reserved = {24: 20.0, 32: 31.5, 40: 30.0}[int(card)]\n"
        "json.dump({'peak_allocated_gib': reserved - 1, 'peak_reserved_gib': reserved, 'overhead_gib': 0.8,\n"
        "           'cap_gib': card - 1}, open(os.environ['DFPO_BENCH_PEAKS'], 'w'))\n"
        "if card == 40:\n"
        "    print('dfpo-train: error: vLLM did not start: ...'); sys.exit(1)\n")
    monkeypatch.setattr(cards_8b, "row_argv", lambda row, model, data: [sys.executable, str(stub)])
    rows = [r for r in cards_8b.ROWS if r["name"] in ("24GB", "32GB", "40GB")]
    args = argparse.Namespace(work=str(tmp_path / "work"), model_dir="/m", lanes=2, deadline_s=60, budget_s=120,
                              row_timeout_s=60, started=time.time(), commit="c0ffee")
    written: list[int] = []
    records = cards_8b.run_lanes(rows, args, tmp_path, lambda: written.append(1))
    assert sorted(r["name"] for r in records) == ["24GB", "32GB", "40GB"] and len(written) == 3
    table = {r["name"]: r for r in cards_8b.collect(tmp_path / "work")}
    assert table["24GB"]["passed"] and table["24GB"]["needs_gib"] == pytest.approx(20.8)
    assert table["24GB"]["commit"] == "c0ffee"  # the call's commit, named in each row's record
    assert not table["32GB"]["passed"] and table["32GB"]["exit"] == 0  # 31.5 + 0.8 > 32: does not fit the card
    assert not table["40GB"]["passed"] and table["40GB"]["error"] == "dfpo-train: error: vLLM did not start: ..."
    assert table["48GB"]["error"].startswith("not run")
