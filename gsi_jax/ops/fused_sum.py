"""A sum over an array's leading axis that XLA's GPU compiler fuses into what reads it.

XLA emits a reduce as a kernel of its own, and a small one (a column sum of a few rows)
too unless the sum is over one token's values; elementwise adds and slices it fuses into
their consumer at any number of tokens.  So the rows are added in halves: the first half
to the second, then again, log2(n) adds of slices.  Read from the compiled thunks (`make
gpu-launches`): a decode's split sums then fold into its residual add and norm, and a
gate's ‖g‖² into the select that makes the kernel's token states.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def fused_sum(a: jax.Array) -> jax.Array:
  """Σ over axis 0 of `a`, as adds of halves (an odd row left over rides along)."""
  while a.shape[0] > 1:
    half = a.shape[0] // 2
    total = a[:half] + a[half:2 * half]
    a = jnp.concatenate([total, a[2 * half:]]) if a.shape[0] % 2 else total
  return a[0]
