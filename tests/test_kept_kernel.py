"""The kept-rows and kept-dots Pallas kernels against their references (interpret mode, the
GPU tile plans), the rows they skip, and their GPU lowering and binaries."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gsi_jax.gpu import programs
from gsi_jax.loading.load import param_shapes
from gsi_jax.models import ModelConfig
from gsi_jax.models import params as P
from gsi_jax.ops import cats_gated_linear, kept_kernel, kept_product, make_gate, tiling
from gsi_jax.ops.kernel import TOLERANCE, relative_error

GPU_PLATFORMS = ("cuda", "rocm")
# (tokens, d, outputs of each map): one token (decode plan, a row loop at d = 3000), a
# ragged batch of 3, 20 and 33 (batch plan), widths off every block, a site of three maps.
SHAPES = [(1, 100, (200, 72, 40)), (1, 3000, (100,)), (3, 1000, (72,)), (20, 1000, (130, 64)),
          (33, 300, (100,))]
# The cuda plan in both dtypes; rocm's differs in tile sizes only, checked in bf16.
PLANS = [("cuda", jnp.float32), ("cuda", jnp.bfloat16), ("rocm", jnp.bfloat16)]


def problem(T, D, outs, dtype, share=0.3, seed=0):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.normal(size=(T, D)), dtype)
  keep = jnp.asarray(rng.random((T, D)) < share)
  Ws = [jnp.asarray(rng.normal(size=(D, o)) / np.sqrt(D), dtype) for o in outs]
  return x, keep, Ws


def assert_close(ys, refs, dtype):
  for y, ref in zip(ys, refs, strict=True):
    assert y.shape == ref.shape and y.dtype == ref.dtype
    assert relative_error(y, ref) <= TOLERANCE[jnp.dtype(dtype)]


@pytest.mark.parametrize("platform, dtype", PLANS)
@pytest.mark.parametrize("shape", SHAPES)
def test_kept_rows_match_reference(platform, shape, dtype):
  """With a mask, and with a threshold the kernel applies to x itself (none kept, some,
  every entry)."""
  x, keep, Ws = problem(*shape, dtype)
  thresholds = [jnp.float32(t) for t in (np.inf, 0.8, 0.0)]
  for kept in (keep, jnp.zeros_like(keep), jnp.ones_like(keep), *thresholds):
    assert_close(kept_kernel.kept_rows_on(platform, x, kept, Ws, interpret=True),
                 kept_kernel.kept_rows_reference(x, kept, Ws), dtype)


def test_a_threshold_keeps_what_magnitude_keep_keeps():
  x = jnp.asarray([[-0.5, 0.25, 0.0, 2.0]], jnp.bfloat16)
  np.testing.assert_array_equal(kept_kernel.kept_mask(x, jnp.float32(0.25)),
                                [[True, True, False, True]])
  keep = jnp.asarray([[True, False, False, True]])
  assert kept_kernel.kept_mask(x, keep) is keep
  with pytest.raises(ValueError, match="one threshold"):
    kept_kernel.kept_mask(x, jnp.ones(4))


@pytest.mark.parametrize("platform, dtype", PLANS)
@pytest.mark.parametrize("shape", SHAPES)
def test_kept_dots_match_reference(platform, shape, dtype):
  T, D, outs = shape
  x, _, _ = problem(*shape, dtype)
  rng = np.random.default_rng(1)
  W_OD = jnp.asarray(rng.normal(size=(outs[0], D)) / np.sqrt(D), dtype)
  for share in (0.0, 0.4, 1.0):
    keep = jnp.asarray(rng.random((T, outs[0])) < share)
    assert_close([kept_kernel.kept_dots_on(platform, x, keep, W_OD, interpret=True)],
                 [kept_kernel.kept_dots_reference(x, keep, W_OD)], dtype)


@pytest.mark.parametrize("platform", GPU_PLATFORMS)
@pytest.mark.parametrize("tokens", [1, 5])
def test_rows_no_token_keeps_are_not_read(platform, tokens):
  """W's rows that no token keeps, and W_OD's rows that no token keeps, hold NaN: a kernel
  that loaded them (and multiplied by zero) would return NaN; a masked load never sees them.
  So too with a threshold the kernel applies."""
  x, keep, (W,) = problem(tokens, 300, (130,), jnp.float32, seed=3)
  threshold = jnp.float32(1.5 if tokens == 1 else 2.0)
  for kept in (keep, threshold):
    unread = ~np.asarray(kept_kernel.kept_mask(x, kept)).any(0)
    assert 0 < unread.sum() < 300
    poisoned = jnp.where(jnp.asarray(unread)[:, None], jnp.nan, W)
    (y,) = kept_kernel.kept_rows_on(platform, x, kept, [poisoned], interpret=True)
    assert np.isfinite(np.asarray(y)).all()
    assert_close([y], kept_kernel.kept_rows_reference(x, kept, [W]), jnp.float32)
  keep_O = jnp.asarray(np.random.default_rng(4).random((tokens, 130)) < 0.2)
  dropped = ~np.asarray(keep_O).any(0)
  W_OD = jnp.where(jnp.asarray(dropped)[:, None], jnp.nan, W.T)
  y = kept_kernel.kept_dots_on(platform, x, keep_O, W_OD, interpret=True)
  assert np.isfinite(np.asarray(y)).all()
  assert_close([y], [kept_kernel.kept_dots_reference(x, keep_O, W.T)], jnp.float32)


def test_cpu_runs_the_cuda_plan_and_tpu_the_masked_product():
  x, keep, Ws = problem(3, 200, (64, 48), jnp.float32)
  got = kept_kernel.kept_rows(x, keep, Ws)
  want = kept_kernel.kept_rows_on("cuda", x, keep, Ws, interpret=True)
  for a, b in zip(got, want, strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  arg = jax.ShapeDtypeStruct
  args = (arg((3, 200), jnp.float32), arg((3, 200), jnp.bool_),
          (arg((200, 64), jnp.float32), arg((200, 48), jnp.float32)))
  tpu = programs.export_for(kept_kernel.kept_rows, args, "tpu")
  assert not programs.custom_call_targets(tpu) and programs.interpreter_loops(tpu) == 0


@pytest.mark.parametrize("platform", GPU_PLATFORMS)
def test_lower_to_one_kernel_call(platform):
  for tokens in (1, 16):
    for exported in programs.kept_exports(platform, jnp.bfloat16, tokens).values():
      assert programs.kernel_calls(exported, platform) == 1
      assert programs.foreign_calls(exported, platform) == []
      assert programs.interpreter_loops(exported) == 0


@pytest.mark.parametrize("tokens", [1, 3])
def test_ops_take_the_kernel_by_impl(tokens):
  """kept_product (sparsity, the residual, R-Sparse) and CATS' up projection agree on every
  impl; "pallas" runs the kernel here (interpreted), "auto" the XLA or FFI path on cpu."""
  x, _, Ws = problem(tokens, 96, (40, 24), jnp.float32, seed=5)
  x, threshold = x[None], jnp.float32(0.7)
  W_gate, W_up = Ws[0][:, :24], Ws[1]
  results = {}
  for impl in ("xla", "pallas", "auto"):
    gate = make_gate(0.1, impl=impl, batch1_switch=True)
    ys, keep = kept_product(x, threshold, Ws, gate)
    assert 0 < int(keep.sum()) < keep.size
    _, up, kept = cats_gated_linear(x, W_gate, W_up, W_up.T, 0.05, jax.nn.silu, gate)
    results[impl] = [np.asarray(y) for y in ys] + [np.asarray(up)]
    assert 0 < int(kept.sum()) < kept.size
  for impl in ("pallas", "auto"):
    for a, b in zip(results[impl], results["xla"], strict=True):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("platform", GPU_PLATFORMS)
def test_auto_on_a_gpu_exports_the_kernel_and_nothing_cpu_only(platform):
  """impl="auto" at one token: the site's kept rows are one Triton call for a GPU, with no
  FFI call (the CPU kernel is never lowered into a GPU program), no interpreter loop."""
  gate = make_gate(0.1, impl="auto", batch1_switch=True)
  arg = jax.ShapeDtypeStruct
  fn = jax.jit(lambda x, threshold, Ws: kept_product(x, threshold, list(Ws), gate)[0])
  args = (arg((1, 1, 576), jnp.float32), arg((), jnp.float32),
          (arg((576, 576), jnp.float32), arg((576, 192), jnp.float32)))
  exported = programs.export_for(fn, args, platform)
  assert programs.kernel_calls(exported, platform) == 1
  assert programs.foreign_calls(exported, platform) == []
  assert programs.interpreter_loops(exported) == 0


@pytest.mark.parametrize("platform", GPU_PLATFORMS)
def test_a_sparsity_model_runs_one_kernel_per_site(platform):
  """TEAL-style sparsity on the default model's shapes (two layers) at the default impl
  ("auto"): its forward and its decode step call the kept-rows kernel once per site, with
  nothing CPU-only and no interpreter loop."""
  config = dataclasses.replace(ModelConfig.smollm2_135m(), n_layers=2)
  params = param_shapes(config, jnp.bfloat16)
  for layer, sites in P.site_kernels(params).items():
    for site in sites:
      params = P.with_site(params, layer, site,
                           {P.THRESHOLD: jax.ShapeDtypeStruct((), jnp.float32)})
  exports = programs.model_programs(config, platform, "auto", params=params)
  for exported in exports.values():
    assert programs.kernel_calls(exported, platform) == programs.gated_site_count(config) == 8
    assert programs.foreign_calls(exported, platform) == []
    assert programs.interpreter_loops(exported) == 0
