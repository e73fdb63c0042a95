"""notebooks/dfpo_quickstart.ipynb runs top to bottom (embedded model, a few CPU steps per method), and what its
text says about the metrics is true of what the run printed."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "dfpo_quickstart.ipynb"
FLOAT_ROUNDING = 1e-6  # the orthogonality residual of a balancing transform, as the notebook's text states


def metric_table(text: str) -> dict[str, dict[int, dict[str, float]]]:
    """The notebook's printed table: {method: {step: {key: value}}}."""
    table: dict[str, dict[int, dict[str, float]]] = {}
    method = None
    for line in text.splitlines():
        row = re.match(r"  step (\d+): (.*)", line)
        if row and method is not None:
            values = dict(item.split("=") for item in row.group(2).split(", "))
            table[method][int(row.group(1))] = {k: float(v) for k, v in values.items()}
        elif line in ("GSPO", "DFPO Min-Replace"):
            method = line
            table[method] = {}
    return table


@pytest.mark.slow
def test_quickstart_notebook_executes(tmp_path: Path, embedded_gguf: None) -> None:
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("matplotlib")
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(
        notebook, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs), "the metrics plot is shown inline"
    text = "".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream")
    assert "GSPO" in text and "DFPO Min-Replace" in text and "before training" in text
    assert (tmp_path / "outputs" / "notebook_metrics.png").is_file()

    # The "Metrics over steps" statements, on this run's printed table.
    table = metric_table(text)
    keys = {"step_reward", "entropy", "asym/before", "asym/after", "transform/phi_min", "transform/orth_residual"}
    for method in ("GSPO", "DFPO Min-Replace"):
        assert sorted(table[method]) == [1, 2, 3, 4]
        assert all(set(row) == keys for row in table[method].values()), method  # GSPO logged none of them before
    gspo, dfpo = table["GSPO"], table["DFPO Min-Replace"]
    for row in gspo.values():  # no transform: phi = 1, Asym after = before
        assert row["transform/phi_min"] == 1.0 and row["asym/after"] == row["asym/before"]
    assert gspo[1]["transform/orth_residual"] <= FLOAT_ROUNDING
    with_signal = [step for step in (2, 3, 4) if gspo[step]["asym/before"] > 0]
    assert with_signal, "no off-policy step with a reward signal: the GSPO statement is untested"
    assert all(gspo[step]["transform/orth_residual"] > 1e3 * FLOAT_ROUNDING for step in with_signal)
    assert all(row["transform/orth_residual"] <= FLOAT_ROUNDING for row in dfpo.values())
    assert dfpo[1]["transform/phi_min"] == 1.0
    for step in (2, 3, 4):
        row = dfpo[step]
        assert row["transform/phi_min"] < 1.0
        assert row["asym/after"] < row["asym/before"] or row["asym/before"] == 0.0
