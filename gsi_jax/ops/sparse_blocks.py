"""Block sparsity's batch-1 fast path: skip whole row blocks of W, each its own buffer.

    y = Σ_{blocks b kept} x_b W_b,   x_b, W_b: the b-th run of `block` input channels

XLA's CPU backend copies any slice of W (static, dynamic or gathered) into a new
buffer before its dot, so a kept-rows product reads the kept rows, writes them
and reads them again (benchmarks/sparse_rows.py measures the cost).  Here every
block is a separate array, and a lax.cond per block runs its dot or skips it:
a skipped block is never read.  The channels are first permuted (`order`) so
that channels of like magnitude share a block and the small ones are dropped
together.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
from jax import lax


def block_scores(x_BTD: jax.Array, block: int) -> jax.Array:
  """‖x_b‖ per block of `block` consecutive channels: (B, T, d / block), float32."""
  x = x_BTD.astype(jnp.float32)
  return jnp.sqrt(jnp.sum(jnp.square(x.reshape(*x.shape[:-1], -1, block)), -1))


def kept_blocks_matmul(x_D: jax.Array, keep_N: jax.Array,
                       blocks: Sequence[Sequence[jax.Array]]) -> list[jax.Array]:
  """Σ over kept blocks of x_b W_b for each map, one token (x_D: (d,), already in
  block order); blocks[m][b] is map m's rows of block b, (block, O)."""
  n = keep_N.shape[0]
  block = x_D.shape[0] // n
  outs = []
  for W_blocks in blocks:
    y = jnp.zeros(W_blocks[0].shape[1], W_blocks[0].dtype)
    for b, W_b in enumerate(W_blocks):
      x_b = x_D[b * block:(b + 1) * block]
      y = y + lax.cond(keep_N[b], lambda x_b=x_b, W_b=W_b: x_b @ W_b,
                       lambda W_b=W_b: jnp.zeros(W_b.shape[1], W_b.dtype))
    outs.append(y)
  return outs
