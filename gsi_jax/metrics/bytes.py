"""Weight bytes read per decoded token at batch 1: the one byte formula.

Two counts, never mixed up:
  * the paper's formula: per map O (k + p_slow d), i.e. M on every token and W
    on slow ones; it leaves out V_k, the LM head, embeddings and norms;
  * true bytes: per gated map d·k (V_k, for the gate) + f·k·O (M on fast tokens)
    + (1 − f)·d·O (W on slow ones), what the batch-1 switch and the kernel
    read, plus biases, norms, one embedding row and the whole LM head (or its
    V_k, M and W when it is gated too).
KV-cache reads are activations, not weights, and are left out of both.
Every method's bytes (GSI, its peers, benchmarks, decode predictions) come from here.
"""

from __future__ import annotations

import jax

from gsi_jax.errors import GSIError
from gsi_jax.models import params as P


def gated_map_elements(d: int, out: int, v_cols: float, m_rows: float, fast: float) -> float:
  """One gated map (or site): the V columns the gate went through, M's rows on fast
  tokens, W on slow ones; per token on average."""
  return d * v_cols + m_rows * out + (1 - fast) * d * out


def paper_map_elements(d: int, out: int, k: int, fast: float) -> float:
  """The paper's count: M's k columns on every token, W on slow ones."""
  return out * (k + (1 - fast) * d)


def sparse_map_elements(d: int, out: int, kept: float) -> float:
  """Magnitude sparsity: W's rows for the kept share of the inputs."""
  return kept * d * out


def svd_map_elements(d: int, out: int, rank: int) -> float:
  """Weight SVD as two thin maps: r (d + O), capped at d O."""
  return min(min(rank, d, out) * (d + out), d * out)


def other_elements(params) -> int:
  """Weights a step reads outside the site kernels and the LM head: norms, site
  biases, sparsity thresholds, and one row of each embedding table."""
  sites = P.site_kernels(params)
  other = 0
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    keys = [p.key for p in path]
    in_site = keys[0] in sites and keys[1] in sites[keys[0]]
    if keys[0] == P.LM_HEAD or (in_site and keys[2] not in P.SITE_KNOBS):
      continue  # the head, kernels, bases, M: counted on their own
    other += leaf.shape[1] if keys[-1] == P.EMBEDDING else leaf.size
  return other


def head_elements(params, fast_share: float | None = None,
                  v_columns: float | None = None) -> float:
  """Weights the LM head reads per token; a GSI head reads V_k's v_columns (None: all k;
  0 where its ε ≤ 0 skipped them), then M on fast tokens and W on slow ones
  (fast_share None: always slow)."""
  d, vocab = P.head_kernel(params).shape
  head = P.head(params)
  bias = head[P.BIAS].size if P.BIAS in head else 0
  if not P.has_gsi(head):
    return float(d * vocab + bias)
  k, f = head[P.V].shape[1], fast_share or 0.0
  v_cols = k if v_columns is None else v_columns
  padding = head[P.M][P.HEAD_MAP].shape[1] - vocab  # M's zero columns, read on fast tokens
  return gated_map_elements(d, vocab, v_cols, f * k, f) + f * k * padding + bias


def linear_elements_dense(params) -> float:
  return float(sum(d * o for _, _, d, o in P.site_shapes(params)))


def dense_bytes(params) -> float:
  """A dense step's weight bytes: every site kernel, the rest, and the whole head."""
  dense = P.dense_params(params)
  return (linear_elements_dense(dense) + other_elements(dense) + head_elements(dense)) \
      * itemsize(params)


def itemsize(params) -> int:
  return jax.tree.leaves(P.site_kernels(params))[0].dtype.itemsize


def kept_site_elements(node, d: int, out: int, kept: float) -> float:
  """One site whose bytes follow the share of its inputs kept: magnitude sparsity's
  kept rows, plus a rotated site's basis
  (LaRoSA reads Q (d, d)), plus R-Sparse's factors (its dropped inputs go through
  them), or the subspace plus sparse residual's V_k and M with the kept residual's rows,
  or CATS' whole W_gate with W_up's kept columns (kept: the share of channels kept)."""
  if P.CATS_THRESHOLD in node:
    d_gate = node[P.KERNEL]["gate"].shape[1]
    return d * d_gate + sparse_map_elements(d, out - d_gate, kept)
  if P.RESIDUAL_THRESHOLD in node:
    k = node[P.V].shape[1]
    return gated_map_elements(d, out, k, k, 1.0) + sparse_map_elements(d, out, kept)
  elements = sparse_map_elements(d, out, kept)
  if P.ROTATION in node:
    elements += d * d
  if P.THRESHOLD in node and P.FACTOR_IN in node:
    elements += sum(x.size for key in (P.FACTOR_IN, P.FACTOR_OUT) for x in node[key].values())
  return elements


def sparsity_bytes(params, kept_share_by_layer: dict, head_fast_share: float | None,
                   head_v_columns: float | None = None) -> float:
  """Every site as `kept_site_elements` counts it at its kept share (1 where it has none:
  a dense site), one threshold per site, and the head as it ran (dense, or gated)."""
  lin = sum(kept_site_elements(params[layer][site], d, o,
                               kept_share_by_layer.get(layer, {}).get(site, 1.0))
            for layer, site, d, o in P.site_shapes(params))
  return (lin + other_elements(params)
          + head_elements(params, head_fast_share, head_v_columns)) * itemsize(params)


def svd_bytes(params, rank: int) -> float:
  """Weight SVD at one rank for every map (the rest read dense)."""
  lin = sum(svd_map_elements(W.shape[0], W.shape[1], rank)
            for sites in P.site_kernels(params).values() for kernels in sites.values()
            for W in kernels.values())
  return (lin + other_elements(params) + head_elements(params)) * itemsize(params)


def byte_accounting(params, fast_share_by_layer: dict | None = None,
                    rows_by_layer: dict | None = None,
                    head_fast_share: float | None = None,
                    head_v_columns: float | None = None) -> dict:
  """Weight bytes read per decoded token (batch 1), dense and as `params` run, by both counts.

  fast_share_by_layer: {layer: {site: share}}; a GSI site with no entry is
  taken as always slow, a site without V_k as dense.  rows_by_layer: {layer:
  {site: (V columns, M rows)}} read per token on average (`score`'s; needed
  for the rank ladder), else (k, share × k).  head_fast_share, head_v_columns: of a
  GSI head (`score`'s).
  """
  layers = {layer for layer, *_ in P.site_shapes(P.check_tree(params))}
  for name, given in (("fast_share_by_layer", fast_share_by_layer),
                      ("rows_by_layer", rows_by_layer)):
    if given is not None and not (isinstance(given, dict) and set(given) <= layers and all(
        isinstance(sites, dict) for sites in given.values())):
      keys = sorted(given) if isinstance(given, dict) else type(given).__name__
      raise GSIError(f"byte_accounting: {name} must map layers of params to their sites' "
                     f"figures, got {keys}; pass generate's stats as "
                     "byte_accounting(params, **stats)")
  share = fast_share_by_layer or {}
  lin_dense = lin = paper = 0.0
  for layer, site, d, out in P.site_shapes(params):
    node = params[layer][site]
    lin_dense += d * out
    if not P.has_gsi(node):
      lin += d * out
      paper += d * out
      continue
    k = node[P.V].shape[1]
    f = share.get(layer, {}).get(site, 0.0)
    v_cols, m_rows = (rows_by_layer or {}).get(layer, {}).get(site, (k, f * k))
    gate_cost = sum(node[n].size for n in (P.SKETCH, P.SKETCH_M) if n in node)
    lin += gated_map_elements(d, out, v_cols, m_rows, f) + gate_cost
    paper += paper_map_elements(d, out, k, f)
  size = itemsize(params)
  other = other_elements(params)
  head_dense = head_elements(P.dense_params(params))
  head = head_elements(params, head_fast_share, head_v_columns)
  total_dense = (lin_dense + other + head_dense) * size
  total = (lin + other + head) * size
  model_size = sum(leaf.size for leaf in jax.tree.leaves(P.dense_params(params)))
  storage = sum(leaf.size for leaf in jax.tree.leaves(params)) - model_size
  return {
      "bytes_per_token_dense": total_dense, "bytes_per_token": total,
      "bytes_fraction": total / total_dense, "speedup_bytes": total_dense / total,
      "speedup_linear_bytes": lin_dense / lin, "speedup_paper": lin_dense / paper,
      "outside_sites_share_dense": ((other + head_dense) * size) / total_dense,
      "head_share_dense": head_dense * size / total_dense,
      "effective_params": total / size, "effective_params_paper": paper,
      "linear_params_dense": lin_dense,
      "params_total": float(model_size), "storage_overhead": storage / max(model_size, 1),
  }


def storage_elements(d: int, out: int, k: int) -> int:
  """What GSI adds to one site: V_k (d × k) and M (k × ΣO)."""
  return min(k, d) * (d + out)
