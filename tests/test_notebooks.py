"""Every notebook executes top to bottom on a small run of its study, in a temporary copy.

``FRAGSIM_NOTEBOOK_SCALE`` makes each notebook run its study now, at that scale,
instead of reading the committed reference, so the library path a notebook
depends on is exercised, not just a Parquet file.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from conftest import REPO_ROOT as REPO
from conftest import SHARED_TRACES

nbformat = pytest.importorskip("nbformat", reason="notebooks extra: pip install 'fragsim[notebooks]'")
nbclient = pytest.importorskip("nbclient", reason="notebooks extra: pip install 'fragsim[notebooks]'")
from jupyter_client.manager import KernelManager  # noqa: E402  (after the skips above)

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))
SCALE = "0.05"          # fraction of each study's requests...
HOUR_SCALE = "0.005"    # ...less where a study replays its points by duration_s (an hour
                        # at 100 requests/s: 360,000 requests; 0.005 of it is 1,800)
MIN_REQUESTS = "50"     # ...but at least this many per point (studies ask for up to 300)
TIMEOUT_S = 120         # per cell


def _kernel_name() -> str:
    """The python3 kernel, registered for this interpreter if no spec exists yet."""
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    try:
        KernelSpecManager().get_kernel_spec("python3")
    except NoSuchKernel:
        from ipykernel import kernelspec

        kernelspec.install(user=True)
    return "python3"


def test_there_is_a_notebook_per_paper_figure_and_seed_case() -> None:
    assert [p.stem for p in NOTEBOOKS] == [
        "block_size", "cluster_hybrid_pd", "cluster_pd_ratio", "cluster_routing", "fig13_batched_requests",
        "fig2_memory_split", "hybrid_managers", "hybrid_prefix_mooncake", "offload_backends",
        "offload_cpu_size", "offload_disk", "offload_sessions", "rate_sweep",
        "seed_capacity_7b", "seed_peak_traffic", "seed_rag_longtail", "seed_underprovision",
        "sharing_prefix_vmm", "vllm_fig12_schedulers", "vllm_reports"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_executes(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    copy = tmp_path / path.name
    shutil.copyfile(path, copy)
    # The notebooks rerun their studies small; those on the public trace files need them.
    text = "\n".join(cell.source for cell in nbformat.read(path, as_version=4).cells)
    studies = {p.stem: p.read_text() for p in (REPO / "experiments").glob("*.toml") if f'"{p.stem}"' in text}
    scale = HOUR_SCALE if any("duration_s" in toml for toml in studies.values()) else SCALE
    monkeypatch.setenv("FRAGSIM_NOTEBOOK_SCALE", scale)
    monkeypatch.setenv("FRAGSIM_NOTEBOOK_MIN_REQUESTS", MIN_REQUESTS)
    needs_traces = [name for name, toml in studies.items() if "${SHARED_TRACES}" in toml]
    if needs_traces and not SHARED_TRACES.is_dir():
        pytest.skip(f"{', '.join(needs_traces)} need the public traces, not found at {SHARED_TRACES}")
    monkeypatch.setenv("FRAGSIM_SHARED_TRACES", str(SHARED_TRACES))
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    notebook = nbformat.read(copy, as_version=4)
    assert not any(cell.get("outputs") for cell in notebook.cells if cell.cell_type == "code"), (
        "commit notebooks without outputs")
    # Unix sockets, not TCP ports: no port to collide with other kernels or tests.
    manager = KernelManager(kernel_name=_kernel_name(), transport="ipc", ip=str(tmp_path / "ipc"))
    client = nbclient.NotebookClient(notebook, km=manager, timeout=TIMEOUT_S,
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()  # raises CellExecutionError on the first failing cell
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs]
    assert any("image/png" in o.get("data", {}) for o in outputs), "the notebook drew no figure"
    assert any(f"ran now at scale {float(scale):g}" in o.get("text", "") for o in outputs)
