"""notebooks/dfpo_quickstart.ipynb runs top to bottom (embedded model, a few CPU steps per method)."""

from __future__ import annotations

from pathlib import Path

import pytest

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "dfpo_quickstart.ipynb"


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
