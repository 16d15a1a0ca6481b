"""Calibration: accumulate each site's Gram matrix, then find its top subspace."""

from __future__ import annotations

import functools
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np

from gsi_jax.errors import GSIError
from gsi_jax.gsi import cascade
from gsi_jax.gsi.bases import FORMAT_VERSION, Bases, fingerprint
from gsi_jax.models import params as P

METHODS = ("eigh", "cascade")


@functools.partial(jax.jit, static_argnames=("module", "collection"), donate_argnums=(1,))
def _accumulate(module, grams, params, ids_BT, collection):
  _, state = module.apply({"params": params}, ids_BT, mutable=[collection])

  def add(gram, x):
    X = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
    return gram + X.T @ X
  return jax.tree.map(add, grams, P.unwrap_sown(state[collection]))


def gram_matrices(model, params, windows_NT: np.ndarray, batch_size: int = 4,
                  progress: bool = True, collection: str = P.SITE_INPUTS) -> dict:
  """X^T X of every sown input over all windows (float32 numpy); memory bounded by one batch.

  collection "site_inputs": {layer: {site: G}}; "head_inputs": {"lm_head": G}.
  """
  _, state = jax.eval_shape(
      lambda p, x: model.module.apply({"params": p}, x, mutable=[collection]),
      params, jnp.zeros((1, windows_NT.shape[1]), jnp.int32))
  grams = jax.tree.map(lambda x: jnp.zeros((x.shape[-1],) * 2, jnp.float32),
                       P.unwrap_sown(state[collection]))
  n = windows_NT.shape[0]
  start = time.time()
  for i in range(0, n, batch_size):
    grams = _accumulate(model.module, grams, params, jnp.asarray(windows_NT[i:i + batch_size]),
                        collection)
    if progress:
      jax.block_until_ready(grams)  # dispatch is asynchronous: report work actually done
      done = min(i + batch_size, n)
      logging.info("calibration forward: %d/%d windows (%.0f s)", done, n, time.time() - start)
  return jax.device_get(grams)


def top_eigenpairs(G: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
  """Top-k eigenvalues (descending) and eigenvectors of a symmetric PSD matrix."""
  w, V = np.linalg.eigh(G)
  order = np.argsort(w)[::-1][:k]
  return w[order], V[:, order]


def calibrate(model, params, token_ids, k_max: int, method: str = "eigh", seq_len: int = 256,
              batch_size: int = 4, source: str = "", progress: bool = True) -> Bases:
  """Bases for every site from one forward pass per window of `token_ids`.

  token_ids: a 1-D array of ids (cut into windows of seq_len) or (N, seq_len).
  method "eigh" eigendecomposes every Gram matrix; "cascade" starts each
  layer from the previous layer's basis and refines it (see cascade.py).
  """
  if method not in METHODS:
    raise GSIError(f"calibration method {method!r} is not one of {METHODS}")
  if k_max <= 0:
    raise GSIError(f"k_max must be positive, got {k_max}")
  ids = np.asarray(token_ids, np.int32)
  if ids.size == 0:
    raise GSIError("calibration text is empty")
  if ids.ndim == 1:
    if len(ids) < seq_len:
      raise GSIError(f"calibration text has {len(ids)} tokens, fewer than one window of "
                     f"{seq_len}; give more text or a smaller seq_len")
    n = len(ids) // seq_len
    ids = ids[:n * seq_len].reshape(n, seq_len)
  if k_max > P.widest_site(params):
    raise GSIError(f"k_max={k_max} exceeds the widest site ({P.widest_site(params)})")
  grams = gram_matrices(model, params, ids, batch_size, progress)
  bases = solve(grams, k_max, method, progress)
  bases.meta.update({
      "model": model.config.name, "source_model": model.source,
      "fingerprint": fingerprint(params), "text_source": source, "tokens": int(ids.size),
      "seq_len": int(ids.shape[1]), "dtype": str(jnp.dtype(model.dtype)),
  })
  return bases


def solve(grams: dict, k_max: int, method: str = "eigh", progress: bool = False) -> Bases:
  """Bases from Gram matrices; meta records the solve's time and modelled flops per site."""
  if method not in METHODS:
    raise GSIError(f"calibration method {method!r} is not one of {METHODS}")
  vectors, eigenvalues, trace, per_site = {}, {}, {}, {}
  previous: dict[str, np.ndarray] = {}
  for layer in P.layers(grams):
    for site, G32 in grams[layer].items():
      # float32 accumulation leaves X^T X slightly asymmetric; eigh reads one triangle only.
      G = (np.asarray(G32, np.float64) + np.asarray(G32, np.float64).T) / 2
      d = G.shape[0]
      k = min(k_max, d)  # a site narrower than k_max keeps its full basis
      t0 = time.perf_counter()
      if method == "cascade" and site in previous:
        w, V, flops = cascade.refine(G, previous[site])
      else:
        w, V = top_eigenpairs(G, k)
        flops = cascade.eigh_flops(d)
      per_site[f"{layer}/{site}"] = [time.perf_counter() - t0, float(flops)]
      previous[site] = V
      vectors.setdefault(layer, {})[site] = V.astype(np.float32)
      eigenvalues.setdefault(layer, {})[site] = w.astype(np.float32)
      trace.setdefault(layer, {})[site] = np.float32(np.trace(G))
    if progress:
      logging.info("calibration %s: %s done", method, layer)
  meta = {
      "format_version": FORMAT_VERSION, "method": method, "k_max": int(k_max),
      "solve_seconds": sum(c[0] for c in per_site.values()),
      "solve_flops": sum(c[1] for c in per_site.values()),
      "solve_cost_by_site": per_site,  # "layer/site": [seconds, flops]
  }
  return Bases(vectors, eigenvalues, trace, meta)
