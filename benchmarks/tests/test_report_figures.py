"""``dfpo_bench.reports.report`` regenerates RESULTS.md and every figure it shows from the committed results, into a
temporary folder. Byte identity of the figures holds for one matplotlib version (a PNG records it in its ``Software``
text chunk): under another version that comparison is skipped, saying so."""

from __future__ import annotations

import pathlib
import re
import struct

import pytest

from dfpo_bench.reports import report

ROOT = pathlib.Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
FIGURE = re.compile(r"figures/([\w.-]+\.png)")

pytestmark = pytest.mark.slow


def png_software(path: pathlib.Path) -> str | None:
    """The ``Software`` text chunk of a PNG (matplotlib writes its version there), None if it has none."""
    data, i = path.read_bytes(), 8
    while i < len(data):
        length, kind = struct.unpack(">I4s", data[i:i + 8])
        if kind == b"tEXt":
            key, _, value = data[i + 8:i + 8 + length].partition(b"\0")
            if key == b"Software":
                return value.decode("latin-1")
        i += 12 + length
    return None


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    out = tmp_path_factory.mktemp("report") / "RESULTS.md"
    report.main(["--results-dir", str(BENCH / "results"), "--out", str(out)])
    return out


def test_results_md_regenerates_identically(written: pathlib.Path) -> None:
    assert written.read_text() == (BENCH / "RESULTS.md").read_text()


def test_every_figure_named_is_written_and_every_committed_one_named(written: pathlib.Path) -> None:
    named = set(FIGURE.findall(written.read_text()))
    made = {p.name for p in (written.parent / "figures").glob("*.png")}
    assert named - made == set(), "named by RESULTS.md, not written by the report"
    readmes = "".join(p.read_text() for p in (BENCH / "README.md", ROOT / "README.md") if p.exists())
    committed = {p.name for p in (BENCH / "figures").glob("*.png")}
    assert committed - named - set(FIGURE.findall(readmes)) == set(), "committed, named by no RESULTS.md or README"
    assert made - committed == set(), "written by the report, not committed"


def test_written_figures_are_byte_identical(written: pathlib.Path) -> None:
    import matplotlib

    made = sorted((written.parent / "figures").glob("*.png"))
    assert made
    drawn_by = {png_software(BENCH / "figures" / p.name) for p in made if (BENCH / "figures" / p.name).exists()}
    here = png_software(made[0])
    if drawn_by != {here}:
        pytest.skip(f"matplotlib {matplotlib.__version__} here; the committed figures: {sorted(map(str, drawn_by))}")
    differ = [p.name for p in made if p.read_bytes() != (BENCH / "figures" / p.name).read_bytes()]
    assert differ == [], "differ from the committed figures"
