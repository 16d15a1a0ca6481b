"""What every method's points read: the base tree, the calibration windows and bases,
the grid, the evaluator's calibration scores, and the calibration statistics methods
share (Gram matrices, magnitude thresholds, the head's basis, weight SVDs), each computed
once per run however many methods use it."""

from __future__ import annotations

from typing import Any, Callable, Hashable, Mapping

import gsi_jax
from gsi_jax import peers, progress
from gsi_jax.gsi import calibration


class Context:
  """grid: {knob name: value} for every registered knob; runs(name): whether this run
  evaluates that method; experiment: the shared flags (k, eps, impl, ...)."""

  def __init__(self, evaluator, experiment, grid: Mapping[str, Any],
               runs: Callable[[str], bool]):
    self.evaluator, self.experiment, self.grid, self.runs = evaluator, experiment, grid, runs
    self.model, self.base, self.dense_bytes = evaluator.model, evaluator.base, evaluator.dense_bytes
    self.calib_ids = evaluator.s.calib.ids
    self._shared: dict[Hashable, Any] = {}

  def shared(self, key: Hashable, compute: Callable[[], Any]) -> Any:
    """compute() once per run under key; later calls with that key return it."""
    if key not in self._shared:
      self._shared[key] = compute()
    return self._shared[key]

  def grams(self) -> dict:
    """Every site's Gram matrix over the calibration windows, on the base tree."""
    def compute():
      with progress.step("Gram matrices of every site on the calibration windows"):
        return calibration.gram_matrices(self.model, self.base, self.calib_ids, progress=False)
    return self.shared("grams", compute)

  def thresholds(self, target: float, params=None, key: Hashable = "base") -> dict:
    """{layer: {site: t}}: per site, the |x| quantile for a target sparsity, on `params`
    (the base tree unless given; `key` names that tree in the cache)."""
    tree = self.base if params is None else params

    def compute():
      with progress.step(f"|x| thresholds for sparsity {target} ({key} tree)"):
        return peers.sparsity_thresholds(self.model, tree, self.calib_ids, target)
    return self.shared(("thresholds", key, target), compute)

  @property
  def bases(self):
    """The run's GSI bases, restored or calibrated when a method first asks for them."""
    return self.evaluator.s.ensure_bases()

  def gsi(self, k: int, **kwargs):
    """The base tree rewritten by apply_gsi at rank k (cheap: not kept)."""
    return gsi_jax.apply_gsi(self.base, self.bases, k, **kwargs)

  def calib_scores(self, params, gate) -> dict:
    return self.evaluator.calib_scores(params, gate)

  def calib_nll(self, params, gate) -> float:
    return self.evaluator.calib_nll(params, gate)

