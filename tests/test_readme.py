"""The README's first screen (the top until "## Use") says what a newcomer needs once and truly: the main job's
time and where it writes, the suite's size and time, the extras the paper recipes need. And the documents stay a map
of the code: every module on docs/source/concepts/architecture.md's map, no module path or link that leads nowhere,
every equation label the code cites defined in docs/."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
FIRST_SCREEN = README[: README.index("\n## Use")]


def test_suite_size_and_time_are_stated_once() -> None:
    """One number for the suite: it was stated three ways (7.4 min, 561 tests in 7 min 22 s, 570 in 6 min 31 s)."""
    statements = re.findall(r"\d+ tests in \d+ min \d+ s", README)
    assert len(statements) == 1 and statements[0] in FIRST_SCREEN, statements
    assert not re.search(r"suite's [\d.]+\s*min", README)


def test_main_job_time_and_output_are_on_the_first_screen_once() -> None:
    recipe = yaml.safe_load((ROOT / "recipes" / "smollm2_cpu.yaml").read_text())
    assert f"`{recipe['output_dir']}/`" in FIRST_SCREEN
    times = re.findall(r"\*\*The main job\*\* takes \*\*(\d+ min \d+ s)\*\* on a quiet .*? and \*\*(\d+ min \d+ s)\*\*",
                       FIRST_SCREEN, flags=re.DOTALL)  # fmt: skip
    assert len(times) == 1
    for value in times[0]:
        assert README.count(value) == 1, value  # the Main job section gives the split, not the total again
    assert "PyPI" in FIRST_SCREEN  # "no network" is about the run, not the installs


def test_extras_named_for_the_paper_recipes_exist() -> None:
    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    named = {e.strip() for group in re.findall(r'-e\s+"\.\[([\w,]+)\]"', FIRST_SCREEN) for e in group.split(",")}
    assert {"deepspeed", "vllm", "peft"} <= named <= extras


# ---------------------------------------------------------------------------------------- the documentation's map

DOCS = sorted((ROOT / "docs" / "source").rglob("*.md"))
MAPS = [ROOT / "README.md", *DOCS, ROOT / "benchmarks" / "README.md"]  # the hand-written documents


def _package_modules() -> list[str]:
    """Every module of the package, as a path from the repository root, except ``__init__`` and private ones."""
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "dfpo_trl").rglob("*.py")
                  if not p.name.startswith("_"))  # fmt: skip


def test_every_module_is_on_the_docs_map() -> None:
    """The architecture page names every module with its job and its document: a new module goes on the map."""
    docs_map = (ROOT / "docs" / "source" / "concepts" / "architecture.md").read_text()
    missing = [m for m in _package_modules() if f"`{m}`" not in docs_map]
    assert not missing, f"add a line to docs/source/concepts/architecture.md's module table for: {missing}"


def _defines(module: Path, name: str) -> bool:
    source = module.read_text()
    pattern = rf"^(?:def|class) {name}\b|^{name}\s*[:=]|^\s+{name},?$|^\s*from [\w.]+ import [^\n]*\b{name}\b"
    return re.search(pattern, source, flags=re.MULTILINE) is not None


def _dotted_name_exists(dotted: str) -> bool:
    """``dfpo_trl.a.b.name``: packages and modules down the path, then a name the last module defines or imports."""
    path, *parts = dotted.split(".")
    here = ROOT / path
    for i, part in enumerate(parts):
        if (here / part).is_dir():
            here = here / part
        elif (here / f"{part}.py").is_file():
            here = here / f"{part}.py"
            rest = parts[i + 1:]
            return not rest or _defines(here, rest[0])
        else:
            return here.is_dir() and _defines(here / "__init__.py", part)
    return True


def test_module_paths_named_in_the_docs_exist() -> None:
    """Every ``dfpo_trl/...`` path and ``dfpo_trl....`` name in README.md, docs/ and benchmarks/README.md exists, so
    a restructuring cannot leave the documents naming modules that are gone."""
    stale = []
    for doc in MAPS:
        text = doc.read_text()
        for path in re.findall(r"dfpo_trl/[\w/.]*", text):
            if not (ROOT / path.rstrip(".")).exists():
                stale.append(f"{doc.relative_to(ROOT)}: {path}")
        for dotted in re.findall(r"\bdfpo_trl(?:\.\w+)+", text):
            if not _dotted_name_exists(dotted):
                stale.append(f"{doc.relative_to(ROOT)}: {dotted}")
    assert not stale, stale


def _anchors(doc: Path) -> set[str]:
    """GitHub's anchors of a Markdown file's headings (outside code blocks)."""
    anchors, fenced = set(), False
    for line in doc.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"#{1,6} (.+)", line)):
            anchors.add(re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-"))
    return anchors


def test_links_between_the_documents_resolve() -> None:
    """Every relative link of README.md, docs/ and benchmarks/README.md reaches a file, and its #anchor a heading."""
    broken = []
    for doc in MAPS:
        for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            file = (doc.parent / path).resolve() if path else doc
            if not file.exists() or (anchor and file.suffix == ".md" and anchor not in _anchors(file)):
                broken.append(f"{doc.relative_to(ROOT)}: {target}")
    assert not broken, broken


# Labels of equations the code cites that are not the DFPO paper's numbers: eq. C4, eq. C4–C7, eq. DelTA-alpha.
EQ_LABEL = re.compile(r"\beqs?\. ([A-Za-z][\w-]*\w)(?:–([A-Za-z]+\d+))?")


def _labels(text: str) -> set[str]:
    labels = set()
    for first, last in EQ_LABEL.findall(text):
        a, b = re.fullmatch(r"([A-Za-z]+)(\d+)", first), re.fullmatch(r"([A-Za-z]+)(\d+)", last or "")
        if a and b and a.group(1) == b.group(1):
            labels.update(f"{a.group(1)}{n}" for n in range(int(a.group(2)), int(b.group(2)) + 1))
        else:
            labels.add(first)
    return labels


def test_every_equation_label_the_code_cites_is_defined_in_the_docs() -> None:
    """A non-numeric label (eq. C8, eq. DelTA-alpha) is defined in docs/ by its tag, ``(C8)``, at the end of the formula
    or heading that defines it; numeric ones (eq. 47) are the DFPO paper's."""
    sources = [*sorted((ROOT / "dfpo_trl").rglob("*.py")), ROOT / "README.md", *DOCS]
    used = {label: src for src in sources for label in _labels(src.read_text())}
    docs_text = "\n".join(doc.read_text() for doc in DOCS)
    undefined = {label: str(src.relative_to(ROOT)) for label, src in used.items() if f"({label})" not in docs_text}
    assert used and not undefined, f"labels cited but defined in no docs/ page (as '(label)'): {undefined}"


# "issue #10", "issue-5", "(#12)": numbers of a tracker a reader of the repository cannot see. Upstream references
# that say whose tracker they are (pytorch/pytorch#56297) are fine.
TRACKER_REFERENCE = re.compile(r"\bissues? ?#\d+|\bissues?[- ]\d+\b|(?<![\w/&])#(?![0-9a-fA-F]{6}\b)\d+\b", re.I)


def test_no_tracker_issue_numbers() -> None:
    """Code, docstrings, docs, recipes and benchmark texts say what a study is, never which issue asked for it."""
    texts = [ROOT / "README.md", *DOCS, *(ROOT / "benchmarks").rglob("*.py"), *(ROOT / "benchmarks").glob("*.md"),
             *(ROOT / "benchmarks" / "results").rglob("*.md"), *(ROOT / "dfpo_trl").rglob("*.py"),
             *(ROOT / "recipes").rglob("*.yaml"), *(ROOT / "tests").glob("*.py"), *(ROOT / "examples").glob("*.py")]
    found = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}" for path in texts
             for n, line in enumerate(path.read_text().splitlines(), 1)
             if path != Path(__file__).resolve() and TRACKER_REFERENCE.search(line)]
    assert not found, found


def test_every_benchmark_script_is_in_the_benchmarks_readme() -> None:
    """benchmarks/README.md's table names every module of the dfpo_bench package (what it measures, the machine, the
    results; paths relative to benchmarks/dfpo_bench/), and says how to run each one."""
    readme = (ROOT / "benchmarks" / "README.md").read_text()
    table = {m.group(1) for m in re.finditer(r"^\| `([\w/]+\.py)` \|", readme, flags=re.MULTILINE)}
    package = ROOT / "benchmarks" / "dfpo_bench"
    scripts = {str(p.relative_to(package)) for p in package.rglob("*.py") if p.name != "__init__.py"}
    assert scripts <= table, f"add to benchmarks/README.md's table: {sorted(scripts - table)}"
    # imported, not run: the table says "a helper" or "nothing" (a section that report.py writes)
    helpers = {m.group(1) for m in re.finditer(r"^\| `([\w/]+\.py)` \| (?:a helper|nothing):", readme,
                                                 flags=re.MULTILINE)}
    assert {"lib/common.py", "reports/report_long_run.py", "reports/report_launch_shape.py"} <= helpers
    launched = set(re.findall(r"(?:python|\.yaml|accelerate launch|torchrun) benchmarks/dfpo_bench/([\w/]+\.py)\b",
                              readme))
    launched |= {m.replace(".", "/") + ".py" for m in re.findall(r"python -m dfpo_bench\.([\w.]+)", readme)}
    assert not scripts - helpers - launched, f"no command in benchmarks/README.md for {scripts - helpers - launched}"


def test_ci_tests_the_lower_bounds_pyproject_declares() -> None:
    """.ci/run's second venv pins .ci/lower-bounds.txt: each pin is the lower bound pyproject.toml declares for that
    library (a bound raised in one place only would again declare versions no test ran), and .ci/run uses it."""
    from packaging.requirements import Requirement
    from packaging.version import Version

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = [Requirement(r) for r in project["dependencies"]]
    declared += [Requirement(r) for extra in project["optional-dependencies"].values() for r in extra]
    pins = [line.split("#")[0].strip() for line in (ROOT / ".ci" / "lower-bounds.txt").read_text().splitlines()]
    pins = [Requirement(p) for p in pins if p]
    assert {p.name for p in pins} == {"transformers", "accelerate", "datasets", "peft"}
    for pin in pins:
        (exact,) = pin.specifier
        lows = {Version(s.version) for r in declared if r.name == pin.name for s in r.specifier if s.operator == ">="}
        assert lows == {Version(exact.version)}, (pin.name, lows, exact.version)
    assert "-c .ci/lower-bounds.txt" in (ROOT / ".ci" / "run").read_text()


# Retired scripts (benchmarks/README.md says at which commit each was last): named as history, e.g. a commit's files;
# and bit_identity.py's place before the benchmarks became a package, which a "before" checkout still runs.
RETIRED = {"benchmarks/study_v2.py", "benchmarks/study_v2.sh", "benchmarks/bit_identity.py"}


def test_benchmark_scripts_named_anywhere_exist() -> None:
    """Every ``benchmarks/<path>.py`` or ``.sh`` named in the documents, recipes, tests and the benchmark scripts
    exists, so moving a script cannot leave a command that leads nowhere (``REV:benchmarks/x.py``, a retired
    script's path in ``git show``, excepted)."""
    texts = [*MAPS, *(ROOT / "recipes").rglob("*.yaml"), *(ROOT / "tests").rglob("*.py"),
             *(ROOT / "benchmarks").rglob("*.py"), *(ROOT / "benchmarks").rglob("*.sh"),
             *(ROOT / "benchmarks" / "results").rglob("*.md")]
    stale = [f"{path.relative_to(ROOT)}: {m.group(0)}" for path in texts
             for m in re.finditer(r"(?<![:\w/])benchmarks/[\w/]+\.(?:py|sh)\b", path.read_text())
             if not (ROOT / m.group(0)).exists() and m.group(0) not in RETIRED]
    assert not stale, stale


# ---------------------------------------------------------------------------------------- the README's Python code

PYTHON_BLOCKS = re.findall(r"^```python\n(.*?)^```$", README, flags=re.MULTILINE | re.DOTALL)


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(PYTHON_BLOCKS)))
def test_readme_python_runs_as_written(index: int, tmp_path: Path) -> None:
    """Each Python block of the README runs as written, in a fresh interpreter, on this machine (a CPU one here:
    `DFPOConfig(...)` raised transformers' "Your setup doesn't support bf16/gpu" there). About 55 s on a quiet
    2-core machine (the embedded model, 2 optimizer steps)."""
    script = tmp_path / "readme_block.py"
    script.write_text(PYTHON_BLOCKS[index])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=1500,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_the_readme_has_python_to_run() -> None:
    assert PYTHON_BLOCKS and "DFPOConfig(" in PYTHON_BLOCKS[0] and "trainer.train()" in PYTHON_BLOCKS[0]
