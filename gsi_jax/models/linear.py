"""The linear-map site: every map of a block goes through here.

A site holds every map that reads one input, dense or GSI depending on its
parameters (`gsi_jax.models.params` spells the layout).  `gsi_jax.apply_gsi`
and `gsi_jax.peers` add keys to the tree; the model code never changes.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from gsi_jax.errors import GSIError
from gsi_jax.models import params as P
from gsi_jax.models.activations import activation as apply_activation
from gsi_jax.ops import (Gate, GatedWeights, cats_gated_linear, gated_linear, kept_product,
                         residual_sparse_linear)


def add_bias(y_BTO: jax.Array, b_O: jax.Array) -> jax.Array:
  return y_BTO + b_O.reshape((1,) * (y_BTO.ndim - 1) + b_O.shape)


def gated_weights(module: nn.Module, W: list, W_transposed: bool = False) -> GatedWeights:
  """The GSI weights a site or head module holds, in the order of W."""
  get = lambda key: module.get_variable("params", key) if module.has_variable("params", key) \
      else None
  names = sorted(get(P.M))
  sketch = get(P.SKETCH)
  return GatedWeights(W=W, V=get(P.V), M=[get(P.M)[n] for n in names],
                      sketch=None if sketch is None else (sketch, get(P.SKETCH_M)),
                      rungs=get(P.LADDER), W_transposed=W_transposed, V_T=get(P.V_T))


class LinearSite(nn.Module):
  """All maps reading one input; dense or GSI depending on the parameters.

  Peers rewrite the same site: a threshold sparsifies the input (at batch 1
  under gate.batch1_switch, only the kept rows of each W are read), a rotation
  first turns the input into the PCA basis (LaRoSA), factors replace a map by
  two thin ones (weight SVD), and a threshold with factors sends the dropped
  inputs through them (R-Sparse).  A residual threshold beside V_k and M is
  the subspace plus sparse residual (`gsi_jax.ops.residual`).  A CATS
  threshold at a gated MLP's input site (which knows its `activation`) drops
  the channels whose gate activation is small (`gsi_jax.ops.cats`).
  """
  outputs: tuple[tuple[str, int, bool], ...]  # (map, d_out, has bias)
  dtype: Any = jnp.float32
  activation: str | None = None  # a gated MLP's input site: the gate map's activation

  def _get(self, key):
    return self.get_variable("params", key) if self.has_variable("params", key) else None

  def _sparse(self, x_BTD, threshold, Ws, gate: Gate | None, factors=None):
    """Magnitude sparsity: the inputs below the threshold are dropped, or with
    factors [(A, B)] per map (R-Sparse) they go through the low-rank x A B instead."""
    ys, keep_BTD = kept_product(x_BTD, threshold, Ws, gate)
    self.sow("sparsity_stats", "kept", jnp.mean(keep_BTD, -1, dtype=jnp.float32))
    if factors is None:
      return ys
    dropped_BTD = x_BTD - x_BTD * keep_BTD.astype(x_BTD.dtype)
    return [y + (dropped_BTD @ A) @ B for y, (A, B) in zip(ys, factors)]

  @nn.compact
  def __call__(self, x_BTD: jax.Array, gate: Gate | None) -> dict[str, jax.Array]:
    d = x_BTD.shape[-1]
    init = nn.initializers.normal(0.02)
    kernel = self.param(P.KERNEL, lambda key: {
        n: init(jax.random.fold_in(key, i), (d, o), self.dtype)
        for i, (n, o, _) in enumerate(self.outputs)})
    self.sow(P.SITE_INPUTS, "x", x_BTD)  # calibration reads every site's input
    names = sorted(kernel)  # M/{map} and the factors are keyed alike
    if (rotation := self._get(P.ROTATION)) is not None:
      x_BTD = x_BTD @ rotation
    threshold, residual = self._get(P.THRESHOLD), self._get(P.RESIDUAL_THRESHOLD)
    has_basis = (gate is None or gate.mode != "dense") and self.has_variable("params", P.V)
    gated = has_basis and gate is not None
    if (cats := self._get(P.CATS_THRESHOLD)) is not None:
      if self.activation is None or names != ["gate", "up"] or gated:
        raise GSIError("a CATS threshold needs a gated MLP's input site (gate, up) and no GSI "
                       "gate")
      gate_BTF, up_BTF, keep_BTF = cats_gated_linear(
          x_BTD, kernel["gate"], kernel["up"], self._get(P.CATS_UP_T), cats,
          lambda z: apply_activation(self.activation, z), gate)
      ys = [gate_BTF, up_BTF]
      self.sow("sparsity_stats", "kept", jnp.mean(keep_BTF, -1, dtype=jnp.float32))
    elif residual is not None and has_basis:
      M = self._get(P.M)
      ys, keep_BTD = residual_sparse_linear(x_BTD, self._get(P.V), [M[n] for n in names],
                                            [kernel[n] for n in names], residual, gate)
      self.sow("sparsity_stats", "kept", jnp.mean(keep_BTD, -1, dtype=jnp.float32))
    elif threshold is not None and not gated:
      factor_in, factor_out = self._get(P.FACTOR_IN), self._get(P.FACTOR_OUT)
      factors = None if factor_in is None else [(factor_in[n], factor_out[n]) for n in names]
      ys = self._sparse(x_BTD, threshold, [kernel[n] for n in names], gate, factors)
    elif not gated:
      factor_in, factor_out = self._get(P.FACTOR_IN) or {}, self._get(P.FACTOR_OUT) or {}
      ys = [(x_BTD @ factor_in[n]) @ factor_out[n] if n in factor_in else x_BTD @ kernel[n]
            for n in names]
    else:
      if threshold is not None:
        x_BTD = jnp.where(jnp.abs(x_BTD) >= threshold, x_BTD, 0)
      eps = self._get(P.EPS)
      ys, fast_BT, rank_BT = gated_linear(
          x_BTD, gated_weights(self, [kernel[n] for n in names]),
          gate.eps if eps is None else eps, gate)
      self.sow("gate_stats", "fast", fast_BT)
      self.sow("gate_stats", "rank", rank_BT)  # V columns read (the ladder's bytes)
    biased = {n: o for n, o, has_bias in self.outputs if has_bias}
    if biased:
      bias = self.param(P.BIAS, lambda key: {
          n: jnp.zeros((o,), self.dtype) for n, o in biased.items()})
      ys = [add_bias(y, bias[n]) if n in bias else y for y, n in zip(ys, names)]
    return dict(zip(names, ys))


class LMHead(nn.Module):
  """Logits from the final hidden state; a tied head reads the embedding table.

  Same parameter names as nn.Dense ("kernel", "bias"), so checkpoints map
  unchanged.  `gsi_jax.apply_gsi_head` adds V and M (a tied head too), which
  gate the head like a site, at gate.head_eps (beyond the paper).
  """
  vocab_size: int
  use_bias: bool
  dtype: Any

  @nn.compact
  def __call__(self, x_BTD, table_VD, gate: Gate | None):
    if table_VD is None:
      W, transposed = self.param(P.KERNEL, nn.initializers.lecun_normal(),
                                 (x_BTD.shape[-1], self.vocab_size), self.dtype), False
    else:
      W, transposed = table_VD, True
    self.sow(P.HEAD_INPUTS, "x", x_BTD)
    if gate is None or gate.mode == "dense" or not self.has_variable("params", P.V):
      y_BTV = x_BTD @ (W.T if transposed else W)
    else:
      eps = gate.eps if gate.head_eps is None else gate.head_eps
      (y_BTV,), fast_BT, rank_BT = gated_linear(
          x_BTD, gated_weights(self, [W], transposed), eps, gate)
      self.sow("head_stats", "fast", fast_BT)
      self.sow("head_stats", "rank", rank_BT)
    if self.use_bias:
      y_BTV = add_bias(y_BTV, self.param(P.BIAS, nn.initializers.zeros, (self.vocab_size,),
                                         self.dtype))
    return y_BTV
