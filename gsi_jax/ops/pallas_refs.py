"""What the Pallas kernels (`kernel`, `kept_kernel`) share: masked loads and stores of refs,
their cache hints, and a call's outputs by its layout.

A masked-off lane is not read (it loads as zero) or not written: on a GPU that is what
skips a weight row's bytes or keeps a ragged last block inside its array.  Pallas' Triton
lowering masks no block that overhangs its array, so tokens are padded to whole blocks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from gsi_jax.ops import tiling
from gsi_jax.ops.fused_sum import fused_sum


def iota(n: int) -> jax.Array:
  return lax.broadcasted_iota(jnp.int32, (n,), 0)


def mask(rows_ok, cols_ok, shape):
  """A 2-D mask from optional per-row and per-column masks (None: nothing masked)."""
  masks = [jnp.broadcast_to(m, shape) for m in
           (None if rows_ok is None else rows_ok[:, None],
            None if cols_ok is None else cols_ok[None, :]) if m is not None]
  return None if not masks else masks[0] if len(masks) == 1 else masks[0] & masks[1]


def load(ref, index, lanes_ok, eviction_policy: str | None = None):
  """ref[index], with masked-off lanes read as zero (and not read at all on a GPU);
  eviction_policy ("evict_first", "evict_last" or None) is Triton's cache hint."""
  if lanes_ok is None and eviction_policy is None:
    return ref[index]
  return pltriton.load(ref.at[index], mask=lanes_ok, other=None if lanes_ok is None else 0,
                       eviction_policy=eviction_policy)


def cache_hints(lay: tiling.CallLayout) -> tuple[str | None, str | None]:
  """(weights', activations') eviction policies under the plan: each weight byte is read
  once (evict first), x and g by every program (evict last)."""
  return ("evict_first", "evict_last") if lay.plan.eviction_hints else (None, None)


def store(ref, value, cols_ok):
  """ref[...] = value (block_t, block_o), writing only the columns cols_ok allows (None:
  every column; a last block that ends past the array's columns stores the rest)."""
  if cols_ok is None:
    ref[...] = value
  else:
    pltriton.store(ref.at[:, :], value, mask=jnp.broadcast_to(cols_ok[None, :], value.shape))


def map_block(start: int, blocks: int, shared: bool):
  """A map's own output block for grid column j: j − start, kept in range on the columns
  of other maps when a call is shared (their programs neither read nor write it)."""
  if not shared:
    return lambda j: j
  return lambda j: jnp.clip(j - start, 0, blocks - 1)


def pad(a: jax.Array, shape) -> jax.Array:
  """a zero-padded up to `shape` (no op along an axis where it already has as much)."""
  pads = [(0, max(0, n - m)) for m, n in zip(a.shape, shape)]
  return jnp.pad(a, pads) if any(p for _, p in pads) else a


def outputs(lay: tiling.CallLayout, dtype, blocks):
  """Each map's output and its block spec, `blocks` giving each map's block for grid
  column j: (padded tokens, O) in `dtype`, or float32 partial sums per split."""
  bt, bo, Tp = lay.block_t, lay.block_o, lay.padded_tokens
  if lay.splits == 1:
    return ([jax.ShapeDtypeStruct((Tp, o), dtype) for o in lay.padded_outs],
            [pl.BlockSpec((bt, bo), lambda i, j, s, b=b: (i, b(j))) for b in blocks])
  return ([jax.ShapeDtypeStruct((lay.splits, Tp, o), jnp.float32) for o in lay.padded_outs],
          [pl.BlockSpec((None, bt, bo), lambda i, j, s, b=b: (s, i, b(j))) for b in blocks])


def summed(ys, lay: tiling.CallLayout, dtype) -> list[jax.Array]:
  """`outputs` as (tokens, O) in `dtype`: the splits' partial sums added by XLA in steps
  it fuses into whatever reads them, a residual add or a norm (`fused_sum`), the padding
  cut."""
  ys = [fused_sum(y).astype(dtype) for y in ys] if lay.splits > 1 else list(ys)
  return [y if y.shape == (lay.tokens, o) else y[:lay.tokens, :o]
          for y, o in zip(ys, lay.outs)]
