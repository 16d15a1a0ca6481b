"""The Pallas gated matmul against its pure-JAX reference, its tile plans, byte model and
bandwidth model, and the gated-linear op's gate."""

import importlib.metadata
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gsi_jax import GSIError, make_gate
from gsi_jax.gpu import binaries
from gsi_jax.metrics import bytes as mbytes
from gsi_jax.models import params as P
from gsi_jax.ops import (GatedWeights, gate_mask, gated_linear, gated_matmul, gated_matmul_on,
                         gated_matmul_reference, tiling)
from gsi_jax.ops.kernel import gated_matmul_from_basis_on, gated_matmul_from_basis_reference
from gsi_jax.ops.kernel import TOLERANCE, relative_error  # by dtype, beside its PRECISION
from tests.compile_flags import cheap_compile_flags
from tests.test_experiments import assert_one_error_line

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# (tokens, d, k, O): one token (decode plan: a matrix-vector product per token, the
# reduction split to fill the chip, a loop over row tiles), a few tokens, 16 and 33 tokens
# (prefill plan: tensor-core tiles, the reduction split, a ragged last token block), widths
# that are not multiples of 16, and the default model's d = 576.
SHAPES = [(1, 100, 24, 200), (1, 1000, 40, 72), (5, 96, 24, 200), (16, 128, 32, 128),
          (33, 100, 16, 48), (1, 576, 256, 192), (3, 1024, 256, 512), (20, 1000, 48, 130),
          (1, 3000, 40, 100)]
GATES = {"all_slow": 0.0, "mixed": 0.1, "all_fast": float("inf")}
GPU_PLATFORMS = ("cuda", "rocm")


def problem(T, D, K, O, dtype, seed=0):
  """x, V, M, W with half the tokens in span(V) plus a little noise: a mixed gate at 0.1."""
  rng = np.random.default_rng(seed)
  V, _ = np.linalg.qr(rng.normal(size=(D, K)))
  x = rng.normal(size=(T, D))
  x[::2] = (rng.normal(size=(len(x[::2]), K)) @ V.T) + 0.01 * rng.normal(size=(len(x[::2]), D))
  W = rng.normal(size=(D, O)) / np.sqrt(D)
  cast = lambda a: jnp.asarray(a, dtype)
  return cast(x), cast(V), cast(V.T @ W), cast(W)


def check_labels(label, fast, T):
  """The case is what its name says."""
  n = int(np.sum(fast))
  if label == "all_fast":
    assert n == T
  elif label == "all_slow":
    assert n == 0
  elif T > 1:
    assert 0 < n < T


def assert_close(y, y_ref, dtype):
  assert relative_error(y, y_ref) <= TOLERANCE[jnp.dtype(dtype)]


def assert_same_call(got, want, dtype):
  """Two (ys, fast_T) results agree: the same gate, every map's outputs within tolerance."""
  (ys, fast), (ys_ref, fast_ref) = got, want
  np.testing.assert_array_equal(np.asarray(fast), np.asarray(fast_ref))
  assert len(ys) == len(ys_ref)
  for y, y_ref in zip(ys, ys_ref):
    assert y.shape == y_ref.shape and y.dtype == y_ref.dtype
    assert_close(y, y_ref, dtype)


def test_cases_cover_the_gpu_plans():
  """The shapes above reach every branch of the GPU layouts: at one token a split reduction
  with a loop over tiles and splits left without rows of M; split reductions of several
  tokens; masked rows, columns and tokens."""
  for platform in GPU_PLATFORMS:
    lays = [tiling.layout(tiling.plan_for(platform, T), T, D, K, O) for T, D, K, O in SHAPES]
    one = [l for l in lays if l.block_t == 1]
    assert any(l.splits > 1 and l.d_chunk > l.block_d for l in one)  # a loop in each split
    assert any(l.splits * l.k_chunk >= l.k + l.k_chunk for l in one)  # splits without M rows
    assert any(l.splits > 1 and l.block_t > 1 for l in lays)
    assert any(l.mask_d for l in lays) and any(l.mask_k for l in lays)
    assert any(any(l.mask_outs) for l in lays)
    assert any(l.tokens % l.block_t for l in lays)


@pytest.mark.parametrize("platform", tiling.PLATFORMS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_interpreted_plans_match_reference(platform, shape, dtype):
  """Each platform's own tile plan, run in interpret mode, equals the reference (all slow,
  mixed and all fast: ε is an input, so one compiled program serves all three), with a
  second map of the site sharing the call."""
  x, V, M, W = problem(*shape, dtype)
  g = x @ V
  Ms, Ws = [M, M[:, :48]], [W, W[:, :48]]
  run = jax.jit(lambda eps: gated_matmul_on(platform, x, g, eps, Ms, Ws, interpret=True))
  for label, eps in GATES.items():
    want = gated_matmul_reference(x, g, eps, Ms, Ws)
    check_labels(label, np.asarray(want[1]), shape[0])
    assert_same_call(run(eps), want, dtype)


@pytest.mark.parametrize("platform", tiling.PLATFORMS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_g_made_in_the_call_matches_reference(platform, shape, dtype):
  """A decode's call (`gated_matmul_from_basis`: x padded once, g and the gate from the
  padded x) equals its reference at every gate: thresholds, then a decision per token
  (as static and coin pass it) and thresholds per token, which are padded as x is."""
  x, V, M, W = problem(*shape, dtype)
  T = shape[0]
  Ms, Ws = [M, M[:, :48]], [W, W[:, :48]]
  run = jax.jit(lambda eps: gated_matmul_from_basis_on(platform, x, V.T, eps, Ms, Ws,
                                                       interpret=True))
  for label, eps in GATES.items():
    want = gated_matmul_from_basis_reference(x, V.T, eps, Ms, Ws)
    check_labels(label, np.asarray(want[1]), T)
    assert_same_call(run(eps), want, dtype)
  fast = jnp.asarray(np.arange(T) % 3 == 0)
  for eps in (fast, jnp.where(fast, jnp.inf, 0.0)):
    got = gated_matmul_from_basis_on(platform, x, V.T, eps, Ms, Ws, interpret=True)
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(fast))
    assert_same_call(got, gated_matmul_from_basis_reference(x, V.T, eps, Ms, Ws), dtype)


@pytest.mark.parametrize("platform", tiling.PLATFORMS)
def test_thresholds_per_token_steer_the_gate(platform):
  """ε per token: ∞ makes a token fast, 0 slow, whatever its subspace residual."""
  x, V, M, W = problem(7, 200, 24, 96, jnp.float32, seed=6)
  g = x @ V
  fast = np.array([1, 0, 0, 1, 1, 0, 1], bool)
  eps = jnp.where(jnp.asarray(fast), jnp.inf, 0.0)
  got = gated_matmul_on(platform, x, g, eps, [M], [W], interpret=True)
  np.testing.assert_array_equal(np.asarray(got[1]), fast)
  assert_same_call(got, gated_matmul_reference(x, g, eps, [M], [W]), jnp.float32)


@pytest.mark.parametrize("platform", tiling.PLATFORMS)
def test_a_decision_taken_in_xla_is_the_kernels_as_it_is(platform):
  """eps as a bool decision (a mode that decided: static, coin, ladder, sketch) steers each
  token as a threshold of ∞ or 0 would, in the kernel and its reference alike; one bool
  for every token (static's) too."""
  x, V, M, W = problem(7, 200, 24, 96, jnp.float32, seed=6)
  g = x @ V
  fast = np.array([1, 0, 0, 1, 1, 0, 1], bool)
  thresholds = jnp.where(jnp.asarray(fast), jnp.inf, 0.0)
  got = gated_matmul_on(platform, x, g, jnp.asarray(fast), [M], [W], interpret=True)
  np.testing.assert_array_equal(np.asarray(got[1]), fast)
  assert_same_call(got, gated_matmul_reference(x, g, thresholds, [M], [W]), jnp.float32)
  assert_same_call(gated_matmul_reference(x, g, jnp.asarray(fast), [M], [W]),
                   gated_matmul_reference(x, g, thresholds, [M], [W]), jnp.float32)
  every = gated_matmul_on(platform, x, g, jnp.bool_(True), [M], [W], interpret=True)
  np.testing.assert_array_equal(np.asarray(every[1]), np.ones(7, bool))
  assert_same_call(every, gated_matmul_reference(x, g, jnp.inf, [M], [W]), jnp.float32)
  # g with ‖x‖² as a last column (a plain gate's, `gated_linear.project_with_energy`): the
  # kernel reads its first k columns only, and the result is the same.
  gx = jnp.concatenate([g, jnp.full((7, 1), 1e30, g.dtype)], -1)
  wide = gated_matmul_on(platform, x, gx, jnp.asarray(fast), [M], [W], interpret=True)
  assert_same_call(wide, got, jnp.float32)
  assert_same_call(gated_matmul_reference(x, gx, jnp.asarray(fast), [M], [W]), got,
                   jnp.float32)


@pytest.mark.parametrize("platform", tiling.PLATFORMS)
def test_site_of_ragged_maps_in_one_call(platform):
  """Maps of unequal widths (Llama's q, k, v under grouped-query attention; none a multiple
  of a block) share one call: each program reads and writes its own map's blocks only."""
  x, V, M, W = problem(3, 160, 32, 400, jnp.float32, seed=8)
  g = x @ V
  Ms, Ws = [M[:, :200], M[:, 200:264], M[:, 264:]], [W[:, :200], W[:, 200:264], W[:, 264:]]
  lay = tiling.layout(tiling.plan_for(platform, 3), 3, 160, 32, (200, 64, 136))
  assert lay.map_starts[1] > 0 and lay.out_blocks == sum(lay.map_blocks)
  for eps in GATES.values():
    got = gated_matmul_on(platform, x, g, eps, Ms, Ws, interpret=True)
    assert_same_call(got, gated_matmul_reference(x, g, eps, Ms, Ws), jnp.float32)
    np.testing.assert_allclose(np.concatenate([np.asarray(y) for y in got[0]], 1),
                               np.asarray(gated_matmul_reference(x, g, eps, [M], [W])[0][0]),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("platform", tiling.PLATFORMS)
@pytest.mark.parametrize("tokens", [1, 4, 17])
def test_tied_head_with_ragged_vocabulary(platform, tokens):
  """A tied head passes its (vocab, d) table as stored; 301 rows fill no block."""
  x, V, M, W = problem(tokens, 96, 32, 301, jnp.float32, seed=2)
  g = x @ V
  got = gated_matmul_on(platform, x, g, 0.1, [M], [W.T], w_transposed=True, interpret=True)
  assert_same_call(got, gated_matmul_reference(x, g, 0.1, [M], [W]), jnp.float32)
  # A GSI head's M as stored: zero columns up to the next multiple of 64 (320), read
  # unmasked and dropped from y.
  M_padded = jnp.pad(M, ((0, 0), (0, P.head_m_columns(301) - 301)))
  padded = gated_matmul_on(platform, x, g, 0.1, [M_padded], [W.T], w_transposed=True,
                           interpret=True)
  assert padded[0][0].shape == (tokens, 301)
  assert_same_call(padded, gated_matmul_reference(x, g, 0.1, [M_padded], [W.T],
                                                  w_transposed=True), jnp.float32)
  assert_close(padded[0][0], got[0][0], jnp.float32)


def test_cpu_runs_the_cuda_plan_interpreted():
  """`gated_matmul` lowered for cpu is exactly the cuda plan in interpret mode."""
  x, V, M, W = problem(3, 1000, 40, 72, jnp.float32, seed=4)
  g = x @ V
  (y,), fast = gated_matmul(x, g, 0.1, [M], [W])
  (y_cuda,), fast_cuda = gated_matmul_on("cuda", x, g, 0.1, [M], [W], interpret=True)
  np.testing.assert_array_equal(np.asarray(y), np.asarray(y_cuda))
  np.testing.assert_array_equal(np.asarray(fast), np.asarray(fast_cuda))


def test_tile_sizes_do_not_change_results():
  x, V, M, W = problem(40, 96, 24, 300, jnp.float32, seed=3)
  g = x @ V
  small = tiling.TilePlan(16, 16, 16, 16, min_programs=64)
  large = tiling.TilePlan(32, 256, 512, 128)
  per_token = tiling.TilePlan(1, 64, 16, 16, min_programs=1024)
  a = gated_matmul_on("cuda", x, g, 0.1, [M], [W], plan=small, interpret=True)
  assert tiling.layout(small, 40, 96, 24, 300).splits > 1
  assert tiling.layout(per_token, 40, 96, 24, 300).splits > 1
  for plan in (large, per_token):
    b = gated_matmul_on("cuda", x, g, 0.1, [M], [W], plan=plan, interpret=True)
    np.testing.assert_array_equal(np.asarray(a[1]), np.asarray(b[1]))
    np.testing.assert_allclose(np.asarray(a[0][0]), np.asarray(b[0][0]), rtol=1e-5, atol=1e-5)


# GPT-J-6B's maps (d, O) at k = 256: q/k/v and attn_out, fc_in, fc_out.
GPTJ_MAPS = [(4096, 4096), (4096, 16384), (16384, 4096)]
# Gated sites (d, the outputs of each map): GPT-J's attention input (q, k, v and fc_in, its
# parallel block), out_proj and fc_out; Llama-3-8B's q, k, v (grouped), gate and up, down.
SITES = {"gptj": [(4096, (4096,) * 3 + (16384,)), (4096, (4096,)), (16384, (4096,))],
         "llama-3-8b": [(4096, (4096, 1024, 1024)), (4096, (14336, 14336)), (14336, (4096,))]}


@pytest.mark.parametrize("platform", GPU_PLATFORMS)
@pytest.mark.parametrize("model", list(SITES))
def test_decode_tiles_keep_enough_bytes_in_flight(platform, model):
  """Little's law at one token: each decode site, one call, splits its reduction until the
  chip has the plan's programs (4 per SM, 2 per CU), and with 2 of them resident per SM
  or CU (what every bf16 binary holds at least, tests/test_gpu_binaries.py) keeps
  at least bandwidth × latency / units bytes of bf16 weights in flight."""
  chip = tiling.CHIPS[platform]
  plan = tiling.plan_for(platform, 1)
  for d, outs in SITES[model]:
    lay = tiling.layout(plan, 1, d, 256, outs)
    assert lay.programs >= plan.min_programs and lay.block_o == 256, (d, outs, lay.grid)
    assert tiling.bytes_in_flight(lay, 2, chip, binaries.RESIDENT_AT_LEAST) >= \
        chip.needed_in_flight, lay
  # The check can fail: one resident program of 64 × 64 tiles keeps 8 KB per unit.
  split = tiling.layout(tiling.TilePlan(1, 64, 64, 32, 2 * chip.units), 1, 4096, 256, 4096)
  assert split.splits > 1
  assert tiling.bytes_in_flight(split, 2, chip) == 8192 < chip.needed_in_flight


@pytest.mark.parametrize("platform", GPU_PLATFORMS)
def test_prefill_grid_fills_the_chip(platform):
  """16 tokens and more: tensor-core tiles, the reduction split until 2 programs per unit."""
  for d, out in GPTJ_MAPS:
    lay = tiling.layout(tiling.plan_for(platform, 16), 16, d, 256, out)
    assert lay.programs >= 2 * tiling.CHIPS[platform].units, (d, out, lay.grid)
    assert lay.splits * lay.d_chunk >= d > (lay.splits - 1) * lay.d_chunk  # no empty split


@pytest.mark.parametrize("platform", tiling.PLATFORMS)
@pytest.mark.parametrize("d, out", GPTJ_MAPS + [(576, 1536), (1000, 130)])
def test_byte_model_is_the_byte_formula(platform, d, out):
  """Decoding, the kernel reads by its tile plan what `metrics.bytes` charges per token: with
  V_k's d k added (read once per call, by XLA, for g), one token reads exactly
  gated_map_elements(d, O, k, f k, f) at f = 0 and at f = 1, and a call of mixed tokens the
  sum of its tokens'.  A prefill block of tokens reads M and W once for all its tokens."""
  k = 256
  lay = tiling.layout(tiling.plan_for(platform, 1), 1, d, k, out)
  if (lay.padded_d, lay.padded_k, lay.padded_out) != (d, k, out):
    assert lay.plan.pad_inputs  # only the TPU plan pads (and then reads the padding)
    return
  for fast in ([0], [1], [1, 0, 0, 1, 1, 1, 0, 1]):
    T = len(fast)
    lay = tiling.layout(tiling.plan_for(platform, T), T, d, k, out)
    per_token = sum(mbytes.gated_map_elements(d, out, k, f * k, f) for f in fast)
    read = tiling.weight_elements_read(lay, fast) + T * d * k
    if T == 1:
      assert read == per_token
    else:  # one block of tokens reads each of M and W once for the call
      assert lay.token_blocks == 1
      assert read == T * d * k + (k * out if any(fast) else 0) + (d * out if not all(fast) else 0)
  T = 100
  lay = tiling.layout(tiling.plan_for(platform, T), T, d, k, out)
  assert lay.block_t > 1 and lay.token_blocks > 1
  slow, fast = [0] * T, [1] * T
  mixed = [1] * (T - 1) + [0]  # one slow token: its block reads W, the others do not
  assert tiling.weight_elements_read(lay, slow) == lay.token_blocks * d * out
  assert tiling.weight_elements_read(lay, fast) == lay.token_blocks * k * out
  assert tiling.weight_elements_read(lay, mixed) == lay.token_blocks * k * out + d * out


@pytest.mark.parametrize("platform", GPU_PLATFORMS)
def test_no_weight_tile_is_read_twice_up_to_64_tokens(platform):
  """At every token count from 1 to 64 and any gate pattern a call reads each weight at most
  once: (any token fast) k O + (any token slow) d O elements, exactly (GPT-J's attention
  input site, nothing padded).  Past 64 tokens (prefill) each 32-token block reads its own."""
  d, k, outs = 4096, 256, (4096, 4096, 4096, 16384)
  O = sum(outs)
  rng = np.random.default_rng(0)
  for T in range(1, 65):
    lay = tiling.layout(tiling.plan_for(platform, T), T, d, k, outs)
    patterns = [np.zeros(T, bool), np.ones(T, bool), np.arange(T) == T - 1,
                rng.random(T) < 0.5, rng.random(T) < 0.9]
    for fast in patterns:
      bound = k * O * fast.any() + d * O * (~fast).any()
      assert tiling.weight_elements_read(lay, fast) == bound, (T, fast)
  lay = tiling.layout(tiling.plan_for(platform, 65), 65, d, k, outs)
  assert tiling.weight_elements_read(lay, np.zeros(65, bool)) == 3 * d * O


def _has_gpu():
  try:
    return bool(jax.devices("gpu"))
  except RuntimeError:
    return False


@pytest.mark.skipif(not _has_gpu(), reason="needs a GPU (the compiled Triton kernel)")
class TestCompiledOnGPU:
  """`gated_matmul` on a GPU runs the compiled kernel: the same cases as interpret mode."""

  @pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
  @pytest.mark.parametrize("shape", SHAPES)
  def test_matches_reference(self, shape, dtype):
    x, V, M, W = problem(*shape, dtype)
    g = x @ V
    Ms, Ws = [M, M[:, :48]], [W, W[:, :48]]
    for label, eps in GATES.items():
      want = gated_matmul_reference(x, g, eps, Ms, Ws)
      check_labels(label, np.asarray(want[1]), shape[0])
      assert_same_call(gated_matmul(x, g, eps, Ms, Ws), want, dtype)

  def test_tied_head(self):
    x, V, M, W = problem(9, 96, 32, 301, jnp.float32, seed=2)
    g = x @ V
    assert_same_call(gated_matmul(x, g, 0.1, [M], [W.T], w_transposed=True),
                     gated_matmul_reference(x, g, 0.1, [M], [W]), jnp.float32)

  @pytest.mark.parametrize("tokens", [1, 16, 256])
  @pytest.mark.parametrize("d, out", GPTJ_MAPS)
  def test_gptj_shapes(self, tokens, d, out):
    """GPT-J's maps at k = 256, bf16, through the compiled tile plans."""
    x, V, M, W = problem(tokens, d, 256, out, jnp.bfloat16)
    g = x @ V
    for eps in GATES.values():
      assert_same_call(gated_matmul(x, g, eps, [M], [W]),
                       gated_matmul_reference(x, g, eps, [M], [W]), jnp.bfloat16)


def test_gate_mask_equals_numpy_residual_ratio():
  """fast ⇔ ‖x − V Vᵀ x‖ / ‖x‖ < ε, computed independently in float64."""
  x, V, M, W = problem(64, 96, 24, 40, jnp.float32, seed=5)
  x64, V64 = np.asarray(x, np.float64), np.asarray(V, np.float64)
  rho = np.linalg.norm(x64 - x64 @ V64 @ V64.T, axis=1) / np.linalg.norm(x64, axis=1)
  for eps in (0.0, 0.005, 0.01, 0.02, 0.5, 1.5, float("inf")):
    want = rho < eps
    got = np.asarray(gate_mask(x, x @ V, eps))
    close = np.abs(rho - eps) < 1e-4  # float32 ties at the boundary
    assert np.array_equal(got[~close], want[~close]), eps
  assert 0 < np.mean(rho < 0.02) < 1  # the thresholds above split the tokens


@pytest.mark.parametrize("label", list(GATES))
def test_op_impls_agree(label):
  """gated_linear through the kernel equals the XLA masked select and the batch-1 switch."""
  x, V, M, W = problem(12, 96, 24, 72, jnp.float32, seed=7)
  weights = GatedWeights([W, 2 * W[:, :40]], V, [M, 2 * M[:, :40]])
  eps = GATES[label]
  outs = {}
  for impl, switch in (("xla", False), ("xla", True), ("pallas", False), ("auto", True)):
    gate = make_gate(eps, impl=impl, batch1_switch=switch)
    ys, fast, _ = gated_linear(x[None], weights, gate.eps, gate)
    check_labels(label, np.asarray(fast[0]), 12)
    outs[impl, switch] = [np.asarray(y) for y in ys]
  for got in outs.values():
    for a, b in zip(got, outs["xla", False]):
      tol = TOLERANCE[jnp.dtype(jnp.float32)]
      np.testing.assert_allclose(a, b, rtol=tol, atol=tol)


@pytest.mark.parametrize("mode, eps", [("gated", 0.1), ("gated", float("inf")),
                                       ("gated", 0.0), ("static", 0.0), ("coin", 0.5)])
@pytest.mark.parametrize("tokens", [1, 12])
def test_a_decode_makes_g_in_the_kernels_call(mode, eps, tokens):
  """With V_kᵀ laid out (a decode), the kernel path makes g and the gate inside its call
  (`gated_matmul_from_basis`): the same outputs and mask as the XLA masked select over V,
  at one token and at several, for the plain gate, static and coin."""
  x, V, M, W = problem(tokens, 96, 24, 72, jnp.float32, seed=7)
  plain = GatedWeights([W, 2 * W[:, :40]], V, [M, 2 * M[:, :40]])
  decode = plain._replace(V_T=V.T)
  xla, pallas = make_gate(eps, mode, impl="xla"), make_gate(eps, mode, impl="pallas")
  ys, fast, _ = gated_linear(x[None], decode, pallas.eps, pallas)
  ys_ref, fast_ref, _ = gated_linear(x[None], plain, xla.eps, xla)
  np.testing.assert_array_equal(np.asarray(fast), np.asarray(fast_ref))
  for y, y_ref in zip(ys, ys_ref):
    assert_close(y, y_ref, jnp.float32)


@pytest.mark.parametrize("kind", ["ladder", "sketch"])
def test_ladder_and_sketch_through_the_kernel_equal_xla(kind):
  """The rank ladder and the output-aware gate decide each token in XLA, then the kernel
  takes that decision as per-token thresholds (∞: fast, 0: slow): the same outputs, mask
  and ranks as the XLA masked select, with fast and slow tokens both present."""
  x, V, M, W = problem(12, 96, 24, 72, jnp.float32, seed=7)
  extra = ({"rungs": jnp.asarray([8, 16])} if kind == "ladder" else
           {"sketch": (W[:, :8], M[:, :8])})
  weights = GatedWeights([W], V, [M], **extra)
  got = {}
  for impl in ("xla", "pallas"):
    gate = make_gate(0.6, impl=impl)
    ys, fast, rank = gated_linear(x[None], weights, gate.eps, gate)
    got[impl] = (np.asarray(ys[0]), np.asarray(fast), np.asarray(rank))
  assert 0 < got["xla"][1].sum() < 12, got["xla"][1]
  np.testing.assert_array_equal(got["pallas"][1], got["xla"][1])
  np.testing.assert_array_equal(got["pallas"][2], got["xla"][2])
  tol = TOLERANCE[jnp.dtype(jnp.float32)]
  np.testing.assert_allclose(got["pallas"][0], got["xla"][0], rtol=tol, atol=tol)


def test_bad_impl():
  with pytest.raises(GSIError, match="impl 'cuda' is not one of"):
    make_gate(0.1, impl="cuda")


def test_coin_gate_fires_at_its_rate_on_every_impl():
  """mode "coin": each token fast with probability eps whatever its residual, the same
  tokens on the XLA path and through the kernel (which takes the decision as thresholds),
  with outputs g M on fast tokens and x W on slow ones."""
  x, V, M, W = problem(400, 96, 24, 72, jnp.float32, seed=9)
  weights = GatedWeights([W], V, [M])
  for p in (0.0, 0.5, 0.9, 1.0):
    got = {}
    for impl in ("xla", "pallas"):
      gate = make_gate(p, "coin", impl=impl)
      ys, fast, _ = gated_linear(x[None], weights, gate.eps, gate)
      got[impl] = np.asarray(ys[0][0]), np.asarray(fast[0])
    np.testing.assert_array_equal(got["pallas"][1], got["xla"][1])
    assert abs(got["xla"][1].mean() - p) < 0.08, (p, got["xla"][1].mean())
    want = gated_matmul_reference(x, x @ V, jnp.where(jnp.asarray(got["xla"][1]), jnp.inf, 0.0),
                                  [M], [W])[0][0]
    for y, _ in got.values():
      assert_close(y, want, jnp.float32)


def test_at_eps_zero_the_kernel_path_reads_no_basis():
  """At ε = 0 no token can be fast: the kernel path, like XLA's, takes the branch of dense
  products, which reads neither V_k nor M (NaN there changes nothing)."""
  x, V, M, W = problem(3, 96, 24, 72, jnp.float32, seed=10)
  poisoned = GatedWeights([W], jnp.full_like(V, jnp.nan), [jnp.full_like(M, jnp.nan)])
  for impl in ("xla", "pallas"):
    gate = make_gate(0.0, impl=impl)
    ys, fast, rank = gated_linear(x[None], poisoned, gate.eps, gate)
    assert not np.asarray(fast).any() and not np.asarray(rank).any()
    np.testing.assert_allclose(np.asarray(ys[0][0]), np.asarray(x @ W), rtol=1e-5, atol=1e-5)


# Three tokens, two of them near span(V) (a mixed gate at 0.1), float32 and bfloat16; a
# fresh process imports only the op.
CHEAP_COMPILE_SCRIPT = """
import sys
import jax, jax.numpy as jnp, numpy as np
from gsi_jax.ops import gated_matmul_on
rng = np.random.default_rng(0)
V = np.linalg.qr(rng.normal(size=(1000, 40)))[0]
x, W = rng.normal(size=(3, 1000)), rng.normal(size=(1000, 72)) / np.sqrt(1000)
x[::2] = rng.normal(size=(2, 40)) @ V.T + 0.01 * rng.normal(size=(2, 1000))
ys = []
for dtype in (jnp.float32, jnp.bfloat16):
  x_, V_, M_, W_ = (jnp.asarray(a, dtype) for a in (x, V, V.T @ W, W))
  run = jax.jit(lambda eps: gated_matmul_on("cuda", x_, x_ @ V_, eps, [M_], [W_], interpret=True))
  ys.append(np.asarray(run(0.1)[0][0], np.float32))
np.savez(sys.argv[1], *ys)
"""


def test_the_tests_cheap_compile_flags_compute_what_xlas_defaults_compute(tmp_path):
  """The suite compiles with XLA's cheapest CPU code generation (conftest): this jaxlib
  accepts the flags, and an interpreted kernel's results under them equal those under
  XLA's defaults within the dtype's tolerance (not bit for bit: -O0 may add in another
  order)."""
  results = {}
  for name, flags in (("default", ""),
                      ("cheap", cheap_compile_flags(importlib.metadata.version("jaxlib")))):
    proc = subprocess.run(
        [sys.executable, "-c", CHEAP_COMPILE_SCRIPT, str(tmp_path / f"{name}.npz")], cwd=ROOT,
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stderr[-3000:]
    results[name] = np.load(tmp_path / f"{name}.npz")
  default, cheap = results["default"], results["cheap"]
  assert len(default.files) == 2
  for i, name in enumerate(default.files):
    dtype = (jnp.float32, jnp.bfloat16)[i % 2]
    assert relative_error(cheap[name], default[name]) <= TOLERANCE[jnp.dtype(dtype)]


@pytest.mark.parametrize("bad, message", [
    (["--rounds=0"], "--rounds must be a positive whole number"),
    (["--runs=0"], "--runs must be a positive whole number"),
    (["--out=/"], "--out: / is a folder"),
    (["--tests=tests/no_such_test.py::test_x"],
     "--tests: tests/no_such_test.py is not a test file of this repository")])
def test_compile_flags_benchmark_bad_flags_exit_2(bad, message):
  """tools/compile_flags.py checks its flags before it starts a process."""
  proc = subprocess.run([sys.executable, "tools/compile_flags.py", *bad], cwd=ROOT,
                        capture_output=True, text=True, timeout=120)
  assert_one_error_line(proc, message)


@pytest.mark.parametrize("platform", tiling.PLATFORMS)
def test_eps_inf_and_a_zero_token_always_fire(platform):
  """ε = ∞ fires for every token, a token of zeros included (∞ · 0 is NaN in the product
  ε² ‖x‖²), and so does ‖x‖ = 0 at any ε > 0 (M g = x W = 0 there), in gate_mask and the
  kernel alike; ε = 0 never fires, zeros included."""
  x, V, M, W = problem(4, 200, 24, 96, jnp.float32, seed=8)
  x = x.at[1].set(0.0)
  g = x @ V
  for eps, want in ((jnp.inf, [1, 1, 1, 1]), (1e-6, [0, 1, 0, 0]), (0.0, [0, 0, 0, 0])):
    np.testing.assert_array_equal(np.asarray(gate_mask(x, g, eps)), np.array(want, bool))
    got = gated_matmul_on(platform, x, g, eps, [M], [W], interpret=True)
    np.testing.assert_array_equal(np.asarray(got[1]), np.array(want, bool))
    assert_same_call(got, gated_matmul_reference(x, g, eps, [M], [W]), jnp.float32)
    assert np.all(np.asarray(got[0][0])[1] == 0)
