"""Quality on held-out text: perplexity ratio, top-1 agreement, gate shares."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from gsi_jax import progress
from gsi_jax.errors import whole
from gsi_jax.models import params as P
from gsi_jax.models.model import _forward, check_gate, check_model
from gsi_jax.ops import Gate

COLLECTIONS = ("gate_stats", "sparsity_stats", "head_stats")


@functools.partial(jax.jit, static_argnames=("module",))
def _score_batch(module, params, ids_BT, gate):
  """The model's own forward, reduced on device to NLL, argmax and per-site sums."""
  logits, state = _forward(module, params, ids_BT, gate, COLLECTIONS)
  logp = jax.nn.log_softmax(logits[:, :-1], -1)
  nll = -jnp.take_along_axis(logp, ids_BT[:, 1:, None], -1)[..., 0]

  def sums(collection, per_token):
    return {layer: {site: jnp.sum(per_token(v)[:, :-1], dtype=jnp.float32)
                    for site, v in sites.items()}
            for layer, sites in state.get(collection, {}).items()}
  stats = {"fast": sums("gate_stats", lambda v: v["fast"][0]),
           "rank": sums("gate_stats", lambda v: v["rank"][0]),
           "fast_rank": sums("gate_stats", lambda v: v["rank"][0] * v["fast"][0]),
           "kept": sums("sparsity_stats", lambda v: v["kept"][0])}
  if "head_stats" in state:
    head = state["head_stats"]["lm_head"]
    for stat in ("fast", "rank"):
      stats[f"head_{stat}"] = jnp.sum(head[stat][0][:, :-1], dtype=jnp.float32)
  return nll, jnp.argmax(logits[:, :-1], -1), stats


def score(model, params, windows_NT: np.ndarray, gate: Gate | None = None,
          batch_size: int = 4) -> dict:
  """Next-token NLL and argmax per position, and gate statistics per token:
  per site the fast share, the mean (V columns, M rows) read (the rank
  ladder's bytes), the share of inputs kept (magnitude sparsity); the GSI
  LM head's fast share and mean V columns read (None without one).

  The last position of each window has no target and is left out everywhere.
  """
  check_model(model)
  windows_NT = np.asarray(model.checked_ids(windows_NT, "a scoring window"))
  check_gate(gate, P.check_tree(params))
  batch_size = whole("batch_size", batch_size)
  nll, top1, totals = [], [], None
  counter = progress.Counter(f"scoring {windows_NT.size} tokens", len(windows_NT))
  try:
    for i in range(0, len(windows_NT), batch_size):
      n, t, c = _score_batch(model.module, params, jnp.asarray(windows_NT[i:i + batch_size]),
                             gate)
      nll.append(np.asarray(n))
      top1.append(np.asarray(t))
      totals = c if totals is None else jax.tree.map(jnp.add, totals, c)
      counter.advance(len(n))
  finally:
    counter.close()
  nll, top1 = np.concatenate(nll), np.concatenate(top1)
  if not np.all(np.isfinite(nll)):  # never a perplexity of nan
    raise model.nonfinite("the scored log-probabilities")
  mean = jax.tree.map(lambda c: float(c) / nll.size, totals)
  rows = jax.tree.map(lambda v, m: (v, m), mean["rank"], mean["fast_rank"])
  return {"nll": nll, "top1": top1, "fast_share_by_layer": mean["fast"],
          "rows_by_layer": rows, "kept_share_by_layer": mean["kept"],
          "head_fast_share": mean.get("head_fast"), "head_v_columns": mean.get("head_rank")}


def mean_share(share_by_layer: dict) -> float:
  values = [v for sites in share_by_layer.values() for v in sites.values()]
  return float(np.mean(values)) if values else 0.0


def share_by_site(share_by_layer: dict) -> dict[str, float]:
  """Average over layers, per site kind (attn_in, attn_out, mlp_in, mlp_out)."""
  sites = {}
  for layer_sites in share_by_layer.values():
    for site, v in layer_sites.items():
      sites.setdefault(site, []).append(v)
  return {site: float(np.mean(v)) for site, v in sites.items()}


def quality(dense: dict, gsi: dict) -> dict:
  """Perplexities on the same windows, their ratio, and top-1 agreement."""
  ppl_dense = math.exp(float(dense["nll"].mean()))
  ppl = math.exp(float(gsi["nll"].mean()))
  return {"ppl_dense": ppl_dense, "ppl": ppl, "ppl_ratio": ppl / ppl_dense,
          "top1_agreement": float((dense["top1"] == gsi["top1"]).mean()),
          "fast_share": mean_share(gsi["fast_share_by_layer"]),
          "fast_share_by_site": share_by_site(gsi["fast_share_by_layer"])}
