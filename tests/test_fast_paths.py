"""Every pareto method's batch-1 fast decode path against its evaluation path, on a tiny model.

The fast paths read fewer bytes (the batch-1 switch, kept rows only, two thin
maps); the evaluation paths compute the same function by masking.  Both must
give the same greedy tokens.
"""

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec

import gsi_jax
from gsi_jax import make_gate, metrics, peers
from gsi_jax.runtime import sharding
from gsi_jax.gsi import calibration
from gsi_jax.metrics import bytes as mbytes
from gsi_jax.models import params as P
from gsi_jax.ops import cpu_kernels, kept_dots, kept_rows_matmul
from gsi_jax.ops.sparse_rows import bucket_sizes, kept_dots_xla, kept_rows_matmul_xla

RNG = np.random.default_rng(1)
CALIB = RNG.integers(0, 101, (8, 16)).astype(np.int32)
PROMPT = CALIB[:1, :5]
NEW = 10


@pytest.fixture(scope="module")
def llama(tiny_folder):
  model = gsi_jax.load_model(tiny_folder("llama_gqa")[0])
  grams = calibration.gram_matrices(model, model.params, CALIB, progress=False)
  return model, grams


def generate(model, params, gate=None):
  return np.asarray(model.generate(params, PROMPT, NEW, gate, stop_at_eos=False))


@pytest.mark.parametrize("impl", [kept_rows_matmul, kept_rows_matmul_xla])
@pytest.mark.parametrize("kept", [0, 1, 7, 8, 9, 31, 48])
def test_kept_rows_matmul_is_the_masked_product(kept, impl):
  d = 48
  x = jnp.asarray(RNG.standard_normal(d), jnp.float32)
  keep = jnp.zeros(d, bool).at[RNG.permutation(d)[:kept]].set(True)
  Ws = [jnp.asarray(RNG.standard_normal((d, o)), jnp.float32) for o in (5, 17, 1100)]
  for y, W in zip(jax.jit(impl)(x, keep, Ws), Ws):
    np.testing.assert_allclose(np.asarray(y), np.asarray(jnp.where(keep, x, 0) @ W),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", [kept_dots, kept_dots_xla])
@pytest.mark.parametrize("kept, o, d", [(0, 48, 37), (1, 48, 37), (7, 48, 37), (9, 48, 37),
                                        (48, 48, 37),  # d not a multiple of 8 partial sums
                                        (1400, 1536, 577)])  # split over the helper thread
def test_kept_dots_are_the_masked_product(kept, o, d, impl):
  x = jnp.asarray(RNG.standard_normal(d), jnp.float32)
  keep = jnp.zeros(o, bool).at[RNG.permutation(o)[:kept]].set(True)
  W = jnp.asarray(RNG.standard_normal((o, d)), jnp.float32)
  np.testing.assert_allclose(np.asarray(jax.jit(impl)(x, keep, W)),
                             np.asarray(jnp.where(keep, W @ x, 0)), atol=1e-5, rtol=1e-5)


def test_the_cpu_kernel_is_built_and_reads_in_place():
  """This machine (and CI) has a C++ compiler, so the kernel is what sparse decode runs."""
  assert cpu_kernels.available()
  d, o = 64, 1536
  x = jnp.asarray(RNG.standard_normal(d), jnp.float32)
  keep = jnp.asarray(RNG.random(d) < 0.4)
  W = jnp.asarray(RNG.standard_normal((d, o)), jnp.float32)
  program = jax.jit(lambda x, k, W: kept_rows_matmul(x, k, [W])[0]).lower(x, keep, W).as_text()
  assert cpu_kernels.TARGET in program and "gather" not in program
  np.testing.assert_allclose(np.asarray(cpu_kernels.kept_rows(x, keep, [W])[0]),
                             np.asarray(jnp.where(keep, x, 0) @ W), atol=1e-4, rtol=1e-5)
  keep_O = jnp.asarray(RNG.random(o) < 0.4)
  dots = jax.jit(lambda x, k, W: kept_dots(x, k, W)).lower(x, keep_O, W.T).as_text()
  assert cpu_kernels.DOTS_TARGET in dots and "gather" not in dots


@pytest.mark.parametrize("d, outs, kept", [(64, (96, 33, 7), 0.4),  # one thread
                                           (1024, (1536, 1000, 2047), 0.9)])  # two
def test_one_call_serves_every_map_of_a_site(d, outs, kept):
  """Every map of a site (q, k, v) in one kernel call, which finds the kept rows once and,
  for a product of over 2^18 kept weights, gives the upper half of the kept rows to its
  helper thread, which sums them into its own buffer (odd counts split unevenly); two
  such calls side by side (XLA runs independent ones together) contend for the helper,
  and the one that finds it busy works alone.  Every other round waits past the helper's
  millisecond of polling, so it has gone to sleep and the next call wakes it."""
  x = jnp.asarray(RNG.standard_normal(d), jnp.float32)
  keep = jnp.asarray(RNG.random(d) < kept)
  Ws = [jnp.asarray(RNG.standard_normal((d, o)), jnp.float32) for o in outs]
  program = jax.jit(lambda x, k, Ws: kept_rows_matmul(x, k, Ws)).lower(x, keep, Ws).as_text()
  assert program.count(cpu_kernels.TARGET) == 1
  two_sites = jax.jit(lambda x, k, Ws: (cpu_kernels.kept_rows(x, k, Ws),
                                        cpu_kernels.kept_rows(-x, k, Ws[::-1])))
  for i in range(20):
    if i % 2:
      time.sleep(0.005)
    first, second = two_sites(x, keep, Ws)
    for y, y_neg, W in zip(first, second[::-1], Ws):
      want = np.asarray(jnp.where(keep, x, 0) @ W)
      np.testing.assert_allclose(np.asarray(y), want, atol=1e-3, rtol=1e-4)
      np.testing.assert_allclose(np.asarray(y_neg), -want, atol=1e-3, rtol=1e-4)


def test_without_a_compiler_the_xla_path_is_taken(monkeypatch, tmp_path, caplog):
  monkeypatch.setattr(cpu_kernels, "_state", {})
  monkeypatch.setenv("GSI_JAX_CACHE", str(tmp_path))
  monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
  assert not cpu_kernels.available()
  assert "could not be built" in caplog.text
  x, keep = jnp.ones(8, jnp.float32), jnp.arange(8) % 2 == 0
  W = jnp.asarray(RNG.standard_normal((8, 3)), jnp.float32)
  program = jax.jit(lambda x, k, W: kept_rows_matmul(x, k, [W])[0]).lower(x, keep, W).as_text()
  assert cpu_kernels.TARGET not in program
  np.testing.assert_allclose(np.asarray(kept_rows_matmul(x, keep, [W])[0]),
                             np.asarray(jnp.where(keep, x, 0) @ W), atol=1e-5)


def test_bucket_sizes_cover_every_count():
  assert bucket_sizes(48) == (6, 12, 18, 24, 30, 36, 42, 48)
  assert bucket_sizes(5) == (1, 2, 3, 4, 5)


def test_sparsity_fast_path_decodes_the_same_tokens(llama):
  model, _ = llama
  for target in (0.3, 0.7):
    params = peers.apply_sparsity(
        model.params, peers.sparsity_thresholds(model, model.params, CALIB, target))
    np.testing.assert_array_equal(generate(model, params, make_gate(0.0, batch1_switch=True)),
                                  generate(model, params))


def test_larosa_rotation_keeps_outputs_and_fast_path_agrees(llama):
  model, grams = llama
  Q = peers.pca_bases(grams, ("attn_in", "mlp_in"))
  rotated = peers.apply_rotation(model.params, Q)
  np.testing.assert_allclose(np.asarray(model.logits(rotated, CALIB[:2])),
                             np.asarray(model.logits(model.params, CALIB[:2])), atol=1e-4)
  params = peers.apply_sparsity(rotated, peers.sparsity_thresholds(model, rotated, CALIB, 0.5))
  scores = metrics.score(model, params, CALIB)
  kept = scores["kept_share_by_layer"]["layer_0"]
  assert abs(kept["mlp_in"] - 0.5) < 0.05  # thresholds calibrated on x Q
  np.testing.assert_array_equal(generate(model, params, make_gate(0.0, batch1_switch=True)),
                                generate(model, params))
  plain = mbytes.sparsity_bytes(params, scores["kept_share_by_layer"], None)
  d = params["layer_0"]["mlp_in"][P.ROTATION].shape[0]
  no_rotation = {layer: {site: {k: v for k, v in node.items() if k != P.ROTATION}
                         if isinstance(node, dict) else node for site, node in sites.items()}
                 if P.is_layer(layer) else sites for layer, sites in params.items()}
  n_rotated = 2 * len(P.layers(params))
  assert plain - mbytes.sparsity_bytes(no_rotation, scores["kept_share_by_layer"], None) \
      == pytest.approx(n_rotated * d * d * 4)  # each rotated site reads its Q (float32)


def test_svd_runs_as_two_thin_maps_where_that_is_cheaper(llama):
  model, grams = llama
  svds = peers.whitened_svds(model.params, grams)
  low = peers.svd_truncate(model.params, svds, 4)
  node = low["layer_0"]["mlp_in"]
  assert node[P.FACTOR_IN]["up"].shape[1] == 4 and node[P.FACTOR_OUT]["up"].shape[0] == 4
  # The reconstructed kernel computes what the two thin maps compute.
  rebuilt = jax_tree_rebuild(low)
  np.testing.assert_allclose(np.asarray(model.logits(low, CALIB[:2])),
                             np.asarray(model.logits(rebuilt, CALIB[:2])), atol=1e-4)
  np.testing.assert_array_equal(generate(model, low), generate(model, rebuilt))
  # A rank that would not save bytes is kept as one (rank-r) kernel.
  high = peers.svd_truncate(model.params, svds, 40)
  assert P.FACTOR_IN not in high["layer_0"]["attn_out"]


def jax_tree_rebuild(params):
  """The same tree with every factored map rebuilt as one kernel A B."""
  out = dict(params)
  for layer, sites in P.site_kernels(params).items():
    out[layer] = dict(out[layer])
    for site in sites:
      node = dict(out[layer][site])
      factor_in, factor_out = node.pop(P.FACTOR_IN, {}), node.pop(P.FACTOR_OUT, {})
      node[P.KERNEL] = {n: factor_in[n] @ factor_out[n] if n in factor_in else W
                        for n, W in node[P.KERNEL].items()}
      out[layer][site] = node
  return out


def test_gsi_and_head_switch_decode_the_same_tokens(llama):
  model, _ = llama
  bases = gsi_jax.calibrate(model, model.params, CALIB, k_max=24, seq_len=16, progress=False)
  params = gsi_jax.apply_gsi(model.params, bases, 24)
  for eps in (0.3, 0.6):
    np.testing.assert_array_equal(generate(model, params, make_gate(eps, batch1_switch=True)),
                                  generate(model, params, make_gate(eps)))
  V_head, _, _ = gsi_jax.head_basis(model, model.params, CALIB, 24)
  head = gsi_jax.apply_gsi_head(model.params, V_head, 24)
  gate = dict(head_eps=0.6)
  np.testing.assert_array_equal(
      generate(model, head, make_gate(0.0, batch1_switch=True, **gate)),
      generate(model, head, make_gate(0.0, **gate)))


@pytest.fixture(scope="module")
def llama_gsi(llama):
  model, _ = llama
  bases = gsi_jax.calibrate(model, model.params, CALIB, k_max=24, seq_len=16, progress=False)
  return model, gsi_jax.apply_gsi(model.params, bases, 12)



def test_residual_sparsity_spans_dense_and_static_gsi(llama_gsi):
  """All residual kept is dense; none kept is static GSI (y = g M)."""
  model, params = llama_gsi
  dense = model.logits(model.params, CALIB[:2])
  everything = gsi_jax.apply_residual_sparsity(params, P.per_site(params, 0.0))
  np.testing.assert_allclose(np.asarray(model.logits(everything, CALIB[:2])), np.asarray(dense),
                             atol=1e-4, rtol=1e-4)
  nothing = gsi_jax.apply_residual_sparsity(params, P.per_site(params, np.inf))
  static = model.logits(params, CALIB[:2], make_gate(0.0, "static"))
  np.testing.assert_allclose(np.asarray(model.logits(nothing, CALIB[:2])), np.asarray(static),
                             atol=1e-5, rtol=1e-5)
  with pytest.raises(gsi_jax.GSIError, match="has no V_k"):
    gsi_jax.apply_residual_sparsity(model.params, P.per_site(params, 0.0))


def test_residual_sparsity_fast_path_and_bytes(llama_gsi):
  model, params = llama_gsi
  for target in (0.3, 0.8):
    t = peers.sparsity_thresholds(model, params, CALIB, target)
    sparse = gsi_jax.apply_residual_sparsity(params, t)
    np.testing.assert_array_equal(generate(model, sparse, make_gate(0.0, batch1_switch=True)),
                                  generate(model, sparse))
    scores = metrics.score(model, sparse, CALIB)
    kept = scores["kept_share_by_layer"]
    assert abs(kept["layer_0"]["mlp_in"] - (1 - target)) < 0.05  # thresholds set on r
    expected = sum(d * 12 + 12 * o + kept[layer][site] * d * o
                   for layer, site, d, o in P.site_shapes(sparse))
    outside = mbytes.other_elements(sparse) + mbytes.head_elements(sparse)
    assert mbytes.sparsity_bytes(sparse, kept, None) == pytest.approx((expected + outside) * 4)


def test_rsparse_spans_dense_and_low_rank_and_fast_path_agrees(llama):
  model, _ = llama
  dense = np.asarray(model.logits(model.params, CALIB[:2]))
  full = peers.weight_factors(model.params, 10 ** 6)  # every singular value: A B = W
  everything = peers.apply_sparsity(full, P.per_site(full, np.inf))  # all inputs through A B
  np.testing.assert_allclose(np.asarray(model.logits(everything, CALIB[:2])), dense, atol=1e-4)
  low = peers.weight_factors(model.params, 4)
  kept_all = peers.apply_sparsity(low, P.per_site(low, 0.0))  # all inputs exact
  np.testing.assert_allclose(np.asarray(model.logits(kept_all, CALIB[:2])), dense, atol=1e-5)
  params = peers.apply_sparsity(low, peers.sparsity_thresholds(model, low, CALIB, 0.6))
  np.testing.assert_array_equal(generate(model, params, make_gate(0.0, batch1_switch=True)),
                                generate(model, params))
  scores = metrics.score(model, params, CALIB)
  kept = scores["kept_share_by_layer"]
  expected = sum(kept[layer][site] * d * o + sum(4 * (d + W.shape[1]) for W in
                                                 params[layer][site][P.KERNEL].values())
                 for layer, site, d, o in P.site_shapes(params))
  outside = mbytes.other_elements(params) + mbytes.head_elements(params)
  assert mbytes.sparsity_bytes(params, kept, None) == pytest.approx((expected + outside) * 4)
  with pytest.raises(gsi_jax.GSIError, match="rank must be positive"):
    peers.weight_factors(model.params, 0)



def test_cats_spans_dense_and_its_fast_path_and_bytes_agree(llama):
  """Threshold 0 keeps every channel (dense); a calibrated one drops its share, the
  fast path decodes the same tokens, and the bytes are W_gate, W_up's kept columns
  and W_down's kept rows."""
  model, _ = llama
  dense = np.asarray(model.logits(model.params, CALIB[:2]))
  layers = P.layers(model.params)
  everything = peers.apply_cats(model, model.params, {layer: 0.0 for layer in layers})
  np.testing.assert_allclose(np.asarray(model.logits(everything, CALIB[:2])), dense, atol=1e-5)
  for target in (0.3, 0.7):
    params = peers.apply_cats(model, model.params,
                              peers.cats_thresholds(model, model.params, CALIB, target))
    np.testing.assert_array_equal(generate(model, params, make_gate(0.0, batch1_switch=True)),
                                  generate(model, params))
    scores = metrics.score(model, params, CALIB)
    kept = scores["kept_share_by_layer"]
    assert abs(kept["layer_0"]["mlp_in"] - (1 - target)) < 0.05
    assert kept["layer_0"]["mlp_out"] == pytest.approx(kept["layer_0"]["mlp_in"], abs=1e-6)
    expected = 0.0
    for layer, site, d, o in P.site_shapes(params):
      share = kept[layer].get(site, 1.0)
      expected += {"mlp_in": d * o / 2 * (1 + share), "mlp_out": share * d * o}.get(site, d * o)
    outside = mbytes.other_elements(params) + mbytes.head_elements(params)
    assert mbytes.sparsity_bytes(params, kept, None) == pytest.approx((expected + outside) * 4)
  assert P.CATS_UP_T not in P.site_kernels(params)["layer_0"]["mlp_in"]  # not a map of its own
  # On a mesh, W_up transposed splits along its rows as W_up does along its columns.
  specs = sharding.partition_specs(params, 2)["layer_0"]["mlp_in"]
  assert specs[P.CATS_UP_T] == PartitionSpec(sharding.AXIS, None)
  assert specs[P.KERNEL]["up"] == PartitionSpec(None, sharding.AXIS)


def test_cats_needs_a_gated_mlp(tiny_folder):
  model = gsi_jax.load_model(tiny_folder("gpt2")[0])
  with pytest.raises(gsi_jax.GSIError, match="needs a gated MLP"):
    peers.cats_thresholds(model, model.params, CALIB, 0.5)
