"""The kept-rows products as Pallas kernels, beside their pure-JAX references.

    kept rows:  y_i = (x · keep) W_i  for every map i of a site, W_i stored (d, O_i):
                sparsity (TEAL), its greedy allocation, R-Sparse's kept part, the sparse
                residual's r_S W_S, CATS' down projection;
    kept dots:  y_to = keep_to (W_o · x_t),  W stored (O, d): CATS' up projection.

Any batch: a row of W (kept rows) or of W_OD (kept dots) is loaded only when some token
of the call keeps it, as a masked load, so its bytes are never read, as TEAL's sparse
GEMV does; here one call serves every map of a site, and the batch and decode tile plans
of the gated kernel (`gsi_jax.ops.tiling`) apply: at one token wide output blocks, a
split reduction and a 2-D float32 accumulator summed once after the loop; one block of
up to 64 tokens, so no row is read twice in a call.  Kept rows take x with a mask, or with
the site's threshold (|x| ≥ t kept), which the kernel applies to x itself, so that no XLA
select stands between x's producer and the call; they read the rows where some token's kept
entry is non-zero (a kept entry that is exactly 0 adds nothing).  Each kernel is chosen by
the platform its program is lowered for: Triton on cuda and rocm, the cuda plan in
interpret mode on cpu, and the masked product in XLA on tpu (Mosaic has no masked loads,
so a row cannot be skipped there).
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from gsi_jax.ops import tiling
from gsi_jax.ops.kernel import INTERPRETED_PLAN, PRECISION
from gsi_jax.ops.pallas_refs import (cache_hints, iota, load, map_block, mask, outputs, pad,
                                     store, summed)


def kept_mask(x_TD, keep) -> jax.Array:
  """keep as a (T, d) mask: itself (bool), or |x| ≥ keep where keep is one threshold (a
  scalar, compared in float32, as `sparse_rows.magnitude_keep` compares a model's float32
  thresholds)."""
  keep = jnp.asarray(keep)
  if keep.dtype == jnp.bool_:
    return keep
  if keep.ndim:
    raise ValueError(f"keep is a (T, d) bool mask or one threshold, not {keep.dtype} of "
                     f"shape {keep.shape}")
  return jnp.abs(x_TD.astype(jnp.float32)) >= keep.astype(jnp.float32)


def kept_rows_reference(x_TD, keep, Ws: Sequence[jax.Array]) -> list[jax.Array]:
  """(x · keep) W_i for each W_i (d, O_i), in float32 at IEEE precision; keep a mask or a
  threshold (`kept_mask`)."""
  x = jnp.where(kept_mask(x_TD, keep), x_TD, 0).astype(jnp.float32)
  return [jnp.dot(x, W.astype(jnp.float32), precision=PRECISION).astype(x_TD.dtype)
          for W in Ws]


def kept_dots_reference(x_TD, keep_TO, W_OD) -> jax.Array:
  """keep · (x W_ODᵀ), in float32 at IEEE precision."""
  y = jnp.dot(x_TD.astype(jnp.float32), W_OD.astype(jnp.float32).T, precision=PRECISION)
  return jnp.where(keep_TO, y, 0).astype(x_TD.dtype)


def _any_token(a, vector: bool):
  """Per column of a tile (block_t, n), or per entry of a vector: whether any token's entry
  is non-zero.  (Triton has no reduce_or: a max of 0/1.)"""
  nonzero = jnp.where(a != 0, 1, 0)
  return nonzero == 1 if vector else jnp.max(nonzero, axis=0) == 1


def _x_tile(x_ref, s, c, lay: tiling.CallLayout):
  """Step c of split s over x's columns: (first column, columns inside d or None, the tile
  (block_t, block_d), or (block_d,) for one token)."""
  bd = lay.block_d
  r0 = pl.multiple_of(c * bd, bd)
  ok = (s * lay.d_chunk + r0 + iota(bd) < lay.d) if lay.mask_d else None
  _, activations = cache_hints(lay)
  if lay.block_t == 1:
    return r0, ok, load(x_ref, (jnp.int32(0), pl.ds(r0, bd)), ok, activations)
  return r0, ok, load(x_ref, (slice(None), pl.ds(r0, bd)), mask(None, ok, (lay.block_t, bd)),
                      activations)


def _kept_rows_kernel(x_ref, *refs, lay: tiling.CallLayout, thresholded: bool):
  """One token: a 2-D float32 accumulator (block_d, block_o), summed once after the loop,
  the rows to read being x's non-zero kept entries.  Several tokens: a dot per step, the
  rows to read loaded from refs (any token's kept entry non-zero, found before the call),
  so no step reduces across tokens.  thresholded: the first of refs holds the threshold
  (1, 1), and each tile of x keeps |x| ≥ it; else x comes with its dropped entries zeroed."""
  bt, bo, bd = lay.block_t, lay.block_o, lay.block_d
  vector = bt == 1
  t_ref, refs = (refs[0], refs[1:]) if thresholded else (None, refs)
  t = jnp.max(t_ref[...]) if thresholded else None  # (1, 1): one threshold for the call
  rows_ref, refs = (None, refs) if vector else (refs[0], refs[1:])
  n = len(lay.outs)
  W_refs, y_refs = refs[:n], refs[n:]
  j, s = pl.program_id(1), pl.program_id(2)
  weights, activations = cache_hints(lay)

  def one_map(m):
    cols = (j - lay.map_starts[m]) * bo + iota(bo)
    cols_ok = (cols < lay.outs[m]) if lay.mask_outs[m] else None

    def body(c, acc):
      r0, ok, a = _x_tile(x_ref, s, c, lay)
      if thresholded:
        a = jnp.where(jnp.abs(a.astype(jnp.float32)) >= t, a, jnp.zeros_like(a))
      if vector:
        needed = a != 0  # rows past d load as 0: never needed
      else:
        needed = load(rows_ref, (jnp.int32(0), pl.ds(r0, bd)), ok, activations) != 0
      b = load(W_refs[m], (pl.ds(r0, bd), slice(None)), mask(needed, cols_ok, (bd, bo)),
               weights)
      a = a.astype(b.dtype)
      if vector:
        return acc + a.astype(jnp.float32)[:, None] * b.astype(jnp.float32)
      return acc + lax.dot(a, b, precision=PRECISION, preferred_element_type=jnp.float32)

    acc = lax.fori_loop(0, lay.d_chunk // bd, body,
                        jnp.zeros((bd, bo) if vector else (bt, bo), jnp.float32))
    y = jnp.sum(acc, axis=0)[None, :] if vector else acc
    store(y_refs[m], y.astype(y_refs[m].dtype), cols_ok)

  if n == 1:
    one_map(0)
  for m in range(n if n > 1 else 0):
    start = lay.map_starts[m]
    pl.when((j >= start) & (j < start + lay.map_blocks[m]))(functools.partial(one_map, m))


def _kept_dots_kernel(x_ref, keep_ref, W_ref, y_ref, *, lay: tiling.CallLayout):
  """One token: a 2-D float32 accumulator (block_o, block_d), summed once after the loop."""
  j, s = pl.program_id(1), pl.program_id(2)
  bt, bo, bd = lay.block_t, lay.block_o, lay.block_d
  vector = bt == 1
  weights, _ = cache_hints(lay)
  rows = j * bo + iota(bo)  # rows of W_OD: this block's outputs
  rows_ok = (rows < lay.outs[0]) if lay.mask_outs[0] else None
  if vector:
    keep = load(keep_ref, (jnp.int32(0), slice(None)), rows_ok)
  else:
    keep = load(keep_ref, (slice(None), slice(None)), mask(None, rows_ok, (bt, bo)))
  needed = _any_token(keep, vector)

  def body(c, acc):
    r0, cols_ok, a = _x_tile(x_ref, s, c, lay)
    b = load(W_ref, (slice(None), pl.ds(r0, bd)), mask(needed, cols_ok, (bo, bd)), weights)
    a = a.astype(b.dtype)
    if vector:
      return acc + b.astype(jnp.float32) * a.astype(jnp.float32)[None, :]
    return acc + lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=PRECISION,
                                 preferred_element_type=jnp.float32)

  acc = lax.fori_loop(0, lay.d_chunk // bd, body,
                      jnp.zeros((bo, bd) if vector else (bt, bo), jnp.float32))
  y = jnp.where(keep != 0, jnp.sum(acc, axis=1) if vector else acc, 0)
  store(y_ref, (y[None, :] if vector else y).astype(y_ref.dtype), rows_ok)


def kept_rows_on(platform: str, x_TD, keep, Ws: Sequence[jax.Array], *,
                 plan: tiling.TilePlan | None = None, interpret: bool = False):
  """The kept-rows kernel with `platform`'s tile plan (cuda or rocm), compiled or
  interpreted: [(x · keep) W_i], reading W_i's rows that some token keeps.  keep: a (T, d)
  mask, applied in XLA, or one threshold, which the kernel applies (`kept_mask`)."""
  T, D = x_TD.shape
  outs = tuple(W.shape[1] for W in Ws)
  lay = tiling.layout(plan or tiling.plan_for(platform, T), T, D, 1, outs,
                      itemsize=jnp.dtype(Ws[0].dtype).itemsize)
  blocks = [map_block(start, n, len(Ws) > 1) for start, n in zip(lay.map_starts, lay.map_blocks)]
  out_shapes, out_specs = outputs(lay, x_TD.dtype, blocks)
  thresholded = jnp.asarray(keep).dtype != jnp.bool_
  x_kept = jnp.where(kept_mask(x_TD, keep), x_TD, 0)
  t, t_spec = ([jnp.reshape(jnp.asarray(keep, jnp.float32), (1, 1))],
               [pl.BlockSpec((1, 1), lambda i, j, s: (0, 0))]) if thresholded else ([], [])
  # Several tokens: which rows any token needs, once, before the call (one token reads
  # them off x itself).
  rows, rows_spec = ([], []) if lay.block_t == 1 else (
      [jnp.any(x_kept != 0, axis=0, keepdims=True).astype(jnp.int32)],
      [pl.BlockSpec((1, lay.d_chunk), lambda i, j, s: (0, s))])
  ys = pl.pallas_call(
      functools.partial(_kept_rows_kernel, lay=lay, thresholded=thresholded),
      out_shape=out_shapes, grid=lay.grid,
      in_specs=[pl.BlockSpec((lay.block_t, lay.d_chunk), lambda i, j, s: (i, s)), *t_spec,
                *rows_spec,
                *[pl.BlockSpec((lay.d_chunk, lay.block_o), lambda i, j, s, b=b: (s, b(j)))
                  for b in blocks]],
      out_specs=out_specs, interpret=interpret,
      compiler_params=None if interpret else tiling.compiler_params(platform, lay.plan),
      name="gsi_kept_rows",
  )(pad(x_TD if thresholded else x_kept, (lay.padded_tokens, D)), *t, *rows, *Ws)
  return summed(ys, lay, x_TD.dtype)


def kept_dots_on(platform: str, x_TD, keep_TO, W_OD, *, plan: tiling.TilePlan | None = None,
                 interpret: bool = False):
  """The kept-dots kernel with `platform`'s tile plan, compiled or interpreted:
  keep · (x W_ODᵀ), reading W_OD's rows that some token keeps."""
  T, D = x_TD.shape
  lay = tiling.layout(plan or tiling.plan_for(platform, T), T, D, 1, W_OD.shape[0],
                      itemsize=jnp.dtype(W_OD.dtype).itemsize)
  bt, bo = lay.block_t, lay.block_o
  [out_shape], [out_spec] = outputs(lay, x_TD.dtype, [lambda j: j])
  [y] = pl.pallas_call(
      functools.partial(_kept_dots_kernel, lay=lay),
      out_shape=[out_shape], grid=lay.grid,
      in_specs=[pl.BlockSpec((bt, lay.d_chunk), lambda i, j, s: (i, s)),
                pl.BlockSpec((bt, bo), lambda i, j, s: (i, j)),
                pl.BlockSpec((bo, lay.d_chunk), lambda i, j, s: (j, s))],
      out_specs=[out_spec], interpret=interpret,
      compiler_params=None if interpret else tiling.compiler_params(platform, lay.plan),
      name="gsi_kept_dots",
  )(pad(x_TD, (lay.padded_tokens, D)),
    pad(keep_TO.astype(jnp.int32), (lay.padded_tokens, W_OD.shape[0])), W_OD)
  [y] = summed([y], lay, x_TD.dtype)
  return y


@jax.jit
def kept_rows(x_TD, keep, Ws: Sequence[jax.Array]) -> list[jax.Array]:
  """[(x · keep) W_i] for every map of a site in one call, keep a mask or one threshold
  (`kept_mask`): the kernel on cuda and rocm, the cuda plan interpreted on cpu, XLA's
  masked product on tpu."""
  on = lambda platform, interpret=False: lambda *a: kept_rows_on(platform, *a,
                                                                 interpret=interpret)
  masked = lambda x, keep, Ws: [jnp.where(kept_mask(x, keep), x, 0) @ W for W in Ws]
  return lax.platform_dependent(x_TD, keep, tuple(Ws),
                                cpu=on(INTERPRETED_PLAN, interpret=True), cuda=on("cuda"),
                                rocm=on("rocm"), tpu=masked)


@jax.jit
def kept_dots(x_TD, keep_TO, W_OD) -> jax.Array:
  """keep · (x W_ODᵀ): the kernel on cuda and rocm, the cuda plan interpreted on cpu, XLA's
  masked product on tpu."""
  on = lambda platform, interpret=False: lambda *a: kept_dots_on(platform, *a,
                                                                 interpret=interpret)
  return lax.platform_dependent(x_TD, keep_TO, W_OD, cpu=on(INTERPRETED_PLAN, interpret=True),
                                cuda=on("cuda"), rocm=on("rocm"),
                                tpu=lambda x, keep, W: jnp.where(keep, x @ W.T, 0))
