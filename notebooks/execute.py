"""Executes the coherence notebook from the repository root and stores it with its outputs
(figures included), so that it reads on the web.

  python notebooks/execute.py            # make notebook: notebooks/runs/, never the committed files
  python notebooks/execute.py --commit   # make notebook-commit: the committed notebook and
                                         # results/subspace_coherence.json, in place

A user's run writes the executed copy and its JSON under notebooks/runs/ (ignored by git);
only --commit rewrites what RESULTS.md §12 cites.
"""

import os
import re
import sys

import nbclient
import nbformat
from absl import app, flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join("notebooks", "subspace_coherence.ipynb")
COMMITTED_JSON = os.path.join("results", "subspace_coherence.json")
RUNS = os.path.join("notebooks", "runs")

_COMMIT = flags.DEFINE_bool("commit", False, "Rewrite the committed notebook and its JSON "
                            f"({COMMITTED_JSON}) instead of writing under {RUNS}/.")


def outputs(commit: bool) -> tuple[str, str]:
  """(executed notebook, JSON), relative to the repository root."""
  if commit:
    return NOTEBOOK, COMMITTED_JSON
  return (os.path.join(RUNS, os.path.basename(NOTEBOOK)),
          os.path.join(RUNS, os.path.basename(COMMITTED_JSON)))


def with_json_out(nb, json_path: str):
  """The notebook with its parameters cell's OUT set to json_path."""
  params = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
  source, count = re.subn(r"^OUT = .*$", f"OUT = {json_path!r}  # from the repository root",
                          params.source, flags=re.M)
  if count != 1:
    raise ValueError(f"{NOTEBOOK}: its parameters cell has no single 'OUT = ...' line")
  params.source = source
  return nb


def main(argv):
  del argv
  notebook_out, json_out = outputs(_COMMIT.value)
  folder = os.path.join(ROOT, os.path.dirname(notebook_out))
  try:
    os.makedirs(folder, exist_ok=True)
  except OSError as e:
    print(f"error: cannot create {folder} ({e.strerror}); run from a writable checkout",
          file=sys.stderr)
    sys.exit(2)
  nb = nbformat.read(os.path.join(ROOT, NOTEBOOK), as_version=4)
  if not _COMMIT.value:  # the committed notebook already writes the committed JSON
    nb = with_json_out(nb, json_out)
  print(f"executing {NOTEBOOK} (about 1-2 minutes on the default model; its first run "
        "calibrates bases, several minutes more) ...", flush=True)
  nbclient.NotebookClient(nb, timeout=3600, resources={"metadata": {"path": ROOT}}).execute()
  path = os.path.join(ROOT, notebook_out)
  nbformat.write(nb, path + ".tmp")
  os.replace(path + ".tmp", path)  # an interrupted run leaves the earlier copy whole
  print(f"wrote {notebook_out} and {json_out}")


if __name__ == "__main__":
  app.run(main)
