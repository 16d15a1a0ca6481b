"""The gated matrix product of one site as a Pallas kernel, beside its pure-JAX reference.

    fast_t = ‖x_t‖² − ‖g_t‖² < ε² ‖x_t‖²,   y_it = g_t M_i  where token t is fast,
                                           y_it = x_t W_i  where it is slow,

for every map i of a site (q, k and v; gate and up), which share x and g.  g = x V_k
and the gate are computed before the kernel, once per token, by XLA beside the
product: from x padded to the kernel's tokens once, where a decode passes V_kᵀ
(`gated_matmul_from_basis`), or by the caller (`gated_matmul`, given g, as
`gsi_jax.ops.gated_linear` does outside a decode); the kernel reads one decision per token
(FAST, SLOW or PADDING) and never walks x or g for it.  A program owns block_t
tokens × block_o outputs of one map × one split of the reduction, loops over its
split in tiles (block_k rows of M, block_d rows of W), and reads M's tiles only
when one of its tokens is fast and W's only when one is slow (`lax.cond`), so
padded tokens never cause a read.  At one token a tile's products are added into
a 2-D float32 accumulator and reduced once after the loop, so the loop holds
loads and multiply-adds only.  `gsi_jax.ops.tiling` holds the tile plans, one
table per platform, and the byte and bandwidth models.

`gated_matmul` picks the kernel by the platform it is lowered for
(`lax.platform_dependent`), not by the machine it is traced on: Triton on cuda and
rocm, Mosaic on tpu, and interpret mode of the cuda plan on cpu, so the tests here
run the tiles a GPU runs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from gsi_jax.ops import tiling
from gsi_jax.ops.gate import energy_gate, gate_mask, project_rows
from gsi_jax.ops.pallas_refs import (cache_hints, iota, load, map_block, mask, outputs, pad,
                                     store, summed)

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


def decide(x_TD, g_TK, eps) -> jax.Array:
  """Each token's path: eps itself where it is the decision (bool, (T,) or one for all:
  a mode that decided in XLA, which then costs no norm and no select), else ρ < ε."""
  eps = jnp.asarray(eps)
  if eps.dtype == jnp.bool_:
    return jnp.broadcast_to(eps, x_TD.shape[:1])
  return gate_mask(x_TD, g_TK, eps.astype(jnp.float32))


def gated_matmul_reference(x_TD, g_TK, eps, Ms, Ws, *, w_transposed: bool = False):
  """Pure JAX, same signature: the gate (`gate_mask`), both products of every map, then
  a per-token select (g in M's dtype as the kernel takes it, then float32 math at IEEE
  precision).  Returns ([y_i (T, O_i)], fast_T).

  eps: a threshold, one per token (T,), or the decision (bool: fast where True, `decide`).
  W is (d, O), or (O, d) when w_transposed (a tied LM head reads its table); M may hold
  zero columns past W's outputs.
  """
  f32 = lambda a: a.astype(jnp.float32)
  g_TK = g_TK[:, :Ms[0].shape[0]]  # columns past k are not read (`gated_matmul_on`)
  fast_T = decide(x_TD, g_TK, eps)
  dims = (((1,), (1,)), ((), ())) if w_transposed else (((1,), (0,)), ((), ()))
  ys = []
  for M, W in zip(Ms, Ws):
    O = W.shape[0] if w_transposed else W.shape[1]
    y_fast = jnp.dot(f32(g_TK.astype(M.dtype)), f32(M), precision=PRECISION)[:, :O]
    y_slow = lax.dot_general(f32(x_TD), f32(W), dims, precision=PRECISION)
    ys.append(jnp.where(fast_T[:, None], y_fast, y_slow).astype(x_TD.dtype))
  return ys, fast_T


def token_states(fast_T, tokens: int, padded_tokens: int) -> jax.Array:
  """(padded_tokens, 1) int32: FAST or SLOW for the call's first `tokens` tokens, PADDING
  past them (fast_T may hold the padded rows already: a decision made on padded x)."""
  fast_P = jnp.pad(fast_T, (0, padded_tokens - fast_T.shape[0]))
  row_P = lax.broadcasted_iota(jnp.int32, (padded_tokens,), 0)
  state = jnp.where(row_P < tokens, jnp.where(fast_P, FAST, SLOW), PADDING)
  return state.astype(jnp.int32)[:, None]


def split_product(a_ref, b_ref, *, steps: int, block: int, rows_ok, lay: tiling.CallLayout,
                  b_transposed: bool = False, b_ok=None):
  """Σ over this split's rows r of a[:, r] b[r, :], in float32: (block_o,) at one token,
  else (block_t, block_o).  b is W or M (stored (out, rows) if b_transposed), a is x or g,
  taken in b's dtype.  rows_ok(r0): the step's rows inside the array, or None; b_ok: its
  outputs inside the array, or None.

  One token: each step multiplies a tile into a 2-D float32 accumulator, reduced once
  after the loop, so no step waits on a cross-lane reduction; several tokens: a
  tensor-core dot per step, which the plan's num_stages pipelines."""
  bt, bo = lay.block_t, lay.block_o
  vector = bt == 1
  weights, activations = cache_hints(lay)
  acc_shape = ((bo, block) if b_transposed else (block, bo)) if vector else (bt, bo)

  def body(c, acc):
    r0 = pl.multiple_of(c * block, block)
    ok = rows_ok(r0)
    if vector:
      a = load(a_ref, (jnp.int32(0), pl.ds(r0, block)), ok, activations)
    else:
      a = load(a_ref, (slice(None), pl.ds(r0, block)), mask(None, ok, (bt, block)), activations)
    if b_transposed:
      b = load(b_ref, (slice(None), pl.ds(r0, block)), mask(b_ok, ok, (bo, block)), weights)
    else:
      b = load(b_ref, (pl.ds(r0, block), slice(None)), mask(ok, b_ok, (block, bo)), weights)
    a = a.astype(b.dtype)
    if vector:
      a32, b32 = a.astype(jnp.float32), b.astype(jnp.float32)
      return acc + (b32 * a32[None, :] if b_transposed else a32[:, None] * b32)
    dims = (((1,), (1,)), ((), ())) if b_transposed else (((1,), (0,)), ((), ()))
    return acc + lax.dot_general(a, b, dims, precision=PRECISION,
                                 preferred_element_type=jnp.float32)

  acc = lax.fori_loop(0, steps, body, jnp.zeros(acc_shape, jnp.float32))
  return jnp.sum(acc, axis=1 if b_transposed else 0) if vector else acc


def _kernel(state_ref, x_ref, g_ref, *refs, lay: tiling.CallLayout, w_transposed: bool):
  n = len(lay.outs)
  M_refs, W_refs, y_refs = refs[:n], refs[n:2 * n], refs[2 * n:]
  j, s = pl.program_id(1), pl.program_id(2)
  state = state_ref[...]  # (block_t, 1): one decision per token, made before the call
  bt, bo = lay.block_t, lay.block_o
  vector = bt == 1
  zeros = lambda: jnp.zeros((bo,) if vector else (bt, bo), jnp.float32)
  d_rows = lambda r0: (s * lay.d_chunk + r0 + iota(lay.block_d) < lay.padded_d) \
      if lay.mask_d else None
  k_rows = lambda r0: (s * lay.k_chunk + r0 + iota(lay.block_k) < lay.padded_k) \
      if lay.mask_k else None
  any_fast = (jnp.max(state) == FAST) & (s * lay.k_chunk < lay.padded_k)
  any_slow = jnp.max(jnp.where(state == SLOW, 1, 0)) == 1

  def one_map(m):
    """Map m's block j − start: its M and W tiles, its output."""
    cols = (j - lay.map_starts[m]) * bo + iota(bo)
    cols_ok = (cols < lay.padded_outs[m]) if lay.mask_outs[m] else None
    # M padded past out (to a multiple of 64): its columns stay unmasked, so their loads
    # stay vector loads; the padding is zero and its outputs are dropped.
    m_cols_ok = cols_ok if not lay.m_cols[m] else \
        (cols < lay.m_cols[m]) if lay.mask_m_cols[m] else None
    y_fast = lax.cond(any_fast, lambda: split_product(
        g_ref, M_refs[m], steps=lay.k_chunk // lay.block_k, block=lay.block_k,
        rows_ok=k_rows, lay=lay, b_ok=m_cols_ok), zeros)
    y_slow = lax.cond(any_slow, lambda: split_product(
        x_ref, W_refs[m], steps=lay.d_chunk // lay.block_d, block=lay.block_d,
        rows_ok=d_rows, lay=lay, b_transposed=w_transposed, b_ok=cols_ok), zeros)
    if vector:
      y_fast, y_slow = y_fast[None, :], y_slow[None, :]
    store(y_refs[m], jnp.where(state == FAST, y_fast, y_slow).astype(y_refs[m].dtype), cols_ok)

  if n == 1:
    one_map(0)
  for m in range(n if n > 1 else 0):
    start = lay.map_starts[m]
    pl.when((j >= start) & (j < start + lay.map_blocks[m]))(functools.partial(one_map, m))


def _site_layout(platform: str, T: int, D: int, K: int, Ms, Ws, w_transposed: bool,
                 plan: tiling.TilePlan | None) -> tiling.CallLayout:
  """`platform`'s plan (or `plan`) fitted to a call of T tokens, after checking each M
  serves its map at rank K."""
  outs = tuple(W.shape[0] if w_transposed else W.shape[1] for W in Ws)
  for M, out in zip(Ms, outs):
    if M.shape[0] != K or M.shape[1] < out:
      raise ValueError(f"M of shape {M.shape} does not serve a map of {out} outputs at "
                       f"rank {K}")
  plan = plan or tiling.plan_for(platform, T)
  return tiling.layout(plan, T, D, K, outs, tuple(M.shape[1] for M in Ms),
                       jnp.dtype(Ws[0].dtype).itemsize)


def _launch(platform: str, lay: tiling.CallLayout, states, x, g, Ms, Ws, dtype, *,
            w_transposed: bool, interpret: bool) -> list[jax.Array]:
  """The pallas_call on padded x and g, the token states made: [y_i (T, O_i)] in dtype."""
  Kp, Dp = lay.padded_k, lay.padded_d
  Ms = [pad(M, (Kp, max(o, M.shape[1]))) for M, o in zip(Ms, lay.padded_outs)]
  Ws = [pad(W, (o, Dp) if w_transposed else (Dp, o)) for W, o in zip(Ws, lay.padded_outs)]
  bt, bo = lay.block_t, lay.block_o
  blocks = [map_block(start, n, len(Ws) > 1) for start, n in zip(lay.map_starts, lay.map_blocks)]
  if w_transposed:
    w_specs = [pl.BlockSpec((bo, lay.d_chunk), lambda i, j, s, b=b: (b(j), s)) for b in blocks]
  else:
    w_specs = [pl.BlockSpec((lay.d_chunk, bo), lambda i, j, s, b=b: (s, b(j))) for b in blocks]
  m_specs = [pl.BlockSpec((lay.k_chunk, bo), lambda i, j, s, b=b: (s, b(j))) for b in blocks]
  out_shapes, out_specs = outputs(lay, dtype, blocks)
  ys = pl.pallas_call(
      functools.partial(_kernel, lay=lay, w_transposed=w_transposed),
      out_shape=out_shapes,
      grid=lay.grid,
      in_specs=[pl.BlockSpec((bt, 1), lambda i, j, s: (i, 0)),
                pl.BlockSpec((bt, lay.d_chunk), lambda i, j, s: (i, s)),
                pl.BlockSpec((bt, lay.k_chunk), lambda i, j, s: (i, s)),
                *m_specs, *w_specs],
      out_specs=out_specs,
      interpret=interpret,
      compiler_params=None if interpret else tiling.compiler_params(platform, lay.plan),
      name="gsi_gated_matmul",
  )(states, x, g, *Ms, *Ws)
  return summed(ys, lay, dtype)


def gated_matmul_on(platform: str, x_TD, g_TK, eps, Ms, Ws, *, w_transposed: bool = False,
                    plan: tiling.TilePlan | None = None, interpret: bool = False):
  """The kernel with `platform`'s tile plan (or `plan`), compiled for it or interpreted.

  Returns ([y_i (T, O_i)] in x's dtype, fast_T), O_i being W_i's outputs; an M may hold
  zero columns past them (a GSI LM head's, padded to a multiple of 64 so that its rows
  start aligned).  eps: a threshold, one per token (T,), or the decision (bool, `decide`).
  g_TK may hold columns past M's k rows, which are not read (a plain gate's ‖x‖² rides in
  its last, `gated_linear.project_with_energy`); with a threshold it must have k.
  """
  T, D = x_TD.shape
  lay = _site_layout(platform, T, D, Ms[0].shape[0], Ms, Ws, w_transposed, plan)
  Tp = lay.padded_tokens
  fast_T = decide(x_TD, g_TK, eps)
  x, g = pad(x_TD, (Tp, lay.padded_d)), pad(g_TK, (Tp, lay.padded_k))
  ys = _launch(platform, lay, token_states(fast_T, T, Tp), x, g, Ms, Ws, x_TD.dtype,
               w_transposed=w_transposed, interpret=interpret)
  return ys, fast_T


def decide_on_padded(x_PD, V_KD, eps, *, fused: bool) -> tuple[jax.Array, jax.Array]:
  """(g, fast) for x already padded to the call's tokens (P rows), g from V_kᵀ in one row
  reduction (`project_rows`).  A decision given (bool) is taken as it is, and g is k
  columns; a threshold is read against ‖x‖², which rides in g's (k+1)-th column
  (`energy_gate`, fused where the call is compiled)."""
  P = x_PD.shape[0]
  eps = jnp.asarray(eps)
  if eps.ndim:  # one per token: padded as x is (a padded token is neither fast nor slow)
    eps = pad(eps, (P,))
  if eps.dtype == jnp.bool_:
    return project_rows(x_PD, V_KD), jnp.broadcast_to(eps, (P,))
  gx = project_rows(x_PD, V_KD, with_energy=True)
  return gx, energy_gate(gx, eps.astype(jnp.float32), fused=fused)


def gated_matmul_from_basis_on(platform: str, x_TD, V_KD, eps, Ms, Ws, *,
                               w_transposed: bool = False, plan: tiling.TilePlan | None = None,
                               interpret: bool = False):
  """`gated_matmul_on` with g = x V_k made inside the call from V_kᵀ (k, d): x is padded to
  the plan's tokens once, and g (and the gate, `decide_on_padded`) computed from the padded
  x, so neither x nor g is padded apart from what g's reduction reads.  Same returns."""
  T, D = x_TD.shape
  K = V_KD.shape[0]
  lay = _site_layout(platform, T, D, K, Ms, Ws, w_transposed, plan)
  Tp, Dp = lay.padded_tokens, lay.padded_d
  x = pad(x_TD, (Tp, Dp))
  g, fast_P = decide_on_padded(x, pad(V_KD, (K, Dp)), eps, fused=not interpret)
  if lay.plan.pad_inputs:  # whole k blocks, and no ‖x‖² column among them
    g = pad(g[:, :K], (Tp, lay.padded_k))
  ys = _launch(platform, lay, token_states(fast_P, T, Tp), x, g, Ms, Ws, x_TD.dtype,
               w_transposed=w_transposed, interpret=interpret)
  return ys, fast_P[:T]


def gated_matmul_from_basis_reference(x_TD, V_KD, eps, Ms, Ws, *, w_transposed: bool = False):
  """Pure JAX, same signature: g = x V_k in float32 at IEEE precision, then
  `gated_matmul_reference`."""
  g_TK = jnp.dot(x_TD.astype(jnp.float32), V_KD.astype(jnp.float32).T, precision=PRECISION)
  return gated_matmul_reference(x_TD, g_TK, eps, Ms, Ws, w_transposed=w_transposed)


def _on_the_lowering_platform(call, args, w_transposed: bool):
  """`call` (a `*_on` function) for the platform the program is lowered for."""
  on = lambda platform, interpret=False: lambda *a: call(
      platform, *a, w_transposed=w_transposed, interpret=interpret)
  return lax.platform_dependent(
      *args, cpu=on(INTERPRETED_PLAN, interpret=True), cuda=on("cuda"), rocm=on("rocm"),
      tpu=on("tpu"))


@functools.partial(jax.jit, static_argnames=("w_transposed",))
def gated_matmul(x_TD, g_TK, eps, Ms, Ws, *, w_transposed: bool = False):
  """([y_i (T, O_i)], fast_T): g M_i on fast tokens, x W_i on slow ones, for every map of
  a site in one call, reading only what the tokens need; the gate is decided once per
  token before the call.

  The kernel is chosen where the program is lowered: compiled Triton on cuda and
  rocm, Mosaic on tpu, the cuda plan in interpret mode on cpu.
  """
  return _on_the_lowering_platform(gated_matmul_on, (x_TD, g_TK, eps, tuple(Ms), tuple(Ws)),
                                   w_transposed)


@functools.partial(jax.jit, static_argnames=("w_transposed",))
def gated_matmul_from_basis(x_TD, V_KD, eps, Ms, Ws, *, w_transposed: bool = False):
  """`gated_matmul` taking V_kᵀ (k, d) instead of g: what a decode calls, g and the gate
  made on x padded once (`gated_matmul_from_basis_on`)."""
  return _on_the_lowering_platform(gated_matmul_from_basis_on,
                                   (x_TD, V_KD, eps, tuple(Ms), tuple(Ws)), w_transposed)
