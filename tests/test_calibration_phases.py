"""Where a calibration's time goes, and what it must not do per layer: compile a program
(the count is the same at any depth) or move data between host and device inside a
layer's solve (the device's sites reach the host together, after all of them)."""

import json
import os
import subprocess
import sys
import time

import jax.numpy as jnp
import numpy as np
import pytest

import gsi_jax
from gsi_jax.runtime import distributed
from gsi_jax.gsi import calibration, solvers
from gsi_jax.loading import synthetic

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# gptj-tiny: sites 128 and 512 wide; k = 30 solves the 512-wide one by LOBPCG on the device
# and the 128-wide ones on the host (5k >= d), so both paths run.
K = 30
IDS = np.random.default_rng(0).integers(0, 512, (8, 32)).astype(np.int32)

COUNT = """
import json, sys
import numpy as np
import gsi_jax
from gsi_jax.loading import synthetic
model = synthetic.random_model("gptj-tiny", "float32", n_layer=int(sys.argv[1]))
ids = np.random.default_rng(0).integers(0, 512, (8, 32)).astype(np.int32)
bases = gsi_jax.calibrate(model, model.params, ids, int(sys.argv[3]), method=sys.argv[2],
                          seq_len=32, progress=False)
print(json.dumps({key: bases.meta[key] for key in (
    "programs_compiled", "programs_compiled_after_first_layer", "phase_seconds")}))
"""


@pytest.mark.parametrize("method", ["krylov", "cascade"])
def test_the_programs_a_calibration_compiles_do_not_grow_with_depth(method):
  """Each depth in a fresh process (a process's programs are built once): 2 and 4 layers
  compile the same programs, all of them by the end of the first layer."""
  meta = {}
  for layers in (2, 4):
    proc = subprocess.run([sys.executable, "-c", COUNT, str(layers), method, str(K)],
                          capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    meta[layers] = json.loads(proc.stdout.splitlines()[-1])
  assert meta[2]["programs_compiled"] == meta[4]["programs_compiled"] > 0
  assert meta[2]["programs_compiled_after_first_layer"] == 0
  assert meta[4]["programs_compiled_after_first_layer"] == 0
  assert meta[4]["phase_seconds"]["compile"] > 0


@pytest.fixture(scope="module")
def model():
  return synthetic.random_model("gptj-tiny", "float32", n_layer=3)


@pytest.mark.parametrize("method", ["krylov", "cascade"])
def test_no_host_copy_happens_inside_a_layers_solve(model, method, monkeypatch):
  """Per layer: every device solve, then the host copies of their results; a copy between
  two device solves would be a round trip.  k = 8 solves all three sites on the device."""
  events = []
  solve_layer, on_device = calibration.solve_layer, solvers.lobpcg_on_device
  host_copy = distributed.host_copy

  def layer(*args, **kwargs):
    events.append("layer")
    return solve_layer(*args, **kwargs)

  def device_solve(*args):
    events.append("solve")
    return on_device(*args)

  def copy(x):
    events.append("copy")
    return host_copy(x)
  monkeypatch.setattr(calibration, "solve_layer", layer)
  monkeypatch.setattr(solvers, "lobpcg_on_device", device_solve)
  monkeypatch.setattr(distributed, "host_copy", copy)
  start = time.perf_counter()
  bases = gsi_jax.calibrate(model, model.params, IDS, 8, method=method, seq_len=32,
                            progress=False)
  wall = time.perf_counter() - start
  layers = "".join("|" if e == "layer" else e[0] for e in events).split("|")[1:]
  assert len(layers) == 3
  for steps in layers:
    assert steps.count("s") == 3 and "s" not in steps[steps.index("c"):], layers
  assert {solver for solver, _ in bases.meta["solver_by_site"].values()} == {"lobpcg"}
  phases = bases.meta["phase_seconds"]
  assert set(phases) == set(calibration.PHASES) and min(phases.values()) >= 0
  assert sum(phases.values()) <= wall


def test_the_solve_is_guarded_against_host_transfers(model):
  """The guard is real: a device solve that reads from the host raises (on a CPU, JAX
  guards host-to-device transfers; a GPU guards both ways)."""
  G = jnp.eye(512, dtype=jnp.float32) + 0.01
  solvers_on_device = solvers.lobpcg_on_device
  try:
    solvers.lobpcg_on_device = lambda G, X: solvers_on_device(G, np.asarray(X) + 0)
    with pytest.raises(Exception, match="Disallowed host-to-device transfer"):
      calibration.solve_layer({"fc_out": G}, K, "krylov", {})
  finally:
    solvers.lobpcg_on_device = solvers_on_device
  vectors, *_ = calibration.solve_layer({"fc_out": G}, K, "krylov", {})
  assert vectors["fc_out"].shape == (512, K)
