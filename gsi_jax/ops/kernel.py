"""The gated matrix product as a Pallas kernel, beside its pure-JAX reference.

    y_t = g_t M   where token t is fast,   y_t = x_t W   where it is slow.

g = x V_k and the gate are computed once per token before the kernel (one read
of V_k; see `gsi_jax.ops.gated_linear`), so each program only streams weights.
A program owns block_t tokens × block_o outputs × one split of the reduction
dimension, loops over its split in tiles (block_k rows of M, block_d rows of W),
and reads M's tiles only when one of its tokens is fast and W's only when one
is slow (`lax.cond`), so padded tokens never cause a read.  `gsi_jax.ops.tiling`
holds the tile plans, one table per platform, and the byte model.

`gated_matmul` picks the kernel by the platform it is lowered for
(`lax.platform_dependent`), not by the machine it is traced on: Triton on cuda
and rocm, Mosaic on tpu, and interpret mode of the cuda plan on cpu, so the
tests here run the tiles a GPU runs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from gsi_jax.ops import tiling

FAST, SLOW, PADDING = 1, 0, -1
INTERPRETED_PLAN = "cuda"  # the plan cpu runs in interpret mode

# The one statement of precision.  g enters the kernel in M's dtype, so each product's
# operands share the weights' dtype, and every product runs at Precision.HIGHEST: IEEE for
# float32 (a GPU's default for float32 dots is TF32, whose 10-bit mantissa errs near 1e-3),
# bfloat16 operands accumulated in float32.  The reference computes in float32 at HIGHEST.
# TOLERANCE: the largest error of the kernel against its reference that each dtype
# allows, as a share of the output's largest magnitude.
PRECISION = lax.Precision.HIGHEST
TOLERANCE = {jnp.dtype(jnp.float32): 1e-4, jnp.dtype(jnp.bfloat16): 3e-2}


def relative_error(y, y_ref) -> float:
  """The largest error over the largest reference output: what TOLERANCE bounds."""
  y, y_ref = y.astype(jnp.float32), y_ref.astype(jnp.float32)
  return float(jnp.abs(y - y_ref).max() / jnp.maximum(jnp.abs(y_ref).max(), 1e-30))


def gated_matmul_reference(x_TD, g_TK, fast_T, M_KO, W, *, w_transposed: bool = False):
  """Pure JAX, same signature: both products, then a per-token select (g in M's dtype as
  the kernel takes it, then float32 math at IEEE precision).

  W is (d, O), or (O, d) when w_transposed (a tied LM head reads its table).
  """
  f32 = lambda a: a.astype(jnp.float32)
  O = W.shape[0] if w_transposed else W.shape[1]
  y_fast = jnp.dot(f32(g_TK.astype(M_KO.dtype)), f32(M_KO), precision=PRECISION)[:, :O]
  dims = (((1,), (1,)), ((), ())) if w_transposed else (((1,), (0,)), ((), ()))
  y_slow = lax.dot_general(f32(x_TD), f32(W), dims, precision=PRECISION)
  return jnp.where(fast_T[:, None], y_fast, y_slow).astype(x_TD.dtype)


def _load(ref, index, mask):
  """ref[index], with masked-off lanes read as zero (and not read at all on a GPU)."""
  if mask is None:
    return ref[index]
  return pltriton.load(ref.at[index], mask=mask, other=0)


def _iota(n: int) -> jax.Array:
  return lax.broadcasted_iota(jnp.int32, (n,), 0)


def _mask(rows_ok, cols_ok, shape):
  """A 2-D load mask from optional per-row and per-column masks (None: nothing masked)."""
  masks = [jnp.broadcast_to(m, shape) for m in
           (None if rows_ok is None else rows_ok[:, None],
            None if cols_ok is None else cols_ok[None, :]) if m is not None]
  return None if not masks else masks[0] if len(masks) == 1 else masks[0] & masks[1]


def _kernel(state_ref, x_ref, g_ref, M_ref, W_ref, y_ref, *, lay: tiling.CallLayout,
            w_transposed: bool):
  j, s = pl.program_id(1), pl.program_id(2)
  state = state_ref[...]  # (block_t, 1): FAST, SLOW or PADDING
  bt, bo = lay.block_t, lay.block_o
  cols_ok = (j * bo + _iota(bo) < lay.out) if lay.mask_out else None
  # M padded past out (to a multiple of 64): its columns stay unmasked, so their loads
  # stay vector loads; the padding is zero and its outputs are dropped.
  m_cols_ok = cols_ok if not lay.m_cols else \
      (j * bo + _iota(bo) < lay.m_cols) if lay.mask_m_cols else None
  vector = bt == 1  # one token: multiply and sum; else a tensor-core dot
  acc_shape = (bo,) if vector else (bt, bo)
  zeros = lambda: jnp.zeros(acc_shape, jnp.float32)

  def reduce(a_ref, b_ref, chunk, block, total, masked, b_transposed, cols_ok):
    """Σ over this split's rows r of a[:, r] b[r, :] (b stored (out, rows) if b_transposed)."""
    def body(i, acc):
      r0 = pl.multiple_of(i * block, block)
      rows_ok = (s * chunk + r0 + _iota(block) < total) if masked else None
      if vector:
        a = _load(a_ref, (jnp.int32(0), pl.ds(r0, block)), rows_ok)
      else:
        a = _load(a_ref, (slice(None), pl.ds(r0, block)), _mask(None, rows_ok, (bt, block)))
      if b_transposed:
        b = _load(b_ref, (slice(None), pl.ds(r0, block)), _mask(cols_ok, rows_ok, (bo, block)))
      else:
        b = _load(b_ref, (pl.ds(r0, block), slice(None)), _mask(rows_ok, cols_ok, (block, bo)))
      if vector:
        a32, b32 = a.astype(jnp.float32), b.astype(jnp.float32)
        return acc + (jnp.sum(b32 * a32[None, :], axis=1) if b_transposed
                      else jnp.sum(a32[:, None] * b32, axis=0))
      dtype = jnp.promote_types(a.dtype, b.dtype)
      dims = (((1,), (1,)), ((), ())) if b_transposed else (((1,), (0,)), ((), ()))
      return acc + lax.dot_general(a.astype(dtype), b.astype(dtype), dims,
                                   precision=PRECISION,
                                   preferred_element_type=jnp.float32)
    return lax.fori_loop(0, chunk // block, body, zeros())

  y_fast = lax.cond(jnp.max(state) == FAST,
                    lambda: reduce(g_ref, M_ref, lay.k_chunk, lay.block_k, lay.padded_k,
                                   lay.mask_k, False, m_cols_ok), zeros)
  y_slow = lax.cond(jnp.max(jnp.where(state == SLOW, 1, 0)) == 1,
                    lambda: reduce(x_ref, W_ref, lay.d_chunk, lay.block_d, lay.padded_d,
                                   lay.mask_d, w_transposed, cols_ok), zeros)
  if vector:
    y_fast, y_slow = y_fast[None, :], y_slow[None, :]
  y_ref[...] = jnp.where(state == FAST, y_fast, y_slow).astype(y_ref.dtype)


def _pad(a: jax.Array, shape) -> jax.Array:
  pads = [(0, n - m) for m, n in zip(a.shape, shape)]
  return jnp.pad(a, pads) if any(p for _, p in pads) else a


def gated_matmul_on(platform: str, x_TD, g_TK, fast_T, M_KO, W, *, w_transposed: bool = False,
                    plan: tiling.TilePlan | None = None, interpret: bool = False):
  """The kernel with `platform`'s tile plan (or `plan`), compiled for it or interpreted.

  Returns y (T, O) in x's dtype, O being W's outputs; M may hold zero columns past O (a
  GSI LM head's, padded to a multiple of 64 so that its rows start aligned).
  """
  T, D = x_TD.shape
  K, m_cols = M_KO.shape
  O = W.shape[0] if w_transposed else W.shape[1]
  if m_cols < O:
    raise ValueError(f"M has {m_cols} columns, fewer than W's {O} outputs")
  plan = plan or tiling.plan_for(platform, T)
  lay = tiling.layout(plan, T, D, K, O, m_cols)
  Tp, Dp, Kp, Op = lay.padded_tokens, lay.padded_d, lay.padded_k, lay.padded_out
  state = _pad(jnp.where(fast_T, FAST, SLOW).astype(jnp.int32)[:, None], (Tp, 1))
  state = jnp.where(jnp.arange(Tp)[:, None] < T, state, PADDING)
  x = _pad(x_TD, (Tp, Dp))
  g = _pad(g_TK.astype(M_KO.dtype), (Tp, Kp))  # g M in M's dtype (see PRECISION)
  M = _pad(M_KO, (Kp, max(Op, m_cols)))
  W = _pad(W, (Op, Dp) if w_transposed else (Dp, Op))
  bt, bo = lay.block_t, lay.block_o
  if w_transposed:
    w_spec = pl.BlockSpec((bo, lay.d_chunk), lambda i, j, s: (j, s))
  else:
    w_spec = pl.BlockSpec((lay.d_chunk, bo), lambda i, j, s: (s, j))
  out_cols = lay.out_blocks * bo
  if lay.splits == 1:
    out_shape = jax.ShapeDtypeStruct((Tp, out_cols), x_TD.dtype)
    out_spec = pl.BlockSpec((bt, bo), lambda i, j, s: (i, j))
  else:
    out_shape = jax.ShapeDtypeStruct((lay.splits, Tp, out_cols), jnp.float32)
    out_spec = pl.BlockSpec((None, bt, bo), lambda i, j, s: (s, i, j))
  y = pl.pallas_call(
      functools.partial(_kernel, lay=lay, w_transposed=w_transposed),
      out_shape=out_shape,
      grid=lay.grid,
      in_specs=[pl.BlockSpec((bt, 1), lambda i, j, s: (i, 0)),
                pl.BlockSpec((bt, lay.d_chunk), lambda i, j, s: (i, s)),
                pl.BlockSpec((bt, lay.k_chunk), lambda i, j, s: (i, s)),
                pl.BlockSpec((lay.k_chunk, bo), lambda i, j, s: (s, j)),
                w_spec],
      out_specs=out_spec,
      interpret=interpret,
      compiler_params=None if interpret else tiling.compiler_params(platform, plan),
      name="gsi_gated_matmul",
  )(state, x, g, M, W)
  if lay.splits > 1:
    y = jnp.sum(y, axis=0).astype(x_TD.dtype)
  return y[:T, :O]


@functools.partial(jax.jit, static_argnames=("w_transposed",))
def gated_matmul(x_TD, g_TK, fast_T, M_KO, W, *, w_transposed: bool = False):
  """y (T, O) in x's dtype: g M on fast tokens, x W on slow ones; reads only what they need.

  The kernel is chosen where the program is lowered: compiled Triton on cuda and
  rocm, Mosaic on tpu, the cuda plan in interpret mode on cpu.
  """
  args = (x_TD, g_TK, fast_T, M_KO, W)
  on = lambda platform, interpret=False: lambda *a: gated_matmul_on(
      platform, *a, w_transposed=w_transposed, interpret=interpret)
  return lax.platform_dependent(
      *args, cpu=on(INTERPRETED_PLAN, interpret=True), cuda=on("cuda"), rocm=on("rocm"),
      tpu=on("tpu"))
