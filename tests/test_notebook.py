"""The coherence notebook executes headless, with small sizes, on a tiny Llama."""

import os

import nbformat
from nbclient import NotebookClient

from tests import hf_models

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_notebook_executes(tmp_path):
  hf_models.save("llama_gqa", tmp_path)
  hf_models.save_char_tokenizer(tmp_path)
  nb = nbformat.read(os.path.join(ROOT, "notebooks", "subspace_coherence.ipynb"), as_version=4)
  assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), \
      "the notebook is stored with outputs"
  params = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
  params.source = "\n".join([
      f"MODEL = {str(tmp_path)!r}", "CALIB_TOKENS = 512", "EVAL_TOKENS = 256", "SEQ_LEN = 32",
      "K_LIST = [4, 8]", "EPS_LIST = [0.3, 0.6]", f"BASES_DIR = {str(tmp_path / 'bases')!r}",
      f"OUT = {str(tmp_path / 'coherence.json')!r}"])
  NotebookClient(nb, timeout=600, kernel_name="python3",
                 resources={"metadata": {"path": str(tmp_path)}}).execute()
  printed = "".join(o.get("text", "") for o in nb.cells[-1].outputs)
  assert "held-out" in printed and "in-sample" in printed
  images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
            if "image/png" in o.get("data", {})]
  assert len(images) >= 4, "the notebook shows no plots"
  import json
  rows = json.loads((tmp_path / "coherence.json").read_text())["records"]
  assert len(rows) == 4 and all(0 <= r["held_out"] <= 1 and 0 <= r["in_sample"] <= 1 for r in rows)
