"""Paper-scale machinery on tiny shapes: streaming and resumable calibration, the
solvers against eigh, calibration on a mesh, sharded bf16 checkpoints, scale.py."""

import json
import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.flax import save_file

import gsi_jax
from gsi_jax import GSIError
from gsi_jax.measure import footprint
from gsi_jax.gsi import calibration, solvers
from gsi_jax.loading import synthetic
from gsi_jax.models import params as P
from tests.conftest import with_xla_flags
from tests.test_experiments import assert_one_error_line

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IDS = np.random.default_rng(0).integers(0, 101, (6, 16)).astype(np.int32)


def assert_same_bases(a, b, rtol=1e-4):
  assert a.sites() == b.sites()
  for layer, site in a.sites():
    wa, wb = a.eigenvalues[layer][site], b.eigenvalues[layer][site]
    np.testing.assert_allclose(wa, wb, rtol=rtol, atol=rtol * float(wa.max()))
    # Same subspace per well-separated direction: compare projectors on the top 4.
    Va, Vb = a.vectors[layer][site][:, :4], b.vectors[layer][site][:, :4]
    np.testing.assert_allclose(Va @ Va.T, Vb @ Vb.T, atol=1e-3)


@pytest.mark.parametrize("family", ["gpt2", "gptj", "opt", "opt_post_ln", "llama_gqa"])
def test_streaming_equals_all_at_once(tiny_folder, family):
  model = gsi_jax.load_model(tiny_folder(family)[0])
  streamed = gsi_jax.calibrate(model, model.params, IDS, 16, progress=False, seq_len=16)
  grams = calibration.gram_matrices(model, model.params, IDS, progress=False)
  at_once = calibration.solve(grams, 16)
  assert_same_bases(streamed, at_once)
  for layer, site in at_once.sites():
    np.testing.assert_allclose(streamed.trace[layer][site], at_once.trace[layer][site],
                               rtol=1e-5)


def test_interrupted_calibration_resumes_to_the_same_bases(tiny_folder, tmp_path, monkeypatch):
  model = gsi_jax.load_model(tiny_folder("llama_mha")[0])
  whole = gsi_jax.calibrate(model, model.params, IDS, 8, method="cascade", progress=False,
                            seq_len=16)
  solved = []
  real = calibration.solve_layer

  def interrupt_second_layer(grams, *args):
    if len(solved) == 1:
      raise KeyboardInterrupt
    solved.append(1)
    return real(grams, *args)
  monkeypatch.setattr(calibration, "solve_layer", interrupt_second_layer)
  progress = str(tmp_path / "progress")
  with pytest.raises(KeyboardInterrupt):
    gsi_jax.calibrate(model, model.params, IDS, 8, method="cascade", progress=False,
                      seq_len=16, resume_dir=progress)
  counted = []
  monkeypatch.setattr(calibration, "solve_layer",
                      lambda grams, *args: counted.append(1) or real(grams, *args))
  resumed = gsi_jax.calibrate(model, model.params, IDS, 8, method="cascade", progress=False,
                              seq_len=16, resume_dir=progress)
  assert len(counted) == 1  # layer_0 came from the checkpoint, only layer_1 was solved
  assert_same_bases(resumed, whole, rtol=1e-6)
  with pytest.raises(GSIError, match=r"holds an interrupted calibration with another k_max; "
                                     r"to start afresh, delete it \(rm -r .*progress\)"):
    gsi_jax.calibrate(model, model.params, IDS, 4, method="cascade", progress=False,
                      seq_len=16, resume_dir=progress)


def psd(d, rank, seed=0):
  rng = np.random.default_rng(seed)
  X = rng.standard_normal((rank, d)) * (1.0 / np.arange(1, d + 1)) ** 0.5
  return X.T @ X


@pytest.mark.parametrize("d, k", [(120, 8), (400, 16)])
def test_lobpcg_agrees_with_eigh(d, k):
  G = psd(d, 3 * d)
  w_exact, _ = solvers.top_eigenpairs(G, k)
  w, V, iterations = solvers.lobpcg_top(G.astype(np.float32), solvers.random_start(d, k))
  assert 0 < iterations <= solvers.LOBPCG_MAX_ITERATIONS
  np.testing.assert_allclose(w, w_exact, rtol=1e-3)
  np.testing.assert_allclose(V.T @ V, np.eye(k), atol=1e-4)
  assert abs(solvers.energy_loss(G, V, w_exact)) < 1e-4
  w32, _ = solvers.top_eigenpairs_float32(G, k)
  np.testing.assert_allclose(w32, w_exact, rtol=1e-4)


@pytest.mark.parametrize("method", ["eigh", "krylov", "cascade"])
@pytest.mark.parametrize("d, k", [(60, 16), (200, 8)])  # 5k >= d: eigh or Davidson; else LOBPCG
def test_every_method_captures_eighs_energy(method, d, k):
  G = psd(d, 2 * d, seed=1)
  w_exact, V_exact = solvers.top_eigenpairs(G, k)
  # A previous layer's basis for the cascade: the exact one, slightly rotated.
  previous = np.linalg.qr(V_exact + 0.05 * psd(d, 1, seed=2)[:, :k])[0]
  w, V, cost = calibration.solve_site(G, k, method, previous)
  expected = {"eigh": "eigh", "krylov": "lobpcg" if 5 * k < d else "eigh",
              "cascade": "lobpcg" if 5 * k < d else "block_davidson"}[method]
  assert cost["solver"] == expected
  assert solvers.energy_loss(G, V, w_exact) < 1e-3
  np.testing.assert_allclose(w, w_exact, rtol=1e-3)


MESH_SCRIPT = textwrap.dedent("""
    import sys
    import jax, numpy as np
    assert len(jax.devices()) == 4, jax.devices()
    import gsi_jax
    from gsi_jax.runtime.sharding import make_mesh
    from tests import hf_models
    from tests.test_scale import assert_same_bases
    folder = sys.argv[1]
    hf_models.save("gptj", folder)  # GPT-J's layout: 32 wide, fc_in in attn_in, 128-wide fc_out
    model = gsi_jax.load_model(folder)
    ids = np.random.default_rng(0).integers(0, 101, (8, 16)).astype(np.int32)
    for method in ("eigh", "krylov"):
      single = gsi_jax.calibrate(model, model.params, ids, 4, method=method, seq_len=16,
                                 progress=False)
      meshed = gsi_jax.calibrate(model, model.params, ids, 4, method=method, seq_len=16,
                                 progress=False, mesh=make_mesh(4))
      assert_same_bases(single, meshed)
    print("MESH_OK")
""")


def test_calibration_on_a_mesh_equals_single_device(tmp_path):
  env = {**with_xla_flags("--xla_force_host_platform_device_count=4"), "JAX_PLATFORMS": "cpu",
         "PYTHONPATH": ROOT}
  proc = subprocess.run([sys.executable, "-c", MESH_SCRIPT, str(tmp_path)], capture_output=True,
                        text=True, env=env, cwd=ROOT, timeout=600)
  assert "MESH_OK" in proc.stdout, proc.stderr[-3000:]


TINY_GPTJ = dict(vocab_size=101, n_positions=64, n_embd=64, n_layer=3, n_head=4, rotary_dim=8,
                 bos_token_id=0, eos_token_id=0)  # ids inside the tiny vocabulary


@pytest.fixture(scope="module")
def sharded_checkpoint(tmp_path_factory):
  folder = str(tmp_path_factory.mktemp("sharded"))
  written = synthetic.write_random_checkpoint(synthetic.hf_config("gptj-6b", **TINY_GPTJ),
                                              folder, shard_bytes=64 << 10)
  return folder, written


def test_sharded_bf16_checkpoint_loads_as_unsharded(sharded_checkpoint, tmp_path):
  folder, written = sharded_checkpoint
  assert written["files"] > 2 and synthetic.is_complete(folder)
  tensors = {}
  for name in sorted(os.listdir(folder)):
    if name.endswith(".safetensors"):
      with safe_open(os.path.join(folder, name), framework="flax") as f:
        tensors.update({key: f.get_tensor(key) for key in f.keys()})
  assert {str(t.dtype) for t in tensors.values()} == {"bfloat16"}
  single = tmp_path / "single"
  single.mkdir()
  save_file(tensors, str(single / "model.safetensors"), metadata={"format": "pt"})
  (single / "config.json").write_text(open(os.path.join(folder, "config.json")).read())
  a = gsi_jax.load_model(folder, "bfloat16")
  b = gsi_jax.load_model(str(single), "bfloat16")
  flat_a, flat_b = P.site_kernels(a.params), P.site_kernels(b.params)
  assert flat_a.keys() == flat_b.keys() and len(flat_a) == 3
  for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params)):
    assert x.dtype == y.dtype and np.array_equal(np.asarray(x), np.asarray(y))
  cut = gsi_jax.load_model(folder, "bfloat16", n_layers=1)
  assert P.layers(cut.params) == ["layer_0"]
  np.testing.assert_array_equal(np.asarray(cut.params["layer_0"]["mlp_out"]["kernel"]["fc_out"]),
                                np.asarray(a.params["layer_0"]["mlp_out"]["kernel"]["fc_out"]))
  with pytest.raises(GSIError, match="n_layers must be in 1..3"):
    gsi_jax.load_model(folder, n_layers=4)


def run_benchmark(script, args):
  return subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", script)] + args,
                        capture_output=True, text=True, cwd=ROOT, timeout=600,
                        env={**os.environ, "JAX_PLATFORMS": "cpu"})


def test_scale_benchmark_end_to_end(sharded_checkpoint, tmp_path):
  folder, _ = sharded_checkpoint
  out = tmp_path / "scale.json"
  proc = run_benchmark("scale.py", [
      f"--checkpoint={folder}", "--k=4", "--calib_tokens=64", "--seq_len=32",
      "--decode_layers=2", "--decode_k=8", "--new_tokens=3", "--repeats=1", f"--out={out}"])
  assert proc.returncode == 0, proc.stderr[-3000:]
  r = json.loads(out.read_text())
  assert r["layers"] == 3 and r["calib_tokens"] == 64 and r["weights_gb"] > 0
  assert set(r["calibration_s"]) == {"eigh", "cascade", "krylov"}
  assert all(v > 0 for v in r["calibration_s"].values())
  assert r["load_peak_rss_gb"] > 0 and all(v > 0 for v in r["calib_peak_rss_gb"].values())
  for method in ("cascade", "krylov"):
    assert -1e-5 <= r["energy_loss_vs_eigh"][method] <= 0.01
    assert r["calibration_basis"][method] == "measured at full depth"
  assert r["calibration_basis"]["eigh"].startswith("modelled")
  assert set(r["solve_s_by_width"]["krylov"]) == {"64", "256"}
  for method in ("cascade", "krylov"):  # where the time went; no layer compiles after the first
    phases = r["calibration_phase_s"][method]
    assert set(phases) == set(calibration.PHASES) and min(phases.values()) >= 0
    assert sum(phases.values()) <= r["calibration_s"][method]
    assert r["programs_compiled"][method]["after_first_layer"] == 0
  assert r["programs_compiled"]["cascade"]["in_all"] > 0  # the first method built them
  assert r["decode_bases"] == "krylov at the decode depth"  # 2 of 3 layers: calibrated again
  names = [p["name"] for p in r["points"]]
  assert names == ["static", "gated_median_rho", "gated_all_slow"]
  static, _, slow = r["points"]
  assert static["fast_share"] == 1.0 and slow["fast_share"] == 0.0
  assert static["byte_ideal_speedup"] > 1
  assert slow["byte_ideal_speedup"] == pytest.approx(1.0)  # ε = 0 reads W alone, not V_k
  assert "measured_speedup" not in r  # each ratio sits in its point, beside its interval
  # One round: a ratio, with no interval and no verdict.
  assert static["speedup_low"] is None is static["speedup_high"]
  assert static["verdict"] == "too few rounds"
  assert static["measured_speedup"] == pytest.approx(static["tokens_per_s"]
                                                     / static["dense_tokens_per_s"])  # 1 round


@pytest.mark.parametrize("args, message", [
    (["--method=svd"], "--method takes a list of"),
    (["--k=0"], "--k must be a positive whole number"),
    (["--checkpoint="], "--checkpoint is required"),
    (["--calib_tokens=16"], "must hold one --seq_len window"),
    (["--decode_layers=1", "--decode_k=512", "--calib_tokens=512"],
     "--decode_k (512) must be below --calib_tokens"),
    (["--decode_layers=-1"], "--decode_layers must be >= 0"),
    (["--layers=9"], "--layers=9 exceeds the 3 layers"),
    (["--eigh_layers=4"], "--eigh_layers=4 exceeds the 3 layers"),
    (["--out=/etc/hostname/x.json"], "is a file, so"),
])
def test_scale_bad_flags_exit_2(sharded_checkpoint, args, message):
  folder, _ = sharded_checkpoint
  assert_one_error_line(run_benchmark("scale.py", [f"--checkpoint={folder}"] + args), message)


def test_make_checkpoint_refuses_to_overwrite(sharded_checkpoint):
  folder, _ = sharded_checkpoint
  assert_one_error_line(run_benchmark("make_checkpoint.py", [f"--out={folder}"]),
                        "already holds a checkpoint")
  assert_one_error_line(run_benchmark("make_checkpoint.py", []), "--out is required")


def test_memory_plan_models_what_a_process_reads():
  """footprint's bytes for GPT-J's first 4 layers on 2 devices are what each of the 2
  processes of RESULTS §13.3 read (bytes_read_gb_per_process), and on 1 device the whole."""
  with open(os.path.join(ROOT, "results/benchmarks/scale-gptj-6b-4-layers-2-processes.json"),
            encoding="utf-8") as f:
    two = json.load(f)
  share = footprint.device_bytes("gptj-6b", 2, 512, layers=4)
  whole = footprint.device_bytes("gptj-6b", 1, 512, layers=4)
  assert share.load_gb == pytest.approx(two["bytes_read_gb_per_process"][0], rel=1e-6)
  assert whole.load_gb == pytest.approx(two["weights_gb"], rel=1e-6)
  assert share.replicated_gb == whole.replicated_gb and share.split_gb == whole.split_gb / 2
  assert share.gram_layer_gb == whole.gram_layer_gb / 2


@pytest.mark.parametrize("args, message", [
    (["--fit_on=results/benchmarks/scale-gptj-6b-4-layers-2-processes.json"],
     "fitted on a one-process run"),
    (["--check=results/benchmarks/nothing.json"], "--check: text file not found: "
                                                  "results/benchmarks/nothing.json"),
    (["--check=results/quality_table.json"], "not a benchmarks/scale.py record"),
    (["--check=README.md"], "--check: README.md is not JSON"),
    (["--shapes=opt-1t"], "--shapes: unknown shape 'opt-1t'"),
    (["--hosts=0"], "--hosts must be a positive whole number"),
])
def test_memory_plan_bad_flags_exit_2(args, message):
  assert_one_error_line(run_benchmark("memory_plan.py", ["--out=/tmp/unused.json"] + args), message)
