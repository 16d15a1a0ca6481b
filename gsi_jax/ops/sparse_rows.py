"""Magnitude sparsity's batch-1 fast path: read only the rows of W for the kept inputs.

    y = Σ_{i kept} x_i W_i   (W stored (d, O), so row i is what input i multiplies)

XLA needs static shapes, so the kept indices are gathered into one of a few
bucket sizes: a lax.switch picks the smallest bucket that holds every kept
input, and the unused slots are padded with zero inputs.  The result is then
exactly the masked product x·[|x| ≥ t] W, with rows read in proportion to the
bucket (at most 1/n_buckets of d more than the kept count).
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
from jax import lax

N_BUCKETS = 8


def bucket_sizes(d: int, n_buckets: int = N_BUCKETS) -> tuple[int, ...]:
  """Ascending gather sizes, the last one d: ceil(d j / n) for j = 1..n."""
  return tuple(sorted({-(-d * j // n_buckets) for j in range(1, n_buckets + 1)}))


def kept_rows_matmul(x_D: jax.Array, keep_D: jax.Array, Ws: Sequence[jax.Array],
                     n_buckets: int = N_BUCKETS) -> list[jax.Array]:
  """x·keep @ W for each W (d, O), reading only ~the kept rows; one token (x_D: (d,))."""
  d = x_D.shape[0]
  sizes = bucket_sizes(d, n_buckets)
  count = jnp.sum(keep_D, dtype=jnp.int32)

  def gathered(size):
    def run():
      idx = jnp.nonzero(keep_D, size=size, fill_value=0)[0]
      x_S = jnp.where(jnp.arange(size) < count, x_D[idx], 0)
      return [x_S @ W[idx] for W in Ws]
    return run

  branch = jnp.searchsorted(jnp.asarray(sizes), count)  # the first size >= count
  return lax.switch(branch, [gathered(s) for s in sizes])
