"""The README's first GPU commands as they run on the lent GPU image: jax 0.11, nothing
installable, no gguf or torch, the repository on PYTHONPATH (`PYTHONPATH=. python3 ...`).
Here they run on the CPU in that package set (`make test-jax011`), on a tiny Hugging Face
folder: the demo, one paper table and the whole-decode benchmark, each logging the device
it ran on and recording it in its JSON."""

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import PREBUILT

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--calib_tokens=256", "--eval_tokens=128", "--seq_len=32", "--k=8"]

pytestmark = pytest.mark.skipif(
    not PREBUILT, reason="the lent image's package set: make test-jax011 (the main environment "
    "runs these scripts in test_experiments.py)")


@pytest.mark.parametrize("command", [
    ["-m", "gsi_jax.demo", *SMALL, "--eps=0.1", "--max_new_tokens=4", "--prompt=abc"],
    ["experiments/quality_table.py", *SMALL, "--eps=0.3"],
    ["benchmarks/decode.py", "--torch=false", "--gsi=8:0.1", "--max_new_tokens=4", "--repeats=3",
     "--ceiling_gib=0.0625", "--prompt=abc"],
], ids=["demo", "quality_table", "decode"])
def test_a_readme_gpu_command_runs_from_the_checkout(tiny_folder, tmp_path, command):
  folder, _ = tiny_folder("llama_gqa")
  out = tmp_path / "out.json"
  env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"}
  proc = subprocess.run([sys.executable, *command, f"--model={folder}", f"--out={out}",
                         f"--bases_dir={tmp_path / 'bases'}"], cwd=ROOT, env=env, text=True,
                        capture_output=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "running on cpu: 1 x cpu" in proc.stderr
  run = json.loads(out.read_text())["run"]
  assert run["devices"] == "cpu: 1 x cpu" and run["jax"] == __import__("jax").__version__


def test_without_torch_importing_gsi_jax_warns_nothing():
  """In an install without torch (the demo's, the lent image's), transformers' advice that
  PyTorch was not found reads as a failure: gsi_jax needs torch for nothing it imports."""
  proc = subprocess.run([sys.executable, "-c", "import gsi_jax, transformers"],
                        capture_output=True, text=True, cwd=ROOT, timeout=300,
                        env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT})
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "PyTorch was not found" not in proc.stderr
