"""CATS-style sparsity for gated MLPs: the gate's activation decides which channels run.

    a = act(x W_gate),   S = {j : |a_j| ≥ t},   u_S = x W_up[:, S],   z = a_S u_S,
    y = z W_down[S]

W_gate is read whole (it decides S); only the kept columns of W_up and the kept
rows of W_down are read.  Columns of a (d, O) W are scattered in memory, so the
fast path reads W_up stored transposed (O, d): its kept rows (`kept_dots`).  The
down projection reads the rows where z ≠ 0 (`gsi_jax.peers.apply_cats` sets its
input threshold to the smallest positive float, so the rows skipped are exactly
those that would add 0).  Threshold 0 keeps every channel: the dense MLP.
At one token on XLA, W_gate goes through the kept-rows kernel too, every row kept, so the
MLP's three maps run through one kind of product (an XLA dot between the kernel's calls
left both slower per byte in an earlier profile; `decode_dense_equivalents.json` has the
current one).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from gsi_jax.ops import kept_kernel
from gsi_jax.ops.gate import Gate
from gsi_jax.ops.sparse_rows import by_impl, kept_dots, kept_rows_matmul, reads_kept_rows


def cats_gated_linear(x_BTD: jax.Array, W_gate_DF: jax.Array, W_up_DF: jax.Array,
                      W_up_FD: jax.Array, threshold: jax.Array,
                      act: Callable[[jax.Array], jax.Array],
                      gate: Gate | None) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(x W_gate, x W_up with the dropped channels zeroed, the kept mask (B, T, F)).
  W_up_FD is W_up transposed: through the Pallas kernel (`by_impl`) only the rows some
  token keeps are read, at any batch; on XLA, at batch 1 under gate.batch1_switch only
  its kept rows, elsewhere the masked product reads W_up_DF."""
  def gate_xla():  # one token: W_gate through the same kernel, every row kept (see the module)
    if reads_kept_rows(x_BTD, gate):
      every_row_D = jnp.ones(x_BTD.shape[-1:], bool)
      return kept_rows_matmul(x_BTD.reshape(-1), every_row_D, [W_gate_DF])[0].reshape(1, 1, -1)
    return x_BTD @ W_gate_DF

  gate_BTF = by_impl(gate, lambda: x_BTD @ W_gate_DF, gate_xla)
  keep_BTF = jnp.abs(act(gate_BTF)) >= threshold
  d, f = x_BTD.shape[-1], keep_BTF.shape[-1]

  def kernel():
    return kept_kernel.kept_dots(x_BTD.reshape(-1, d), keep_BTF.reshape(-1, f),
                                 W_up_FD).reshape(keep_BTF.shape)

  def xla():
    if reads_kept_rows(x_BTD, gate):
      return kept_dots(x_BTD.reshape(-1), keep_BTF.reshape(-1), W_up_FD).reshape(1, 1, -1)
    return jnp.where(keep_BTF, x_BTD @ W_up_DF, 0)

  return gate_BTF, by_impl(gate, kernel, xla), keep_BTF
