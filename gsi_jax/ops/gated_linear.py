"""The one gated-linear operation: every GSI site and a GSI LM head call `gated_linear`.

A site is the set of maps that read one input (q, k and v read the same normed
hidden state), so g = x V_k and the gate are computed once per site:

    g = x V_k,   fast = ρ < ε,   y_i = g M_i on fast tokens, x W_i on slow ones,

with kernels stored (d, O) as x @ W, so M_i = V_kᵀ W_i (the transpose of the
paper's W V_k for y = W x).  `gate.impl` picks how the bytes are skipped:
  "xla": a masked select (both branches computed), or with gate.batch1_switch
         a three-way lax.switch on the call's gate pattern, which at one token
         per call reads V_k and M, or V_k and W; at ε ≤ 0, where the gate cannot
         fire, a lax.cond on ε reads W alone (so ε = 0 costs what dense does), a
         branch a decode skips where it knows every ε > 0 (`Gate.eps_positive`),
         and does not reach at ε ≤ 0 (dense's program, `models.model.decode_gate`);
  "pallas": `gsi_jax.ops.kernel.gated_matmul`, one call for every map of the
         site, which takes the gate's decision per token (made by XLA from x and
         g) and reads M's or W's tiles only for the tokens that need them
         (compiled on cuda, rocm and tpu, interpreted on cpu); in a decode, which
         lays out V_kᵀ, the call makes g and the decision itself from x padded
         once (`kernel.gated_matmul_from_basis`); at ε ≤ 0 the same lax.cond
         reads W alone;
  "auto" (the default): "pallas" where the program is lowered for a GPU or TPU, "xla" on cpu
         (`lax.platform_dependent`: the choice follows the lowering platform,
         not the machine that traces).  The rank ladder and the output-aware
         gate decide each token in XLA first; the kernel then takes that decision
         as it is (`kernel.decide`), with no norm computed again.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from gsi_jax.errors import GSIError
from gsi_jax.ops import kernel
from gsi_jax.ops.gate import (Gate, coin_fast, energy, energy_gate, gate_mask, ladder_ranks,
                              output_gate_mask, project_rows, soft_fast, straight_through)


class GatedWeights(NamedTuple):
  """One site's weights: per map W (d, O) and M (k, O), and the shared basis V (d, k).

  W_transposed: W is stored (O, d) (a tied LM head reads the embedding table).
  V_T: V transposed (k, d), where a decode laid it out (`models.params.with_transposed_bases`):
  a program lowered for a GPU or TPU then computes g from it (`project`).
  sketch (C_DS, D_KS): the output-aware gate; rungs (R,) int: the rank ladder.
  """
  W: Sequence[jax.Array]
  V: jax.Array
  M: Sequence[jax.Array]
  sketch: tuple[jax.Array, jax.Array] | None = None
  rungs: jax.Array | None = None
  W_transposed: bool = False
  V_T: jax.Array | None = None


def project(x_BTD: jax.Array, weights: GatedWeights) -> jax.Array:
  """g = x V_k in x's dtype: from V_T (`project_rows`: one row reduction, where over V_k's
  own (d, k) columns XLA's GPU compiler makes a multiply writing x·V_k and a column reduce)
  where a decode laid it out and the program is lowered for a GPU or TPU; cpu keeps V."""
  if weights.V_T is None:
    return x_BTD @ weights.V
  return lax.platform_dependent(
      x_BTD, weights.V, weights.V_T, cpu=lambda x, V, V_KD: x @ V,
      default=lambda x, V, V_KD: project_rows(x, V_KD).astype(x.dtype))


def project_with_energy(x_BTD: jax.Array, weights: GatedWeights) -> jax.Array:
  """(…, k + 1) float32: g = x V_k in the first k columns and ‖x‖² in the last.  With V_T,
  lowered for a GPU or TPU, one row reduction leaves them so (`project_rows`); on cpu,
  `project` and `energy` side by side."""
  def apart(x, V, V_KD):
    return jnp.concatenate([(x @ V).astype(jnp.float32), energy(x)[..., None]], -1)
  return lax.platform_dependent(
      x_BTD, weights.V, weights.V_T, cpu=apart,
      default=lambda x, V, V_KD: project_rows(x, V_KD, with_energy=True))


def plain_gate(x_BTD: jax.Array, weights: GatedWeights, eps):
  """(g, ρ < ε per token) on the xla path: `gate_mask`'s decision.  In a decode (V_T) at one
  token, g holds ‖x‖² as a last column (`project_with_energy`: one reduction gives both),
  which the caller drops, and the gate is read from it (`energy_gate`): ‖g‖² in steps XLA
  fuses into the select where the program is lowered for a GPU or TPU, a reduce on cpu, so
  its numbers are `gate_mask`'s."""
  if weights.V_T is None or math.prod(x_BTD.shape[:-1]) != 1:
    g_BTK = project(x_BTD, weights)
    return g_BTK, gate_mask(x_BTD, g_BTK, eps)
  gx = project_with_energy(x_BTD, weights)
  return gx, lax.platform_dependent(gx, cpu=lambda gx: energy_gate(gx, eps, fused=False),
                                    default=lambda gx: energy_gate(gx, eps, fused=True))


def dense_matmul(x_BTD: jax.Array, W: jax.Array, W_transposed: bool = False) -> jax.Array:
  """x W for W stored (d, O), or x Wᵀ for W stored (O, d)."""
  return x_BTD @ (W.T if W_transposed else W)


def fast_matmul(g_BTK: jax.Array, M: jax.Array, W: jax.Array, W_transposed: bool = False):
  """g M on W's O outputs: a GSI LM head's M holds zero columns past them (padded to a
  multiple of 64 at calibration, `gsi_jax.gsi.head`), dropped after the product."""
  out = W.shape[0] if W_transposed else W.shape[1]
  y = g_BTK @ M
  return y if M.shape[1] == out else y[..., :out]


def _pallas(x_BTD, g_BTK, eps, weights: GatedWeights):
  """Every map of the site in one kernel call, the gate decided per token before it."""
  lead = x_BTD.shape[:-1]
  x_TD, g_TK = x_BTD.reshape(-1, x_BTD.shape[-1]), g_BTK.reshape(-1, g_BTK.shape[-1])
  ys, fast_T = kernel.gated_matmul(x_TD, g_TK, eps, weights.M, weights.W,
                                   w_transposed=weights.W_transposed)
  return [y.reshape(*lead, -1) for y in ys], fast_T.reshape(lead)


def _pallas_from_basis(x_BTD, eps, weights: GatedWeights):
  """`_pallas` with g made inside the call from V_kᵀ, on x padded to the kernel's tokens once
  (`kernel.gated_matmul_from_basis`)."""
  lead = x_BTD.shape[:-1]
  ys, fast_T = kernel.gated_matmul_from_basis(
      x_BTD.reshape(-1, x_BTD.shape[-1]), weights.V_T, eps, weights.M, weights.W,
      w_transposed=weights.W_transposed)
  return [y.reshape(*lead, -1) for y in ys], fast_T.reshape(lead)


def gated_linear(x_BTD: jax.Array, weights: GatedWeights, eps: jax.Array, gate: Gate):
  """Outputs per map (in weights.W's order), the fast mask (B, T) and the V_k columns
  each token read (B, T): k, the ladder rung it stopped at, or 0 where the xla path
  skipped V_k (ε ≤ 0).  In mode "soft" the mask is the hard one forward and
  `soft_fast`'s backward (a float), and the outputs mix both products by it."""
  g_BTK = project(x_BTD, weights)
  k = weights.V.shape[1]
  rank_BT = jnp.full(x_BTD.shape[:-1], k, jnp.int32)
  if gate.mode == "soft":
    if weights.rungs is not None or weights.sketch is not None:
      raise GSIError("the soft gate learns the plain ρ < ε gate only")
    hard_BT = gate_mask(x_BTD, g_BTK, eps)
    w_BT1 = straight_through(hard_BT, soft_fast(x_BTD, g_BTK, eps))[..., None]
    ys = [w_BT1 * fast_matmul(g_BTK, M, W, weights.W_transposed)
          + (1 - w_BT1) * dense_matmul(x_BTD, W, weights.W_transposed)
          for W, M in zip(weights.W, weights.M)]
    return ys, w_BT1[..., 0], rank_BT
  # A decode (V_T) whose gate needs no g from XLA has the kernel's call make g from V_kᵀ.
  from_basis = weights.V_T is not None and weights.rungs is None and weights.sketch is None
  fast_BT = None  # the plain gate: decided by the path below
  if gate.mode == "static":
    fast_BT = jnp.ones(x_BTD.shape[:-1], bool)
  elif gate.mode == "coin":
    fast_BT = coin_fast(x_BTD, eps)
  elif weights.rungs is not None:
    fast_BT, rank_BT = ladder_ranks(x_BTD, g_BTK, weights.rungs, eps)
    column_BTK = lax.broadcasted_iota(jnp.int32, g_BTK.shape, g_BTK.ndim - 1)
    g_BTK = jnp.where(column_BTK < rank_BT[..., None], g_BTK, 0)
  elif weights.sketch is not None:
    fast_BT = output_gate_mask(x_BTD, g_BTK, *weights.sketch, eps)

  def never_fast():  # the plain gate at ε ≤ 0: no token can be fast, so V_k is not read
    lead = x_BTD.shape[:-1]
    return ([dense_matmul(x_BTD, W, weights.W_transposed) for W in weights.W],
            jnp.zeros(lead, bool), jnp.zeros(lead, jnp.int32))

  def xla():
    if fast_BT is not None:  # decided above
      return _xla(x_BTD, g_BTK, fast_BT, weights, gate), fast_BT, rank_BT

    def gated():  # g inside the branch, so ε ≤ 0 skips it (the g above is then unused)
      g, fast = plain_gate(x_BTD, weights, eps)  # a decode's g holds ‖x‖² past k columns
      g = g[..., :k].astype(x_BTD.dtype)
      return _xla(x_BTD, g, fast, weights, gate), fast, rank_BT
    return gated() if gate.eps_positive else lax.cond(jnp.all(eps > 0), gated, never_fast)

  def pallas():
    if fast_BT is not None and not from_basis:
      # decided in XLA from g (ladder, sketch): the decision goes to the kernel as it is,
      # so no norm or select is computed again
      ys, _ = _pallas(x_BTD, g_BTK, fast_BT.reshape(-1), weights)
      return ys, fast_BT, rank_BT
    if fast_BT is not None:  # static (a constant) or coin, in a decode
      ys, _ = _pallas_from_basis(x_BTD, fast_BT.reshape(-1), weights)
      return ys, fast_BT, rank_BT

    def gated():  # g inside the branch, as on the xla path
      if from_basis:
        return (*_pallas_from_basis(x_BTD, eps, weights), rank_BT)
      return (*_pallas(x_BTD, project(x_BTD, weights), eps, weights), rank_BT)
    return gated() if gate.eps_positive else lax.cond(jnp.all(eps > 0), gated, never_fast)

  if gate.impl == "pallas":
    return pallas()
  if gate.impl == "auto":
    return lax.platform_dependent(cpu=xla, default=pallas)
  return xla()


def _xla(x_BTD, g_BTK, fast_BT, weights: GatedWeights, gate: Gate):
  """Both products and a masked select, or with batch1_switch the branch the gate picks."""
  def fast():
    return [fast_matmul(g_BTK, M, W, weights.W_transposed) for W, M in zip(weights.W, weights.M)]

  def slow():
    return [dense_matmul(x_BTD, W, weights.W_transposed) for W in weights.W]

  def mixed():
    return [jnp.where(fast_BT[..., None], f, s) for f, s in zip(fast(), slow())]

  if gate.mode == "static":
    return fast()
  if not gate.batch1_switch:
    return mixed()
  branch = jnp.where(jnp.all(fast_BT), 0, jnp.where(jnp.any(fast_BT), 1, 2))
  return lax.switch(branch, [fast, mixed, slow])
