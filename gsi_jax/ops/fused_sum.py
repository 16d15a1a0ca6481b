"""A sum over an array's leading axis that XLA's GPU compiler fuses into what reads it.

XLA emits a reduce as a kernel of its own; elementwise adds it fuses into their consumer.
So up to TERMS rows are added one by one, and a longer axis is first cut by column sums of
STEP rows (a column reduction of fewer than 32 rows, which XLA also computes elementwise).
Read from the compiled thunks (`make gpu-launches`): a decode's split sums then fold into
its residual add and norm, and a gate's ‖g‖² into its select.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

TERMS = 64  # rows added one by one: a decode call's most splits
STEP = 16  # rows a column sum takes at once, under XLA's 32 for an elementwise one


def fused_sum(a: jax.Array) -> jax.Array:
  """Σ over axis 0 of `a`: column sums of STEP rows while more than TERMS remain (and STEP
  divides them), then the rest term by term."""
  while a.shape[0] > TERMS and a.shape[0] % STEP == 0:
    a = jnp.sum(a.reshape((STEP, a.shape[0] // STEP) + a.shape[1:]), 0)
  total = a[0]
  for row in range(1, a.shape[0]):
    total = total + a[row]
  return total
