"""TEAL's block-wise greedy sparsity allocation: the baseline a learned allocation must beat.

Layer by layer, on dense calibration inputs, every site starts at sparsity 0.  Each
step raises one site's sparsity by as much as adds `step` to the layer's
parameter-weighted sparsity, choosing the site whose raise leaves the block's
output closest to the dense block's (the norm over the last quarter of positions,
averaged, as TEAL's greedyopt.py measures it).  The path is walked up to the
largest target, and each target takes the first point of the path at or above it.
A site's threshold is the |x| quantile of its dense inputs at its sparsity (TEAL's
histograms).  Sites are this tree's (q, k and v share one input, so one level),
where TEAL sets q, k and v apart.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Sequence

import jax.numpy as jnp
import numpy as np

from gsi_jax.errors import GSIError
from gsi_jax.gsi import calibration
from gsi_jax.models import params as P
from gsi_jax.models.decoder import Block


@dataclasses.dataclass(frozen=True)
class GreedyConfig:
  """step: the layer's weighted sparsity added per step; windows: calibration windows
  the block errors are measured on; last_fraction: the positions measured."""
  step: float = 0.02
  windows: int = 2
  last_fraction: float = 0.25
  max_site_sparsity: float = 0.99

  def __post_init__(self):
    if not 0 < self.step < 1:
      raise GSIError(f"greedy step must lie in (0, 1), got {self.step}")
    if self.windows < 1:
      raise GSIError(f"greedy windows must be >= 1, got {self.windows}")
    if not 0 < self.last_fraction <= 1:
      raise GSIError(f"greedy last_fraction must lie in (0, 1], got {self.last_fraction}")


def block_error(y_BTD: np.ndarray, dense_BTD: np.ndarray, last_fraction: float) -> float:
  """TEAL's activation error: per batch row and feature the norm over the last
  positions, averaged."""
  start = int(y_BTD.shape[1] * (1 - last_fraction))
  return float(np.linalg.norm(y_BTD[:, start:] - dense_BTD[:, start:], axis=1).mean())


def _layer_path(layer_params, x_BTD, block, targets_max: float, config: GreedyConfig):
  """[(weighted sparsity, {site: sparsity}, {site: threshold})] of one layer, and its
  dense output."""
  dense_BTD, inputs = calibration.layer_forward(layer_params, x_BTD, block)
  dense_BTD = np.asarray(dense_BTD)
  magnitudes = {site: np.abs(np.asarray(x, np.float32)).ravel() for site, x in inputs.items()}
  sizes = {site: sum(W.size for W in layer_params[site][P.KERNEL].values()) for site in inputs}
  total = sum(sizes.values())
  increment = {site: config.step * total / size for site, size in sizes.items()}
  quantiles = {}  # (site, steps taken) -> threshold: each level is asked for many times

  def threshold(site, steps):
    if (site, steps) not in quantiles:
      quantiles[site, steps] = float(np.quantile(magnitudes[site], steps * increment[site]))
    return quantiles[site, steps]

  def error(steps):
    with_t = {**layer_params, **{site: {**layer_params[site], P.THRESHOLD: jnp.float32(
        threshold(site, n))} for site, n in steps.items()}}
    y_BTD, _ = calibration.layer_forward(with_t, x_BTD, block)
    return block_error(np.asarray(y_BTD), dense_BTD, config.last_fraction)

  def point(steps):
    levels = {site: n * increment[site] for site, n in steps.items()}
    return (sum(levels[s] * sizes[s] for s in sizes) / total, levels,
            {site: threshold(site, n) for site, n in steps.items()})

  steps = {site: 0 for site in sizes}
  path = [point(steps)]
  while path[-1][0] < targets_max - 1e-9:
    options = [site for site in sizes
               if (steps[site] + 1) * increment[site] <= config.max_site_sparsity]
    if not options:
      break
    errors = {site: error({**steps, site: steps[site] + 1}) for site in options}
    steps[min(errors, key=errors.get)] += 1
    path.append(point(steps))
  return path, dense_BTD


def greedy_allocation(model, params, windows_NT: np.ndarray, targets: Sequence[float],
                      config: GreedyConfig = GreedyConfig(), progress: bool = True):
  """({target: {layer: {site: threshold}}}, {target: {layer: {site: sparsity}}}):
  per target, TEAL's greedy per-site levels and their thresholds."""
  if any(not 0 < t < 1 for t in targets):
    raise GSIError(f"greedy targets must lie in (0, 1), got {list(targets)}")
  ids = jnp.asarray(np.asarray(windows_NT)[:config.windows])
  x_BTD = calibration.embed_windows(model.module, params, ids)
  block = Block(model.config, model.dtype)
  thresholds = {t: {} for t in targets}
  levels = {t: {} for t in targets}
  start = time.time()
  layers = P.layers(P.site_kernels(params))
  for i, layer in enumerate(layers):
    path, x_next = _layer_path(params[layer], x_BTD, block, max(targets), config)
    for t in targets:
      _, levels[t][layer], thresholds[t][layer] = next(
          (p for p in path if p[0] >= t - 1e-9), path[-1])
    x_BTD = jnp.asarray(x_next)  # TEAL: every layer's inputs are the dense model's
    if progress:
      logging.info("greedy sparsity %s (%d/%d): %d steps, %.0f s", layer, i + 1, len(layers),
                   len(path) - 1, time.time() - start)
  return thresholds, levels
