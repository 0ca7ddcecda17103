"""The course notebooks (examples/notebooks/) run top to bottom in a real Jupyter kernel, and are stored without
outputs."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="pip install easyfit[dev] (nbformat) to run the notebooks")
nbclient = pytest.importorskip("nbclient", reason="pip install easyfit[dev] (nbclient) to run the notebooks")
if importlib.util.find_spec("ipykernel") is None:   # not imported here: easyfit would take this for a notebook
    pytest.skip("pip install easyfit[dev] (ipykernel) to run the notebooks", allow_module_level=True)

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "examples" / "notebooks").glob("*.ipynb"))


def test_there_are_three_notebooks_stored_without_outputs():
    assert [path.name[:2] for path in NOTEBOOKS] == ["01", "02", "03"]
    for path in NOTEBOOKS:
        cells = [cell for cell in nbformat.read(path, as_version=4).cells if cell.cell_type == "code"]
        assert all(not cell.outputs and cell.execution_count is None for cell in cells), path.name


@pytest.mark.timeout(240)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[path.stem for path in NOTEBOOKS])
def test_notebook_runs_top_to_bottom(path, tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")   # two forked ranks share the CPU cores
    monkeypatch.setenv("TMPDIR", str(tmp_path))   # the folders a notebook makes for its files (tempfile) go here
    notebook = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(notebook, timeout=180, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()   # raises CellExecutionError, with the cell and its traceback, on any error
