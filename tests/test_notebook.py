"""The coherence notebook: stored with its outputs, true to its JSON, and executable
headless from another folder, with small sizes, on a tiny Llama."""

import json
import os

import nbformat
from nbclient import NotebookClient

from tests import hf_models

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(ROOT, "notebooks", "subspace_coherence.ipynb")


def _images(nb):
  return [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
          if "image/png" in o.get("data", {})]


def test_stored_notebook_shows_its_figures_and_its_json():
  """A reader on the web sees every figure, and the printed table is the committed JSON's."""
  nb = nbformat.read(NOTEBOOK, as_version=4)
  assert len(_images(nb)) == 4, "the notebook is stored without its figures"
  printed = "".join(o.get("text", "") for o in nb.cells[-1].outputs).splitlines()
  records = json.load(open(os.path.join(ROOT, "results", "subspace_coherence.json")))["records"]
  assert printed == [f"k={r['k']:4d} eps={r['eps']:.2f}  held-out {r['held_out']:.3f}  "
                     f"in-sample {r['in_sample']:.3f}" for r in records]


def test_notebook_executes(tmp_path):
  hf_models.save("llama_gqa", tmp_path)
  hf_models.save_char_tokenizer(tmp_path)
  nb = nbformat.read(NOTEBOOK, as_version=4)
  for cell in nb.cells:
    if cell.cell_type == "code":
      cell.outputs, cell.execution_count = [], None
  params = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
  params.source = "\n".join([
      f"MODEL = {str(tmp_path)!r}", "CALIB_TOKENS = 512", "EVAL_TOKENS = 256", "SEQ_LEN = 32",
      "K_LIST = [4, 8]", "EPS_LIST = [0.3, 0.6]", f"BASES_DIR = {str(tmp_path / 'bases')!r}",
      f"OUT = {str(tmp_path / 'coherence.json')!r}"])
  NotebookClient(nb, timeout=600, kernel_name="python3",
                 resources={"metadata": {"path": str(tmp_path)}}).execute()
  printed = "".join(o.get("text", "") for o in nb.cells[-1].outputs)
  assert "held-out" in printed and "in-sample" in printed
  assert len(_images(nb)) >= 4, "the notebook shows no plots"
  rows = json.loads((tmp_path / "coherence.json").read_text())["records"]
  assert len(rows) == 4 and all(0 <= r["held_out"] <= 1 and 0 <= r["in_sample"] <= 1 for r in rows)
