"""Per-site budgets learned with optax: ε per GSI site, or a threshold per sparse site.

Every method otherwise spends its budget uniformly (one ε, one sparsity level
for every site), although sites differ widely.  Here

    KL(dense ‖ method) + λ · (expected bytes per token / dense bytes − budget)²

is minimised over the per-site knobs (in log space) with Adam, on calibration
windows: the penalty holds the byte budget while KL moves bytes between sites.
Gate mode "soft" runs the hard gate (or threshold) forward and a smooth one's
gradient backward, so the KL is the hard model's.  The learned values are
written into the tree as hard knobs per site (`P.EPS`, `P.THRESHOLD` or
`P.RESIDUAL_THRESHOLD`) and evaluated like any other method.  Expected bytes come from
`gsi_jax.metrics.bytes`, the one byte formula, fed the gates' mean shares.

The sparse residual's rank per site (`RANK`) is learned jointly with its threshold:
the bases are nested, so rank k is V_k's first k columns.  Learning runs on V at the
largest rank allowed with a mask on its columns, hard forward (the first k) and
sigmoid-smooth backward; `gsi_jax.truncate_ranks` then cuts each site to its k.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from gsi_jax.errors import GSIError
from gsi_jax.metrics import bytes as mbytes
from gsi_jax.models import params as P
from gsi_jax.models.model import _forward
from gsi_jax.ops import make_gate, straight_through

# GSI's gate threshold, magnitude sparsity's input threshold, the sparse residual's threshold.
KNOBS = (P.EPS, P.THRESHOLD, P.RESIDUAL_THRESHOLD)
# The sparse residual's rank per site: not a tree key, a mask on V_k's columns while learning.
RANK = "rank"
RANK_WIDTH = 2.0  # columns over which the soft rank mask falls from 1 to 0


@dataclasses.dataclass(frozen=True)
class AllocationConfig:
  """budget: the bytes fraction to hold; lam: the penalty on leaving it (nats of KL
  per token per squared fraction)."""
  budget: float
  lam: float = 100.0
  steps: int = 24
  learning_rate: float = 0.05
  batch_windows: int = 4
  seq_len: int = 128
  seed: int = 0

  def __post_init__(self):
    if not self.lam >= 0:
      raise GSIError(f"the byte penalty lambda must be >= 0, got {self.lam}")
    if not self.budget > 0:
      raise GSIError(f"the bytes budget must be > 0, got {self.budget}")
    for name in ("steps", "batch_windows", "seq_len"):
      if getattr(self, name) < 1:
        raise GSIError(f"allocation {name} must be >= 1, got {getattr(self, name)}")
    if not self.learning_rate > 0:
      raise GSIError(f"allocation learning_rate must be > 0, got {self.learning_rate}")


def floored(values: dict, floor: float = 1e-6) -> dict:
  """Knob values raised to at least `floor`, so that log space can hold them: a
  threshold of 0 (a ReLU site's many exact zeros) becomes one that drops only
  inputs that add nothing, or nearly nothing."""
  return jax.tree.map(lambda v: max(float(v), floor), values)


def kept_columns(rank, k_max: int) -> int:
  """The columns of V a learned rank keeps: those i with i + 1/2 < rank, as `rank_mask`."""
  return int(np.clip(np.ceil(float(rank) - 0.5), 0, k_max))


def kept_ranks(params, ranks: dict) -> dict:
  """{layer: {site: int}}: the columns each learned rank keeps of its site's V_k, for
  `gsi_jax.truncate_ranks`."""
  return {layer: {site: kept_columns(rank, params[layer][site][P.V].shape[1])
                  for site, rank in sites.items()} for layer, sites in ranks.items()}


def rank_mask(rank: jax.Array, k_max: int) -> jax.Array:
  """(k_max,): 1 on V's first `kept_columns(rank)` columns forward, a sigmoid in rank backward."""
  i_K = jnp.arange(k_max) + 0.5
  return straight_through(i_K < rank, jax.nn.sigmoid((rank - i_K) / RANK_WIDTH))


def with_values(params, values: dict):
  """params with {knob: {layer: {site: value}}} written in; RANK masks V's columns
  (M unchanged: g M then sums the kept columns' images only)."""
  out = params
  for knob, by_site in values.items():
    if knob != RANK:
      out = P.with_site_values(out, knob, by_site)
  for layer, sites in values.get(RANK, {}).items():
    for site, rank in sites.items():
      V_DK = out[layer][site][P.V]
      out = P.with_site(out, layer, site, {P.V: V_DK * rank_mask(rank, V_DK.shape[1])[None]})
  return out


def expected_bytes(params, values: dict, stats) -> jax.Array:
  """Bytes per token at the soft gates' mean shares (differentiable); with RANK, each
  residual site's V_k and M at its masked rank instead of V's width."""
  if P.EPS in values:
    share = {layer: {site: jnp.mean(v["fast"][0]) for site, v in sites.items()}
             for layer, sites in stats["gate_stats"].items()}
    return mbytes.byte_accounting(params, share)["bytes_per_token"]
  kept = {layer: {site: jnp.mean(v["kept"][0]) for site, v in sites.items()}
          for layer, sites in stats["sparsity_stats"].items()}
  total = mbytes.sparsity_bytes(params, kept, None)
  outputs = P.site_outputs(params)
  for layer, sites in values.get(RANK, {}).items():
    for site, rank in sites.items():
      d, k_max = params[layer][site][P.V].shape
      k = jnp.sum(rank_mask(rank, k_max))
      o = outputs[layer][site]
      total += (mbytes.gated_map_elements(d, o, k, k, 1.0)
                - mbytes.gated_map_elements(d, o, k_max, k_max, 1.0)) * mbytes.itemsize(params)
  return total


@functools.partial(jax.jit, static_argnames=("module",))
def _loss_and_grad(module, params, log_values, ids_BT, dense_logp_BTV, lam, budget,
                   dense_bytes):
  def loss(log_values):
    values = jax.tree.map(jnp.exp, log_values)
    p = with_values(params, values)
    logits, stats = _forward(module, p, ids_BT, make_gate(0.0, "soft"),
                             ("gate_stats", "sparsity_stats"))
    logp = jax.nn.log_softmax(logits, -1)
    kl = jnp.mean(jnp.sum(jnp.exp(dense_logp_BTV) * (dense_logp_BTV - logp), -1))
    fraction = expected_bytes(p, values, stats) / dense_bytes
    return kl + lam * jnp.square(fraction - budget), (kl, fraction)
  return jax.value_and_grad(loss, has_aux=True)(log_values)


def check_knobs(params, init: dict):
  knobs = [knob for knob in init if knob != RANK]
  if len(knobs) != 1 or knobs[0] not in KNOBS:
    raise GSIError(f"an allocation learns one knob of {KNOBS} (and {RANK!r} beside "
                   f"{P.RESIDUAL_THRESHOLD!r}), got {sorted(init)}")
  if RANK in init:
    if knobs[0] != P.RESIDUAL_THRESHOLD:
      raise GSIError(f"ranks are learned beside {P.RESIDUAL_THRESHOLD!r} only, not {knobs[0]!r}")
    for layer, sites in init[RANK].items():
      for site, rank in sites.items():
        k_max = params[layer][site][P.V].shape[1]
        if not 0 < rank <= k_max:
          raise GSIError(f"{layer}/{site}: a learned rank starts in (0, {k_max}] (the width of "
                         f"its V_k), got {rank}")
  if any(not v > 0 for by_site in init.values() for sites in by_site.values()
         for v in sites.values()):
    raise GSIError("allocation starts from positive knob values only (see `floored`)")


def learn_allocation(model, params, init: dict, windows_NT: np.ndarray,
                     config: AllocationConfig, progress: bool = True,
                     dense_logp_cache: dict | None = None):
  """Learned {knob: {layer: {site: value}}}, starting from `init` (same structure), and
  the history of (step, loss, KL, expected bytes fraction).

  dense_logp_cache: dense log-probs by the windows a step draws, kept across calls on the
  same windows_NT and config (the seed draws the same batches each time), so that a sweep
  of allocations runs the dense model once per batch.

  init holds one knob of KNOBS, and for P.RESIDUAL_THRESHOLD optionally RANK too (learned
  jointly).  params must already carry what the knob gates: V_k and M for P.EPS and
  P.RESIDUAL_THRESHOLD (at the largest rank RANK may take), and for P.THRESHOLD nothing
  more (the values are added here)."""
  check_knobs(params, init)
  windows = np.asarray(windows_NT)[:, :config.seq_len]
  rng = np.random.default_rng(config.seed)
  dense_bytes = mbytes.dense_bytes(params)
  log_values = jax.tree.map(lambda v: jnp.log(jnp.float32(v)), init)
  optimizer = optax.adam(config.learning_rate)
  state = optimizer.init(log_values)
  history, t0 = [], time.perf_counter()
  for step in range(config.steps):
    rows = rng.choice(len(windows), config.batch_windows, replace=False)
    ids = jnp.asarray(windows[rows])
    # Without a cache, a fresh one each step: nothing is kept.
    cache = {} if dense_logp_cache is None else dense_logp_cache
    key = (config.seq_len, tuple(int(r) for r in rows))
    if key not in cache:
      cache[key] = jax.nn.log_softmax(model.logits(P.dense_params(params), ids), -1)
    dense_logp = cache[key]
    (loss, (kl, fraction)), grads = _loss_and_grad(
        model.module, params, log_values, ids, dense_logp, config.lam, config.budget,
        dense_bytes)
    updates, state = optimizer.update(grads, state)
    log_values = optax.apply_updates(log_values, updates)
    history.append({"step": step, "loss": float(loss), "kl": float(kl),
                    "bytes_fraction": float(fraction)})
    if progress and (step % 8 == 0 or step == config.steps - 1):
      logging.info("allocation %s budget %.3f step %d/%d: KL %.4f, bytes %.3f (%.0f s)",
                   "+".join(sorted(init)),
                   config.budget, step + 1, config.steps, float(kl), float(fraction),
                   time.perf_counter() - t0)
  learned = jax.tree.map(lambda v: float(jnp.exp(v)), log_values)
  return learned, history


def scale_to_budget(values: dict, bytes_fraction, target: float, iterations: int = 10) -> dict:
  """The learned values times one common factor c, found by bisection on log c, such
  that bytes_fraction(values · c) (hard, measured on calibration text) meets target.

  Learning sets the shape of the allocation; this sets its budget, so that a
  learned allocation is compared with a uniform one at matched bytes.  Larger
  knobs (ε, or a threshold) read fewer bytes.
  """
  lo, hi = -3.0, 3.0
  scaled = lambda log_c: jax.tree.map(lambda v: v * float(np.exp(log_c)), values)
  for _ in range(iterations):
    mid = (lo + hi) / 2
    if bytes_fraction(scaled(mid)) > target:
      lo = mid
    else:
      hi = mid
  return scaled(hi)  # the side that meets the budget
