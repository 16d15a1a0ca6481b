"""A method that exists only in the tests, README's worked example of adding one:
magnitude sparsity with one |x| threshold for the whole model (the quantile of every
site's calibration inputs pooled), where `sparsity` sets one per site.  This module
declares it; `tests/test_methods.py` registers it and runs pareto on it, unchanged."""

import numpy as np

from gsi_jax import peers
from gsi_jax.methods import Knob, Method, Point
from gsi_jax.methods.common import KEPT_ROWS, by_tree, in_unit, sparse_bytes

GLOBAL_SPARSITY = Knob("global_sparsity", float, ("0.3",), "Targets of one model-wide |x| "
                       "threshold, in [0, 1).", check=in_unit("global_sparsity"))


def thresholds(ctx, target: float) -> dict:
  """{layer: {site: t}} with one t: the target quantile of all sites' |x| pooled."""
  inputs = ctx.model.site_inputs(ctx.base, ctx.calib_ids[:8])
  pooled = np.concatenate([np.abs(np.asarray(x, np.float32)).ravel()
                           for sites in inputs.values() for x in sites.values()])
  t = float(np.quantile(pooled, target))
  return {layer: dict.fromkeys(sites, t) for layer, sites in inputs.items()}


def points(ctx):
  for target in ctx.grid["global_sparsity"]:
    yield Point(f"target={target}", peers.apply_sparsity(ctx.base, thresholds(ctx, target)))


METHOD = Method("sparsity_global", "Magnitude sparsity with one |x| threshold for the whole "
                "model.", (GLOBAL_SPARSITY,), points, by_tree(sparse_bytes), KEPT_ROWS)
