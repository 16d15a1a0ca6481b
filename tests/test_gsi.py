"""GSI invariants, calibration, checkpoints and bad input, on tiny models of every family."""

import math
import os
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gsi_jax
from gsi_jax import GSIError, make_gate, metrics
from gsi_jax.gsi import calibration, cascade, solvers
from gsi_jax.metrics import principal_cosines
from gsi_jax.models import params as P
from gsi_jax.models.params import site_kernels
from gsi_jax.ops import GatedWeights, gated_linear

FAMILIES = ["gpt2", "gptj", "opt", "opt_post_ln", "llama_gqa"]
RNG = np.random.default_rng(0)
CALIB = RNG.integers(0, 101, (8, 16)).astype(np.int32)
EVAL = RNG.integers(0, 101, (2, 12)).astype(np.int32)


@pytest.fixture(scope="module")
def tiny(tiny_folder):
  cache = {}

  def make(name):
    if name not in cache:
      model = gsi_jax.load_model(tiny_folder(name)[0])
      widest = P.widest_site(model.params)
      bases = gsi_jax.calibrate(model, model.params, CALIB, k_max=widest, seq_len=16,
                                progress=False)
      cache[name] = model, bases, widest
    return cache[name]
  return make


def logits(model, params, gate=None, ids=EVAL):
  return np.asarray(model.logits(params, ids, gate))


@pytest.mark.parametrize("name", FAMILIES)
def test_eps_zero_is_dense(tiny, name):
  model, bases, _ = tiny(name)
  params = gsi_jax.apply_gsi(model.params, bases, 8)
  # Same arithmetic as dense; XLA may fuse it differently, hence fp32 rounding slack.
  np.testing.assert_allclose(logits(model, params, make_gate(0.0)), logits(model, model.params),
                             atol=1e-6, rtol=0)


@pytest.mark.parametrize("batch1_switch", [False, True])
def test_eps_zero_reads_no_basis(tiny, batch1_switch):
  """ε = 0 cannot fire, so the xla path reads W alone: no V_k product in that branch, and
  the byte formula (fed by the V columns each site reports) gives dense's bytes."""
  model, bases, _ = tiny("llama_gqa")
  params = gsi_jax.apply_gsi(model.params, bases, 8)
  gate = make_gate(0.0, impl="xla", batch1_switch=batch1_switch)
  scores = metrics.score(model, params, EVAL, gate)
  assert all(v == 0 for sites in scores["rows_by_layer"].values() for v, _ in sites.values())
  b = metrics.byte_accounting(params, scores["fast_share_by_layer"], scores["rows_by_layer"])
  assert b["bytes_per_token"] == pytest.approx(b["bytes_per_token_dense"])
  assert metrics.score(model, params, EVAL, make_gate(0.5, impl="xla"))["rows_by_layer"] \
      [P.layer_name(0)]["attn_in"][0] == 8
  x = jnp.ones((1, 1, 16))
  W, V = [jnp.ones((16, 4)), jnp.ones((16, 6))], jnp.eye(16)[:, :3]
  weights = GatedWeights(W, V, [V.T @ w for w in W])
  jaxpr = jax.make_jaxpr(lambda e: gated_linear(x, weights, e, gate))(jnp.float32(0))
  (cond,) = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "cond"]
  never_fast, gated = cond.params["branches"]
  dots = [[e.invars[1].aval.shape for e in branch.jaxpr.eqns if e.primitive.name == "dot_general"]
          for branch in (never_fast, gated)]
  assert dots[0] == [(16, 4), (16, 6)] and (16, 3) in dots[1]


def test_a_decode_decides_eps_once_per_model(tiny):
  """ε <= 0 everywhere: the decode is dense's program (mode "dense", no V_k, the same
  tokens as dense); ε > 0 everywhere: no site keeps its ε <= 0 branch; a learned tree's
  per-site thresholds, a traced ε, or asked-for statistics keep the sites' own."""
  from gsi_jax.models.model import decode_gate
  model, bases, _ = tiny("llama_gqa")
  params = gsi_jax.apply_gsi(model.params, bases, 8)
  zero, positive = make_gate(0.0, impl="xla"), make_gate(0.3, impl="xla")
  assert decode_gate(params, zero).mode == "dense"
  assert decode_gate(params, zero, keep_stats=True) is zero
  assert decode_gate(params, positive).eps_positive
  assert decode_gate(params, make_gate(0.3, head_eps=0.0)).mode == "gated"  # mixed: its own
  assert decode_gate(params, make_gate(0.0, "static")).mode == "static"
  per_site = P.with_site_values(params, P.EPS, {layer: dict.fromkeys(sites, 0.0) for layer,
                                                sites in P.site_kernels(params).items()})
  assert decode_gate(per_site, zero) is zero
  def traced(e):
    gate = make_gate(0.3).replace(eps=e)
    assert decode_gate(params, gate) is gate  # nothing concrete to decide on
    return e
  jax.jit(traced)(jnp.float32(0))
  ids = EVAL[:1, :6]
  np.testing.assert_array_equal(np.asarray(model.generate(params, ids, 5, zero)),
                                np.asarray(model.generate(model.params, ids, 5)))
  x = jnp.ones((1, 1, 16))
  W, V = [jnp.ones((16, 4))], jnp.eye(16)[:, :3]
  weights = GatedWeights(W, V, [V.T @ w for w in W])
  for gate, conds in ((make_gate(0.3, impl="pallas"), 1),
                      (make_gate(0.3, impl="pallas").replace(eps_positive=True), 0)):
    jaxpr = jax.make_jaxpr(lambda e: gated_linear(x, weights, e, gate))(jnp.float32(0.3))
    assert sum(e.primitive.name == "cond" for e in jaxpr.jaxpr.eqns) == conds


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_g_from_transposed_bases_is_x_V(dtype):
  """On a GPU a decode reads V_kᵀ (k, d) (`project_rows`: one row reduction at any number of
  tokens, where V_k's (d, k) columns are a multiply and a column reduce); g, and with it
  ‖x‖² from the same reduction, match x V_k and the sum of squares, at one token and at
  several; the gate read from them (`energy_gate`, fused or not) is `gate_mask`'s."""
  from gsi_jax.ops.gate import energy_gate, gate_mask, project_rows
  from gsi_jax.ops.gated_linear import energy, project, project_with_energy
  rng = np.random.default_rng(1)
  V = jnp.asarray(np.linalg.qr(rng.normal(size=(96, 24)))[0], dtype)
  f32 = lambda a: np.asarray(a, np.float32)
  tol = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}[dtype]
  for shape in ((1, 1, 96), (3, 5, 96)):
    x = jnp.asarray(rng.normal(size=shape), dtype)
    want = f32(x) @ f32(V)
    g = project_rows(x, V.T)
    assert g.dtype == jnp.float32 and g.shape == shape[:-1] + (24,)
    np.testing.assert_allclose(f32(g), want, rtol=0, atol=tol * np.abs(want).max())
    gx = project_rows(x, V.T, with_energy=True)  # g, then ‖x‖² as a last column
    assert gx.dtype == jnp.float32 and gx.shape == shape[:-1] + (25,)
    np.testing.assert_allclose(f32(gx[..., :-1]), want, rtol=0, atol=tol * np.abs(want).max())
    np.testing.assert_allclose(f32(gx[..., -1]), np.sum(f32(x) ** 2, -1), rtol=1e-5)
    rho2 = np.sort((1 - np.sum(f32(g) ** 2, -1) / np.sum(f32(x) ** 2, -1)).ravel())
    # ε² halfway between two tokens' ρ² (above the one token's): no token sits on the edge
    eps = float(np.sqrt(2 * rho2[0] if rho2.size == 1 else rho2[rho2.size // 2 - 1:][:2].mean()))
    for fused in (True, False):
      np.testing.assert_array_equal(np.asarray(energy_gate(gx, eps, fused=fused)),
                                    np.asarray(gate_mask(x, g, eps)))
  # Where the program is lowered for cpu, V itself is read, and V_T changes nothing.
  x = jnp.asarray(rng.normal(size=(1, 1, 96)), dtype)
  with_t = GatedWeights([jnp.ones((96, 4), dtype)], V, [V.T @ jnp.ones((96, 4), dtype)],
                        V_T=V.T)
  np.testing.assert_array_equal(f32(project(x, with_t)), f32(x @ V))
  gx = project_with_energy(x, with_t)
  np.testing.assert_array_equal(f32(gx[..., :-1]), f32(x @ V))
  np.testing.assert_array_equal(f32(gx[..., -1]), f32(energy(x)))


@pytest.mark.parametrize("rows", [1, 2, 5, 16, 64, 100, 255, 256, 1024])
def test_a_fused_sum_is_the_sum(rows):
  """`fused_sum` (adds of halves, which XLA's GPU compiler fuses into the consumer) is the
  sum over the leading axis, at every length, odd ones included."""
  from gsi_jax.ops.fused_sum import fused_sum
  a = np.random.default_rng(rows).normal(size=(rows, 3, 7)).astype(np.float32)
  np.testing.assert_allclose(np.asarray(fused_sum(jnp.asarray(a))), a.sum(0), rtol=1e-5,
                             atol=1e-5)


def test_a_decode_lays_out_every_basis_transposed(tiny):
  """`with_transposed_bases` adds V_T = V_kᵀ beside every V_k, the GSI head's too, and
  nothing where there is no basis; the tree it was given is left as it was."""
  model, bases, _ = tiny("gpt2")
  params = gsi_jax.apply_gsi(model.params, bases, 8)
  d = P.head_shape(params)[0]
  params = gsi_jax.apply_gsi_head(
      params, np.linalg.qr(np.random.default_rng(2).normal(size=(d, 4)))[0], 4)
  laid = P.with_transposed_bases(params)
  nodes = [(layer, site) for layer, sites in P.site_kernels(params).items() for site in sites]
  for layer, site in nodes:
    assert P.V_T not in params[layer][site]
    np.testing.assert_array_equal(laid[layer][site][P.V_T], params[layer][site][P.V].T)
  assert P.V_T not in P.head(params)
  np.testing.assert_array_equal(laid[P.LM_HEAD][P.V_T], params[P.LM_HEAD][P.V].T)
  dense = P.with_transposed_bases(model.params)
  assert jax.tree.structure(dense) == jax.tree.structure(model.params)
  assert all(a is b for a, b in zip(jax.tree.leaves(dense), jax.tree.leaves(model.params)))


@pytest.mark.parametrize("name", FAMILIES)
def test_full_rank_is_dense(tiny, name):
  model, bases, widest = tiny(name)
  params = gsi_jax.apply_gsi(model.params, bases, widest)
  gate = make_gate(0.5)
  _, state = model.forward(params, EVAL, gate)
  fast = [v["fast"][0] for s in state["gate_stats"].values() for v in s.values()]
  assert all(bool(f.all()) for f in fast)  # every token takes the fast path...
  np.testing.assert_allclose(logits(model, params, gate), logits(model, model.params), atol=1e-4)


@pytest.mark.parametrize("name", FAMILIES)
def test_eps_inf_is_static_projection(tiny, name):
  """Written independently: dense model with every kernel replaced by V V^T W."""
  model, bases, _ = tiny(name)
  k = 6
  projected = jax.tree.map(lambda x: x, model.params)
  for layer, sites in site_kernels(model.params).items():
    for site, kernels in sites.items():
      V = jnp.asarray(bases.vectors[layer][site][:, :k])
      projected[layer][site]["kernel"] = {n: V @ (V.T @ W) for n, W in kernels.items()}
  want = logits(model, projected)
  params = gsi_jax.apply_gsi(model.params, bases, k)
  np.testing.assert_allclose(logits(model, params, make_gate(math.inf)), want, atol=1e-4)
  np.testing.assert_allclose(logits(model, params, make_gate(0.3, "static")), want, atol=1e-4)
  assert np.abs(want - logits(model, model.params)).max() > 1e-3  # the projection does bite


@pytest.mark.parametrize("name", ["gptj", "llama_gqa"])
def test_batch1_skip_equals_masked_select(tiny, name):
  model, bases, _ = tiny(name)
  params = gsi_jax.apply_gsi(model.params, bases, 10)
  prompt = EVAL[:1, :5]
  for eps in (0.3, 0.6, 0.9):  # mixed gate patterns
    masked, share = model.generate(params, prompt, 12, make_gate(eps), return_stats=True,
                                   stop_at_eos=False)
    skipped = model.generate(params, prompt, 12, make_gate(eps, batch1_switch=True),
                             stop_at_eos=False)
    np.testing.assert_array_equal(np.asarray(masked), np.asarray(skipped))
    a = logits(model, params, make_gate(eps), np.asarray(masked)[:, :-1])
    b = logits(model, params, make_gate(eps, batch1_switch=True), np.asarray(masked)[:, :-1])
    np.testing.assert_array_equal(a, b)


def test_gram_matrices_are_site_input_products(tiny):
  model, _, _ = tiny("llama_gqa")
  grams = calibration.gram_matrices(model, model.params, CALIB[:3], batch_size=2, progress=False)
  x = np.asarray(model.site_inputs(model.params, CALIB[:3])["layer_1"]["mlp_out"],
                 np.float64).reshape(-1, 64)
  np.testing.assert_allclose(grams["layer_1"]["mlp_out"], x.T @ x, rtol=1e-4, atol=1e-4)


def test_calibration_recovers_known_subspace():
  rng = np.random.default_rng(1)
  d, r = 64, 5
  U, _ = np.linalg.qr(rng.normal(size=(d, r)))
  X = rng.normal(size=(500, r)) * np.array([9, 7, 5, 3, 2]) @ U.T + 1e-3 * rng.normal(size=(500, d))
  G = X.T @ X
  _, V = solvers.top_eigenpairs(G, r)
  assert principal_cosines(U, V).min() > 0.9999
  # The cascade, started from a perturbed neighbour subspace, finds it too.
  V0, _ = np.linalg.qr(U + 0.3 * rng.normal(size=(d, r)))
  _, Vc, _ = cascade.refine(G, V0, max_sweeps=3)
  assert principal_cosines(U, Vc).min() > 0.9999
  np.testing.assert_allclose(Vc.T @ Vc, np.eye(r), atol=1e-10)


def test_cascade_at_full_width_is_the_exact_eigenbasis():
  """k = d (a site narrower than k_max): refining a full basis must not add noise vectors."""
  rng = np.random.default_rng(2)
  X = rng.normal(size=(200, 16)) * np.linspace(4, 0.1, 16)
  G = X.T @ X
  V0, _ = np.linalg.qr(rng.normal(size=(16, 16)))
  w, V, _ = cascade.refine(G, V0)
  np.testing.assert_allclose(V.T @ V, np.eye(16), atol=1e-10)
  np.testing.assert_allclose(w, np.sort(np.linalg.eigvalsh(G))[::-1], rtol=1e-10)


def test_cascade_matches_eigh_on_default_model():
  model = gsi_jax.load_model("smollm2-135m")
  from gsi_jax import text
  ids = text.windows(model, text.PYDOC_CALIB, 128, 1024).ids
  # First four layers only: truncate the model for speed.
  import dataclasses
  cfg = dataclasses.replace(model.config, n_layers=4)
  small = dataclasses.replace(model, config=cfg, params={
      k: v for k, v in model.params.items() if not k.startswith("layer_") or int(k[6:]) < 4})
  eigh = gsi_jax.calibrate(small, small.params, ids, 64, method="eigh", progress=False)
  casc = gsi_jax.calibrate(small, small.params, ids, 64, method="cascade", progress=False)
  e1, e2 = eigh.captured_energy(64), casc.captured_energy(64)
  for layer, site in eigh.sites():
    # eigh is optimal; LOBPCG's float32 eigenvalues may round above it by ~1e-7
    assert -1e-6 <= e1[layer][site] - e2[layer][site] < 2e-3, (layer, site)
    top = principal_cosines(eigh.vectors[layer][site][:, :16], casc.vectors[layer][site])
    assert top.min() > 0.99, (layer, site)


def test_checkpoint_roundtrip_is_bit_identical(tiny, tmp_path):
  model, bases, _ = tiny("gpt2")
  gsi_jax.save_bases(str(tmp_path / "b"), bases)
  back = gsi_jax.load_bases(str(tmp_path / "b"), fingerprint=bases.meta["fingerprint"])
  assert {k: v for k, v in back.meta.items()
          if k not in ("checksums", "meta_sha256")} == bases.meta
  for layer, site in bases.sites():
    for field in ("vectors", "eigenvalues", "trace"):
      a, b = getattr(bases, field)[layer][site], getattr(back, field)[layer][site]
      assert a.dtype == b.dtype and np.array_equal(a, b)


def _tree(folder):
  """Every file under `folder` with its bytes."""
  return {str(f.relative_to(folder)): f.read_bytes() for f in sorted(folder.rglob("*"))
          if f.is_file()}


def test_saves_delete_nothing_of_the_users_and_keep_one_copy(tiny, tmp_path):
  """A folder holding the user's own numbered folders and files: every save leaves them as
  they were (Orbax would take bare numbers for its steps and prune them); the saves keep
  one current copy, or as many as `keep` says."""
  model, bases, _ = tiny("gpt2")
  path = tmp_path / "mine"
  for name in ("1", "2", "3", "10"):
    (path / name).mkdir(parents=True)
    (path / name / "notes.txt").write_text(f"the user's run {name}")
  (path / "README").write_text("the user's")
  theirs = _tree(path)
  for step in (1, 2, 3):
    assert gsi_jax.save_bases(str(path), bases) == step
  assert {k: v for k, v in _tree(path).items() if k in theirs} == theirs
  ours = sorted(p.name for p in path.iterdir() if p.name.startswith("gsi_bases"))
  assert ours == ["gsi_bases_3"]
  assert gsi_jax.save_bases(str(path), bases, keep=2) == 4
  assert gsi_jax.save_bases(str(path), bases, keep=None) == 5
  assert sorted(p.name for p in path.iterdir() if p.name.startswith("gsi_bases")) == [
      "gsi_bases_3", "gsi_bases_4", "gsi_bases_5"]
  assert _tree(path).keys() >= theirs.keys()
  back = gsi_jax.load_bases(str(path))
  np.testing.assert_array_equal(back.vectors["layer_0"]["attn_in"],
                                bases.vectors["layer_0"]["attn_in"])


@pytest.mark.parametrize("keep", [0, -1, 1.5, True, "2"])
def test_save_bases_checks_keep(tiny, tmp_path, keep):
  _, bases, _ = tiny("gpt2")
  with pytest.raises(GSIError, match=r"keep must be (a whole number|>= 1)"):
    gsi_jax.save_bases(str(tmp_path / "b"), bases, keep=keep)
  assert not (tmp_path / "b").exists()


def test_bases_saved_without_a_step_prefix_still_load(tiny, tmp_path):
  """Earlier versions named their steps 1, 2, ...: those still load, and a folder whose
  numbered folders are not saves of bases is said to hold none."""
  from gsi_jax.gsi import checkpoint
  _, bases, _ = tiny("gpt2")
  arrays = bases.arrays()
  meta = checkpoint.sealed({**bases.meta, "format_version": gsi_jax.gsi.bases.FORMAT_VERSION},
                           arrays)
  with checkpoint._manager(str(tmp_path / "old"), create=True) as manager:
    checkpoint._save(manager, 1, arrays, meta)
  assert (tmp_path / "old" / "1" / "meta").is_dir()
  assert gsi_jax.load_bases(str(tmp_path / "old")).k_max == bases.k_max
  (tmp_path / "numbers" / "7").mkdir(parents=True)
  with pytest.raises(GSIError, match="holds no complete bases checkpoint"):
    gsi_jax.load_bases(str(tmp_path / "numbers"))


def test_failed_save_keeps_earlier_checkpoint(tiny, tmp_path, monkeypatch):
  model, bases, _ = tiny("gpt2")
  path = str(tmp_path / "b")
  gsi_jax.save_bases(path, bases)
  import orbax.checkpoint as ocp
  def explode(*args, **kwargs):
    raise KeyboardInterrupt("interrupted mid-save")
  monkeypatch.setattr(ocp.args, "JsonSave", explode)
  with pytest.raises(KeyboardInterrupt):
    gsi_jax.save_bases(path, bases)
  monkeypatch.undo()
  # A crashed writer's leftovers.
  os.makedirs(os.path.join(path, "gsi_bases_2.orbax-checkpoint-tmp-1234"))
  back = gsi_jax.load_bases(path)
  np.testing.assert_array_equal(back.vectors["layer_0"]["attn_in"],
                                bases.vectors["layer_0"]["attn_in"])


def test_damaged_and_missing_checkpoints(tiny, tmp_path):
  model, bases, _ = tiny("gpt2")
  with pytest.raises(GSIError, match="no bases checkpoint"):
    gsi_jax.load_bases(str(tmp_path / "absent"))
  path = tmp_path / "b"
  gsi_jax.save_bases(str(path), bases)
  for f in (path / "gsi_bases_1" / "arrays").rglob("*"):
    if f.is_file() and "METADATA" not in f.name:
      f.write_bytes(b"garbage")
  with pytest.raises(GSIError, match="damaged"):
    gsi_jax.load_bases(str(path))


def test_bases_of_another_model_are_rejected(tiny, tmp_path):
  model, _, _ = tiny("gpt2")
  _, other, _ = tiny("opt")
  with pytest.raises(GSIError, match="another model"):
    gsi_jax.apply_gsi(model.params, other, 4)
  gsi_jax.save_bases(str(tmp_path / "b"), other)
  with pytest.raises(GSIError, match="not of this model"):
    gsi_jax.load_bases(str(tmp_path / "b"), fingerprint=gsi_jax.gsi.fingerprint(model.params))


@pytest.mark.parametrize("k", [0, -3, 10_000])
def test_bad_k(tiny, k):
  model, bases, _ = tiny("llama_gqa")
  with pytest.raises(GSIError, match="k must be in"):
    gsi_jax.apply_gsi(model.params, bases, k)


@pytest.mark.parametrize("eps", [-0.1, float("nan")])
def test_bad_eps(eps):
  with pytest.raises(GSIError, match="eps must be"):
    make_gate(eps)


def test_bad_text(tiny, tmp_path):
  model, _, _ = tiny("llama_gqa")
  with pytest.raises(GSIError, match="empty"):
    gsi_jax.calibrate(model, model.params, np.zeros((0,), np.int32), 4, seq_len=16)
  with pytest.raises(GSIError, match="fewer than one window"):
    gsi_jax.calibrate(model, model.params, CALIB[0, :10], 4, seq_len=16)
  from gsi_jax import text
  empty = tmp_path / "empty.txt"
  empty.write_text("  \n")
  with pytest.raises(GSIError, match="empty"):
    text.load_text(str(empty))


def test_theorem4_tightness(tiny):
  model, bases, _ = tiny("opt")
  params = gsi_jax.apply_gsi(model.params, bases, 12)
  check = metrics.theorem4_tightness(model, params, CALIB[:4], eps=0.6)
  assert check["fast_map_tokens"] > 0 and check["violations"] == 0
  assert 0 < check["median_error_over_bound"] <= check["max_error_over_bound"] <= 1.0
  assert 0 < check["median_error_over_norm_r"] <= check["max_error_over_norm_r"] <= 1.0


def test_byte_accounting(tiny):
  """Exact counts: a site reads V_k always, then M (fast) or W (slow)."""
  model, bases, widest = tiny("llama_gqa")
  dense = metrics.byte_accounting(model.params)
  assert dense["speedup_bytes"] == 1.0 and dense["speedup_paper"] == 1.0
  k = 8
  params = gsi_jax.apply_gsi(model.params, bases, k)
  sites = site_kernels(params)
  shapes = [(next(iter(ks.values())).shape[0], sum(W.shape[1] for W in ks.values()))
            for s in sites.values() for ks in s.values()]
  itemsize = 4
  all_fast = {layer: {site: 1.0 for site in s} for layer, s in sites.items()}
  fast = metrics.byte_accounting(params, all_fast)
  never = metrics.byte_accounting(params)
  assert never["bytes_per_token"] - dense["bytes_per_token_dense"] == pytest.approx(
      itemsize * sum(d * min(k, d) for d, _ in shapes))
  assert never["bytes_per_token"] - fast["bytes_per_token"] == pytest.approx(
      itemsize * sum((d - min(k, d)) * o for d, o in shapes))
  assert fast["speedup_paper"] > fast["speedup_linear_bytes"] > 1.0  # V_k costs bytes
  assert never["storage_overhead"] == pytest.approx(
      sum(min(k, d) * (d + o) for d, o in shapes) / never["params_total"])


def test_rank_ladder_matches_reference():
  """Each token takes the smallest rung passing the gate; its output is x V_j V_j^T W."""
  rng = np.random.default_rng(3)
  d, o, k, rungs, eps = 32, 24, 16, (4, 8, 16), 0.3
  Q, _ = np.linalg.qr(rng.normal(size=(d, d)))
  V = Q[:, :k]
  # Token t keeps its energy in Q's first `span` columns (0.02 elsewhere), so
  # rungs 4, 8, 16 and the slow path (span 32) are all taken.
  spans = np.resize([4, 8, 16, 32], 40)
  c = rng.normal(size=(40, d)) * np.where(np.arange(d) < spans[:, None], 1.0, 0.02)
  x, W = c @ Q.T, rng.normal(size=(d, o))
  f32 = lambda a: jnp.asarray(a, jnp.float32)
  (y,), fast, rank = gated_linear(
      f32(x[None]), GatedWeights([f32(W)], f32(V), [f32(V.T @ W)],
                                 rungs=jnp.asarray(rungs, jnp.int32)), f32(eps), make_gate(eps))
  want_y, want_rank, want_fast = [], [], []
  for t in x:
    rho = [np.linalg.norm(t - V[:, :r] @ (V[:, :r].T @ t)) / np.linalg.norm(t) for r in rungs]
    r = next((r for r, p in zip(rungs, rho) if p < eps), None)
    want_fast.append(r is not None)
    want_rank.append(r or k)
    want_y.append(t @ W if r is None else (t @ V[:, :r]) @ (V[:, :r].T @ W))
  assert set(want_rank) == set(rungs) and not all(want_fast)
  np.testing.assert_array_equal(np.asarray(rank[0]), want_rank)
  np.testing.assert_array_equal(np.asarray(fast[0]), want_fast)
  np.testing.assert_allclose(np.asarray(y[0]), np.array(want_y), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["gpt2", "llama_gqa"])
def test_rank_ladder_in_the_model(tiny, name):
  model, bases, _ = tiny(name)
  k = 12
  plain = gsi_jax.apply_gsi(model.params, bases, k)
  ladder = gsi_jax.apply_gsi(model.params, bases, k, ladder=(4, 8))
  np.testing.assert_allclose(logits(model, ladder, make_gate(0.0)), logits(model, model.params),
                             atol=1e-6, rtol=0)
  gate = make_gate(0.6)
  a, b = metrics.score(model, plain, EVAL, gate), metrics.score(model, ladder, EVAL, gate)
  # Nested bases: a token passes some rung iff it passes the top one (the first
  # site's inputs are the same in both models; later ones differ).
  first = lambda sc: sc["fast_share_by_layer"]["layer_0"]["attn_in"]
  assert 0 < first(a) < 1 and first(a) == pytest.approx(first(b), abs=1e-6)
  rows = [v for s in b["rows_by_layer"].values() for v in s.values()]
  assert any(m < v for v, m in rows) and all(m <= v <= k for v, m in rows)
  bytes_plain = metrics.byte_accounting(plain, a["fast_share_by_layer"], a["rows_by_layer"])
  bytes_ladder = metrics.byte_accounting(ladder, b["fast_share_by_layer"], b["rows_by_layer"])
  assert bytes_ladder["bytes_per_token"] < bytes_plain["bytes_per_token"]
  for bad in [(0, 4), (8, 4), (4, 12), (4, 4)]:
    with pytest.raises(GSIError, match="ladder ranks"):
      gsi_jax.apply_gsi(model.params, bases, k, ladder=bad)


@pytest.mark.parametrize("name", ["gptj", "llama_gqa"])  # untied with bias; tied
def test_gsi_head_invariants(tiny, name):
  model, _, _ = tiny(name)
  V, energies, trace = gsi_jax.head_basis(model, model.params, CALIB, 16)
  assert np.all(np.diff(energies) <= 0) and energies.sum() <= trace * (1 + 1e-6)
  dense = logits(model, model.params)
  head = gsi_jax.apply_gsi_head(model.params, V, 6)
  np.testing.assert_allclose(logits(model, head, make_gate(0.0)), dense, atol=1e-6, rtol=0)
  # eps = inf: logits are h V V^T W (+ b), written independently from the head's input.
  _, state = model.forward(model.params, EVAL, collections=("head_inputs",))
  h = np.asarray(state["head_inputs"]["lm_head"]["x"][0], np.float64)
  W = np.asarray(P.head_kernel(model.params), np.float64)
  bias = np.asarray(model.params.get("lm_head", {}).get("bias", 0.0))
  want = (h @ V[:, :6]) @ (V[:, :6].T @ W) + bias
  np.testing.assert_allclose(logits(model, head, make_gate(0.0, head_eps=math.inf)), want,
                             atol=1e-4)
  assert np.abs(want - dense).max() > 1e-3
  # M's columns are padded with zeros to a multiple of 64 (vector loads on a GPU).
  d, vocab = W.shape
  M = np.asarray(head["lm_head"][P.M][P.HEAD_MAP])
  assert M.shape == (6, P.head_m_columns(vocab)) and P.head_m_columns(vocab) % 64 == 0
  assert not M[:, vocab:].any()
  # The head's own share is counted: all fast reads d k + k V' (V' = the padded columns of
  # M, every one read) instead of d V.
  scores = metrics.score(model, head, EVAL, make_gate(0.0, head_eps=math.inf))
  assert scores["head_fast_share"] == 1.0 and scores["head_v_columns"] == 6
  b = metrics.byte_accounting(head, head_fast_share=1.0)
  assert b["bytes_per_token_dense"] - b["bytes_per_token"] == pytest.approx(
      4 * (d * vocab - d * 6 - 6 * P.head_m_columns(vocab)))
  # At head ε = 0 it cannot fire, and the xla path reads W alone: dense's bytes.
  scores = metrics.score(model, head, EVAL, make_gate(0.0, impl="xla"))
  assert scores["head_fast_share"] == 0 and scores["head_v_columns"] == 0
  b = metrics.byte_accounting(head, head_fast_share=0.0, head_v_columns=0.0)
  assert b["bytes_per_token"] == pytest.approx(b["bytes_per_token_dense"])
  assert jax.tree.structure(gsi_jax.dense_params(head)) == jax.tree.structure(model.params)
  with pytest.raises(GSIError, match="head k must be"):
    gsi_jax.apply_gsi_head(model.params, V, 17)


def test_output_aware_gate_matches_exact_output_error(tiny):
  """With as many sketch columns as outputs, the gate is exactly ||W r|| < eps ||W x||."""
  model, bases, _ = tiny("llama_gqa")
  k, eps = 8, 0.5
  params = gsi_jax.apply_gsi(model.params, bases, k, output_sketch=10_000)
  _, state = model.forward(params, EVAL, make_gate(eps),
                           collections=("site_inputs", "gate_stats"))
  for layer, sites in site_kernels(params).items():
    for site, kernels in sites.items():
      x = np.asarray(state["site_inputs"][layer][site]["x"][0], np.float64)
      W = np.concatenate([np.asarray(kernels[n], np.float64) for n in sorted(kernels)], 1)
      V = np.asarray(params[layer][site][P.V], np.float64)
      r = x - (x @ V) @ V.T
      want = np.linalg.norm(r @ W, axis=-1) < eps * np.linalg.norm(x @ W, axis=-1)
      got = np.asarray(state["gate_stats"][layer][site]["fast"][0])
      assert (got == want).mean() > 0.99, (layer, site)  # float32 ties at the boundary
  assert 0 < np.mean([np.asarray(v["fast"][0]).mean() for s in state["gate_stats"].values()
                      for v in s.values()]) < 1
  small = gsi_jax.apply_gsi(model.params, bases, k, output_sketch=4)
  b = metrics.byte_accounting(small)
  assert b["bytes_per_token"] > metrics.byte_accounting(
      gsi_jax.apply_gsi(model.params, bases, k))["bytes_per_token"]


@pytest.mark.parametrize("where", ["vectors", "eigenvalues"])
def test_flipped_bytes_in_a_checkpoint_are_never_restored(tiny, tmp_path, where):
  """A few flipped bytes in the stored arrays: restore refuses (checksums), and the cache
  recalibrates rather than hand the damaged values on."""
  model, bases, _ = tiny("gpt2")
  path = tmp_path / "b"
  gsi_jax.save_bases(str(path), bases)
  files = sorted(f for f in (path / "gsi_bases_1" / "arrays").rglob("*")
                 if f.is_file() and f.stat().st_size > 200 and "METADATA" not in f.name.upper()
                 and "manifest" not in f.name)
  assert files
  for f in files:  # flip bytes in the middle of every data file
    data = bytearray(f.read_bytes())
    for i in range(len(data) // 2, len(data) // 2 + 4):
      data[i] ^= 0xFF
    f.write_bytes(bytes(data))
  with pytest.raises(GSIError, match="damaged|checksums"):
    gsi_jax.load_bases(str(path))


def test_bad_values_are_refused_at_save_and_at_restore(tiny, tmp_path):
  """save_bases refuses non-finite or non-orthonormal bases; values that a bad writer
  stored with matching checksums still fail at restore."""
  from gsi_jax.gsi import checkpoint
  model, bases, _ = tiny("gpt2")
  import copy
  bad = copy.deepcopy(bases)
  layer, site = bad.sites()[0]

  def write_bypassing_checks(path):
    arrays = bad.arrays()
    meta = checkpoint.sealed({**bad.meta, "format_version": gsi_jax.gsi.bases.FORMAT_VERSION},
                             arrays)
    with checkpoint._manager(path, create=True) as manager:
      checkpoint._save(manager, 1, arrays, meta)

  bad.vectors[layer][site] = bad.vectors[layer][site] * 2  # not orthonormal
  with pytest.raises(GSIError, match="refusing to save .* not orthonormal"):
    gsi_jax.save_bases(str(tmp_path / "refused"), bad)
  assert not (tmp_path / "refused").exists()
  write_bypassing_checks(str(tmp_path / "a"))
  with pytest.raises(GSIError, match="not orthonormal"):
    gsi_jax.load_bases(str(tmp_path / "a"))
  bad.vectors[layer][site][0, 0] = np.nan
  with pytest.raises(GSIError, match="refusing to save .* non-finite"):
    gsi_jax.save_bases(str(tmp_path / "refused"), bad)
  write_bypassing_checks(str(tmp_path / "b"))
  with pytest.raises(GSIError, match="non-finite"):
    gsi_jax.load_bases(str(tmp_path / "b"))
  with pytest.raises(GSIError, match="is a file"):
    checkpoint.check_writable(str(tmp_path / "b" / "1" / "arrays" / "_METADATA" / "x"))


def test_any_storage_failure_is_one_line_naming_the_path(tiny, tmp_path, monkeypatch):
  """A full disk reaches Orbax's save from tensorstore as a ValueError, not an OSError: the
  bases save and the calibration's progress both turn it (any exception) into one
  GSIError naming the path and the cause; the earlier step stays restorable."""
  from gsi_jax.gsi import checkpoint
  model, bases, _ = tiny("llama_gqa")
  path = str(tmp_path / "bases")
  checkpoint.save_bases(path, bases)
  full = ValueError("RESOURCE_EXHAUSTED: Error writing local file: No space left on device\n"
                    "  [source locations='tensorstore/...']")

  def no_space(*args, **kwargs):
    raise full
  monkeypatch.setattr(checkpoint, "_save", no_space)
  with pytest.raises(GSIError) as raised:
    checkpoint.save_bases(path, bases)
  assert str(raised.value) == (
      f"cannot save bases to {path} (ValueError: RESOURCE_EXHAUSTED: Error writing local "
      "file: No space left on device); earlier steps there are untouched")
  progress = checkpoint.LayerProgress(str(tmp_path / "progress"), {"model": "m"})
  name = P.layer_name(0)
  with pytest.raises(GSIError, match=r"cannot save calibration progress to .*progress "
                     r"\(ValueError: RESOURCE_EXHAUSTED"):
    progress.save(0, bases.vectors[name], bases.eigenvalues[name], bases.trace[name], {},
                  np.zeros((1, 2, 3), np.float32))
  monkeypatch.undo()
  assert checkpoint.load_bases(path).k_max == bases.k_max


@pytest.fixture
def small_disk(tmp_path):
  """A 160 KiB tmpfs (root only; skipped where mount is refused)."""
  folder = tmp_path / "small_disk"
  folder.mkdir()
  mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=160k", "tmpfs", str(folder)],
                           capture_output=True)
  if mounted.returncode:
    pytest.skip("mounting a small tmpfs needs root")
  yield folder
  subprocess.run(["umount", str(folder)], check=True)


def test_a_full_disk_during_calibration_is_one_line_and_resumes(tiny, small_disk, capfd):
  """Orbax's background write fails with tensorstore's RESOURCE_EXHAUSTED: one GSIError
  naming the folder, no traceback printed; the layers saved before stay and resume."""
  model, _, _ = tiny("gpt2")
  ids = np.tile(CALIB, (8, 1))
  capfd.readouterr()
  with pytest.raises(GSIError, match=r"^cannot save calibration progress to .*small_disk/p "
                                     r"\(ValueError: RESOURCE_EXHAUSTED"):
    gsi_jax.calibrate(model, model.params, ids, 16, seq_len=16, progress=False,
                      resume_dir=str(small_disk / "p"))
  assert "Traceback" not in capfd.readouterr().err
  done = sorted(os.listdir(small_disk / "p" / "layers"))
  subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True)
  bases = gsi_jax.calibrate(model, model.params, ids, 16, seq_len=16, progress=False,
                            resume_dir=str(small_disk / "p"))
  assert bases.k_max == 16 and done


@pytest.mark.parametrize("field, value", [("k_max", None), ("fingerprint", None),
                                          ("method", 3), ("k_max", "8")])
def test_metadata_of_another_version_is_one_error_naming_the_field(tiny, tmp_path, field,
                                                                   value):
  """Sealed as this version seals (its checksums pass), but a field missing or of another
  type: one GSIError naming it from load_bases, which the cache restores through."""
  from gsi_jax.gsi import checkpoint
  _, bases, _ = tiny("gpt2")
  arrays = bases.arrays()
  meta = {**bases.meta, "format_version": gsi_jax.gsi.bases.FORMAT_VERSION}
  meta = {k: v for k, v in meta.items() if k != field or value is not None}
  if value is not None:
    meta[field] = value
  with checkpoint._manager(str(tmp_path / "b"), True, 1, checkpoint.BASES_STEP_PREFIX) as m:
    checkpoint._save(m, 1, arrays, checkpoint.sealed(meta, arrays))
  with pytest.raises(GSIError, match=rf"the bases' metadata has no \w+ '{field}' \(another "
                                     r"version of gsi_jax wrote it"):
    gsi_jax.load_bases(str(tmp_path / "b"))
