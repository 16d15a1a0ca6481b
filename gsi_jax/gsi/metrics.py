"""Quality, gate statistics, byte accounting and the Theorem 4 check.

Two byte counts, never mixed up:
  * paper formula: per map d / (k + p_slow d), i.e. M's k columns plus W on
    slow tokens; it ignores V_k, the LM head, embeddings and norms;
  * true bytes read per decoded token at batch 1: V_k of every site, M on
    fast tokens, W on slow ones, biases, norms, the embedding row and the
    whole LM head (or its V_k, M / W when the head is gated too).
KV-cache reads are activations, not weights, and are left out of both.
"""

from __future__ import annotations

import functools
import logging
import math

import jax
import jax.numpy as jnp
import numpy as np

from gsi_jax.gsi.bases import site_kernels
from gsi_jax.gsi.head import head_kernel
from gsi_jax.gsi.transform import GSI_KEYS, dense_params
from gsi_jax.models.linear import Gate


@functools.partial(jax.jit, static_argnames=("module",))
def _score_batch(module, params, ids_BT, gate):
  (logits, _), state = module.apply({"params": params}, ids_BT, gate=gate,
                                    mutable=["gate_stats", "sparsity_stats", "head_stats"])
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
    stats["head_fast"] = jnp.sum(state["head_stats"]["lm_head"]["fast"][0][:, :-1],
                                 dtype=jnp.float32)
  return nll, jnp.argmax(logits[:, :-1], -1), stats


def score(model, params, windows_NT: np.ndarray, gate: Gate | None = None,
          batch_size: int = 4) -> dict:
  """Next-token NLL and argmax per position, and gate statistics per token:
  per site the fast share, the mean (V columns, M rows) read (the rank
  ladder's bytes), the share of inputs kept (magnitude sparsity); the GSI
  LM head's fast share (None without one).

  The last position of each window has no target and is left out everywhere.
  """
  nll, top1, totals = [], [], None
  for i in range(0, len(windows_NT), batch_size):
    n, t, c = _score_batch(model.module, params, jnp.asarray(windows_NT[i:i + batch_size]), gate)
    nll.append(np.asarray(n))
    top1.append(np.asarray(t))
    totals = c if totals is None else jax.tree.map(jnp.add, totals, c)
  nll, top1 = np.concatenate(nll), np.concatenate(top1)
  mean = jax.tree.map(lambda c: float(c) / nll.size, totals)
  rows = jax.tree.map(lambda v, m: (v, m), mean["rank"], mean["fast_rank"])
  return {"nll": nll, "top1": top1, "fast_share_by_layer": mean["fast"],
          "rows_by_layer": rows, "kept_share_by_layer": mean["kept"],
          "head_fast_share": mean.get("head_fast")}


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


def other_elements(params) -> int:
  """Weights a decode step reads outside the sites and the LM head: norms, site
  biases, and one row of each embedding table."""
  sites = site_kernels(params)
  other = 0
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    keys = [p.key for p in path]
    in_site = keys[0] in sites and keys[1] in sites[keys[0]]
    if keys[0] == "lm_head" or (in_site and keys[2] not in ("bias", "threshold")):
      continue  # the head, kernels, bases, images: counted on their own
    other += leaf.shape[1] if keys[-1] == "embedding" else leaf.size
  return other


def gated_elements(d: int, out: int, v_cols: float, m_rows: float, fast: float) -> float:
  """Weights one gated map reads per token on average at batch 1: the V columns the gate
  went through, M's rows on fast tokens, W on slow ones."""
  return d * v_cols + m_rows * out + (1 - fast) * d * out


def head_elements(params, fast_share: float | None = None) -> float:
  """Weights the LM head reads per token; a GSI head reads V_k, then M on fast
  tokens and W on slow ones (fast_share None: always slow)."""
  head = params.get("lm_head", {})
  d, vocab = head_kernel(params).shape
  bias = head["bias"].size if "bias" in head else 0
  if "basis" not in head:
    return float(d * vocab + bias)
  k, f = head["basis"].shape[1], fast_share or 0.0
  return gated_elements(d, vocab, k, f * k, f) + bias


def linear_elements_dense(params) -> float:
  return float(sum(W.size for s in site_kernels(params).values() for ks in s.values()
                   for W in ks.values()))


def byte_accounting(params, k: int | None, fast_share_by_layer: dict | None,
                    rows_by_layer: dict | None = None,
                    head_fast_share: float | None = None) -> dict:
  """Weight bytes read per decoded token (batch 1), dense and GSI, by both counts.

  k None means dense.  fast_share_by_layer: {layer: {site: share}}; a site
  with no entry is taken as always slow.  At batch 1 a fast token reads V_k
  and M, a slow one V_k and W (the residual skip).  rows_by_layer: {layer:
  {site: (V columns, M rows)}} read per token on average (score()'s; needed
  for the rank ladder), else (k, share x k).  head_fast_share: of a GSI head.
  """
  sites = site_kernels(params)
  itemsize = jax.tree.leaves(params)[0].dtype.itemsize
  share = fast_share_by_layer or {}
  lin_dense = lin_gsi = paper_cost = 0.0
  for layer, layer_sites in sites.items():
    for site, kernels in layer_sites.items():
      d = next(iter(kernels.values())).shape[0]
      out = sum(W.shape[1] for W in kernels.values())
      lin_dense += d * out
      if k is None:
        lin_gsi += d * out
        paper_cost += d * out
        continue
      k_site = min(k, d)
      f = share.get(layer, {}).get(site, 0.0)
      v_cols, m_rows = (rows_by_layer or {}).get(layer, {}).get(site, (k_site, f * k_site))
      node = params[layer][site]
      gate_cost = sum(node[n].size for n in ("sketch", "sketch_image") if n in node)
      lin_gsi += gated_elements(d, out, v_cols, m_rows, f) + gate_cost
      paper_cost += out * (k_site + (1 - f) * d)
  other = other_elements(params)
  head_dense = head_elements(dense_params(params))
  head = head_elements(params, head_fast_share)
  total_dense = (lin_dense + other + head_dense) * itemsize
  total_gsi = (lin_gsi + other + head) * itemsize
  model_size = sum(leaf.size for leaf in jax.tree.leaves(dense_params(params)))
  storage = sum(leaf.size for leaf in jax.tree.leaves(params)) - model_size
  return {
      "bytes_per_token_dense": total_dense, "bytes_per_token": total_gsi,
      "bytes_fraction": total_gsi / total_dense, "speedup_bytes": total_dense / total_gsi,
      "speedup_linear_bytes": lin_dense / lin_gsi, "speedup_paper": lin_dense / paper_cost,
      "outside_sites_share_dense": ((other + head_dense) * itemsize) / total_dense,
      "head_share_dense": head_dense * itemsize / total_dense,
      "effective_params": total_gsi / itemsize, "effective_params_paper": paper_cost,
      "params_total": float(model_size), "storage_overhead": storage / max(model_size, 1),
  }


def theorem4_check(model, gsi_params, windows_NT: np.ndarray, eps: float,
                   batch_size: int = 2) -> dict:
  """On every fast token of every map: ||W r|| <= ||W||_2 eps ||x||.

  r is recomputed from the site inputs the gated forward actually saw.
  Returns the worst ratio error / bound (must stay <= 1) and the worst
  error / (||W||_2 ||r||), how tight the operator-norm step is.
  """
  from gsi_jax.models.linear import make_gate
  gate = make_gate(eps)
  kernels = site_kernels(gsi_params)
  norms = {(layer, site, n): float(np.linalg.norm(np.asarray(W, np.float64), 2))
           for layer, s in kernels.items() for site, ks in s.items() for n, W in ks.items()}
  worst_bound = worst_tight = 0.0
  fast_tokens = violations = 0
  for i in range(0, len(windows_NT), batch_size):
    _, state = model.forward(gsi_params, windows_NT[i:i + batch_size], gate,
                             collections=("site_inputs", "gate_stats"))
    for layer, s in kernels.items():
      for site, ks in s.items():
        x = np.asarray(state["site_inputs"][layer][site]["x"][0], np.float64)
        fast = np.asarray(state["gate_stats"][layer][site]["fast"][0])
        x = x[fast]
        if not len(x):
          continue
        V = np.asarray(gsi_params[layer][site]["basis"], np.float64)
        r = x - (x @ V) @ V.T
        x_norm, r_norm = np.linalg.norm(x, axis=-1), np.linalg.norm(r, axis=-1)
        fast_tokens += len(x)
        for n, W in ks.items():
          err = np.linalg.norm(r @ np.asarray(W, np.float64), axis=-1)
          bound = norms[(layer, site, n)] * eps * x_norm
          violations += int(np.sum(err > bound * (1 + 1e-4)))  # float32 gate rounding
          worst_bound = max(worst_bound, float(np.max(err / bound)))
          worst_tight = max(worst_tight, float(np.max(err / (norms[(layer, site, n)] * r_norm
                                                              + 1e-30))))
  logging.info("theorem 4: %d fast site-tokens, %d violations", fast_tokens, violations)
  return {"eps": eps, "fast_site_tokens": fast_tokens, "violations": violations,
          "max_error_over_bound": worst_bound, "max_error_over_norm_r": worst_tight}


def residual_ratios(model, params, bases, windows_NT: np.ndarray, ks: list[int],
                    batch_size: int = 4) -> dict:
  """rho = ||r|| / ||x|| of every token at every site, for several k at once.

  Inputs come from the dense forward, so the fast-path share rho < eps read
  off these arrays is the one a gate would see on the dense trajectory.
  Returns {layer: {site: (tokens, len(ks)) float32}}.
  """
  out: dict = {}
  for i in range(0, len(windows_NT), batch_size):
    _, state = model.forward(params, windows_NT[i:i + batch_size], None,
                             collections=("site_inputs",))
    for layer, sites in state["site_inputs"].items():
      for site, v in sites.items():
        x = np.asarray(v["x"][0], np.float64).reshape(-1, v["x"][0].shape[-1])
        V = bases.vectors[layer][site].astype(np.float64)
        captured = np.cumsum((x @ V) ** 2, axis=1)  # ||V_k^T x||^2 for k = 1..k_max
        total = np.sum(x**2, axis=1)
        cols = [captured[:, min(k, V.shape[1]) - 1] for k in ks]
        rho = np.sqrt(np.clip(1 - np.stack(cols, 1) / total[:, None], 0, None))
        out.setdefault(layer, {}).setdefault(site, []).append(rho.astype(np.float32))
  return {layer: {site: np.concatenate(parts) for site, parts in sites.items()}
          for layer, sites in out.items()}
