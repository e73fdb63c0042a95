"""The README's first screen (the top until "## Use") says what a newcomer needs once and truly: the main job's
time and where it writes, the suite's size and time, the extras the paper recipes need."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

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



DOCS = sorted((ROOT / "docs").glob("*.md"))


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
