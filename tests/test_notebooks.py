"""The notebooks run top to bottom on CPU with the tiny presets (as CI executes them)."""

import pathlib

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("matplotlib")
pytest.importorskip("ipykernel")

NOTEBOOKS = sorted((pathlib.Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


def test_three_notebooks():
    assert [p.name for p in NOTEBOOKS] == ["01_quickstart.ipynb", "02_fusion_ablation.ipynb",
                                           "03_architecture_walkthrough.ipynb"]


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path, monkeypatch, child_xla_flags):
    # The kernel is a fresh process: it inherits this environment, so give it the test setup (CPU).
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.delenv("MPLBACKEND", raising=False)   # the kernel's inline backend renders PNGs
    monkeypatch.setenv("XLA_FLAGS", child_xla_flags)   # one CPU device, unoptimised compiles
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(path.parent)}})
    client.execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors
    assert any(o.get("output_type") == "display_data" and "image/png" in o.get("data", {})
               for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])), "no plot rendered"
