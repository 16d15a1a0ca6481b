"""README's "Adding a method", taken as a plugin author takes it: in a copy of the
repository, the worked example becomes `gsi_jax/methods/sparsity_global.py` ending in
`register(METHOD)` and one import line in `gsi_jax/methods/__init__.py`; then the tests that
enumerate methods run there, unedited, and pass, naming the committed results that lack the
new method as not yet run."""

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Every test that enumerates the registry against something committed or fixed.
ENUMERATING = ["tests/test_methods.py::test_the_registry_holds_every_method_declared_whole",
               "tests/test_results.py::test_pareto_run_holds_every_method_and_its_summaries",
               "tests/test_gpu_programs.py::test_the_committed_method_programs"]


def _tracked_copy(dest):
  files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                         check=True).stdout.decode().split("\0")
  for name in filter(None, files):
    if os.path.isfile(os.path.join(ROOT, name)):
      os.makedirs(os.path.join(dest, os.path.dirname(name)), exist_ok=True)
      shutil.copy2(os.path.join(ROOT, name), os.path.join(dest, name))


@pytest.mark.skipif(shutil.which("git") is None, reason="no git")
def test_a_method_added_through_readme_steps_passes_the_tests_unedited(tmp_path):
  repo = tmp_path / "repo"
  _tracked_copy(repo)
  example = (repo / "tests" / "global_sparsity.py").read_text()
  module = example.replace("from gsi_jax.methods import Knob, Method, Point",
                           "from gsi_jax.methods import Knob, Method, Point, register")
  (repo / "gsi_jax" / "methods" / "sparsity_global.py").write_text(
      module + "\n\nregister(METHOD)\n")
  init = repo / "gsi_jax" / "methods" / "__init__.py"
  last = "from gsi_jax.methods import learned  # noqa: E402,F401  the four learned allocations\n"
  assert last in init.read_text()
  init.write_text(init.read_text().replace(
      last, last + "from gsi_jax.methods import sparsity_global  # noqa: E402,F401\n"))
  env = {**os.environ, "PYTHONPATH": str(repo), "PYTHONDONTWRITEBYTECODE": "1"}
  env.pop("PYTEST_XDIST_WORKER", None)
  proc = subprocess.run(
      [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W",
       "default::UserWarning", *ENUMERATING,
       "--override-ini", "addopts=-ra", "-o", f"cache_dir={tmp_path / 'cache'}"],
      cwd=repo, env=env, capture_output=True, text=True, timeout=600)
  out = proc.stdout + proc.stderr
  assert proc.returncode == 0, out[-3000:]
  assert f"{len(ENUMERATING)} passed" in out, out[-3000:]
  # The copy's package ran (not this checkout's), and the new method is reported missing.
  for committed in ("pareto.json", "programs.json"):
    assert f"{committed}: not yet run for sparsity_global" in out, out[-3000:]
