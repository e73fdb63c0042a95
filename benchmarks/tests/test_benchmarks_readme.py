"""benchmarks/README.md is the package's map: its table names every module of dfpo_bench, every job it names has a
command, and its links and the library paths it names exist (the library's own tests check README.md and docs/)."""

from __future__ import annotations

import re
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1]
ROOT = BENCH.parent
README = (BENCH / "README.md").read_text()


def test_every_module_is_on_the_map_and_every_job_has_a_command() -> None:
    package = BENCH / "dfpo_bench"
    modules = {str(p.relative_to(package)) for p in package.rglob("*.py") if p.name != "__init__.py"}
    table = set(re.findall(r"^\| `([\w/]+\.py)` \|", README, flags=re.MULTILINE))
    helpers = set(re.findall(r"`((?:lib|launch|cost|reports)/\w+\.py)`", README.split("Helpers (imported", 1)[1]))
    helpers |= {f"lib/{name}" for name in re.findall(r"`(\w+\.py)`", README.split("Helpers (imported", 1)[1])}
    assert modules <= table | helpers, f"add to benchmarks/README.md: {sorted(modules - table - helpers)}"
    run = {m.replace(".", "/") + ".py" for m in re.findall(r"python -m dfpo_bench\.([\w.]+)", README)}
    run |= set(re.findall(r"benchmarks/dfpo_bench/([\w/]+\.(?:py|sh))", README))
    assert table <= run | {"trained/is_ratio.py"} and "trained/gpu_job.sh" in run, sorted(table - run)
    assert {p for p in table if not (package / p).exists()} == set()


def test_links_and_library_paths_resolve() -> None:
    broken = [t for t in re.findall(r"\]\(([^)\s#]+)", README) if not re.match(r"[a-z]+:", t)
              and not (BENCH / t).resolve().exists()]
    broken += [p for p in re.findall(r"\b(?:dfpo_trl|recipes|benchmarks)/[\w/.-]*\w(?![\w*])", README)
               if not (ROOT / p).exists() and not (BENCH / p).exists()]
    broken += [p for p in re.findall(r"`((?:results|figures)/[\w/.@-]*\w)/?`", README) if not (BENCH / p).exists()]
    assert broken == []
