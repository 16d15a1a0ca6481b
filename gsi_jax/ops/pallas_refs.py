"""Masked loads and stores of Pallas refs, shared by the kernels (`kernel`, `kept_kernel`).

A masked-off lane is not read (it loads as zero) or not written: on a GPU that is what
skips a weight row's bytes or keeps a ragged last block inside its array.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import triton as pltriton


def iota(n: int) -> jax.Array:
  return lax.broadcasted_iota(jnp.int32, (n,), 0)


def mask(rows_ok, cols_ok, shape):
  """A 2-D mask from optional per-row and per-column masks (None: nothing masked)."""
  masks = [jnp.broadcast_to(m, shape) for m in
           (None if rows_ok is None else rows_ok[:, None],
            None if cols_ok is None else cols_ok[None, :]) if m is not None]
  return None if not masks else masks[0] if len(masks) == 1 else masks[0] & masks[1]


def load(ref, index, lanes_ok):
  """ref[index], with masked-off lanes read as zero (and not read at all on a GPU)."""
  if lanes_ok is None:
    return ref[index]
  return pltriton.load(ref.at[index], mask=lanes_ok, other=0)


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
