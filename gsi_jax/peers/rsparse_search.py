"""R-Sparse's per-layer recipe: how each site splits its bytes between kept inputs and rank.

R-Sparse gives every linear map the same share 1 − s of its dense bytes and splits it
with a ratio α: a share (1 − s) α of the inputs, those of largest |x|, is read exactly
through W's rows, and the rest goes through a rank-r SVD of W itself, with

    r = ⌊(1 − s)(1 − α) d O / (d + O)⌋,

so α = 1 is magnitude sparsity at s and α = 0 a static low-rank W.  Its paper picks
one α for every map by a grid search, then searches α per layer with an evolutionary
algorithm whose fitness is the model's perplexity on calibration text (its released
Llama-3-8B recipe keeps s = 0.5 everywhere and moves α alone).  Here α is per site:
q, k and v share one input and so one threshold (as for TEAL's greedy levels), and
each map of the site takes its own rank from that α.

The search keeps the best `parents` of each generation (so the uniform start, in the
first generation, is never lost) and fills the population with children: uniform
crossover of two parents, then a Gaussian step on a share of the genes.  Candidates
are scored with their factors zero-padded to the rank at α = 0, the same products,
so that every candidate runs one compiled program.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable

import numpy as np

from gsi_jax import metrics, peers
from gsi_jax.errors import GSIError
from gsi_jax.models import params as P

# The |x| quantile table each site's thresholds are read from: these levels in [0, 1].
QUANTILE_LEVELS = np.linspace(0, 1, 4001)


@dataclasses.dataclass(frozen=True)
class SearchConfig:
  """population: candidates per generation; parents: the best kept each generation;
  mutation_rate: the share of a child's genes (α of one site) moved; mutation_scale:
  the standard deviation of a move; windows: the calibration windows of the fitness."""
  population: int = 8
  parents: int = 4
  generations: int = 6
  mutation_rate: float = 0.2
  mutation_scale: float = 0.1
  windows: int = 8
  seed: int = 0

  def __post_init__(self):
    if not 2 <= self.parents < self.population:
      raise GSIError(f"R-Sparse search needs 2 <= parents < population, got parents="
                     f"{self.parents}, population={self.population}")
    if self.generations < 0:
      raise GSIError(f"R-Sparse search generations must be >= 0, got {self.generations}")
    if not 0 < self.mutation_rate <= 1:
      raise GSIError(f"R-Sparse mutation rate must lie in (0, 1], got {self.mutation_rate}")
    if not self.mutation_scale > 0:
      raise GSIError(f"R-Sparse mutation scale must be > 0, got {self.mutation_scale}")
    if self.windows < 1:
      raise GSIError(f"R-Sparse search windows must be >= 1, got {self.windows}")


def check_budget(sparsity: float, alpha: float | None = None):
  if not 0 <= sparsity < 1:
    raise GSIError(f"R-Sparse's sparsity s must lie in [0, 1), got {sparsity}")
  if alpha is not None and not 0 <= alpha <= 1:
    raise GSIError(f"R-Sparse's ratio alpha must lie in [0, 1], got {alpha}")


def kept_share(sparsity: float, alpha: float) -> float:
  """The share of a site's inputs read exactly: (1 − s) α."""
  return (1 - sparsity) * alpha


def map_rank(d: int, o: int, sparsity: float, alpha: float) -> int:
  """The rank that spends the rest of the map's budget: ⌊(1 − s)(1 − α) d O / (d + O)⌋."""
  return min(int((1 - sparsity) * (1 - alpha) * d * o / (d + o)), d, o)


def map_ranks(params, sparsity: float, alphas: dict) -> dict:
  """{layer: {site: {map: r}}} for α per site ({layer: {site: α}})."""
  return {layer: {site: {name: map_rank(W.shape[0], W.shape[1], sparsity, alphas[layer][site])
                         for name, W in kernels.items()}
                  for site, kernels in sites.items()}
          for layer, sites in P.site_kernels(params).items()}


class Recipes:
  """R-Sparse trees at one s for any α per site: thresholds from each site's |x| quantiles
  on the dense model's calibration inputs, factors cut from one SVD of each W."""

  def __init__(self, model, params, windows_NT: np.ndarray, sparsity: float,
               svds: dict | None = None, max_windows: int = 8):
    check_budget(sparsity)
    self.params, self.sparsity = params, sparsity
    self.svds = peers.weight_svds(params) if svds is None else svds
    self.quantiles = {
        layer: {site: np.quantile(np.abs(np.asarray(x, np.float32)), QUANTILE_LEVELS)
                for site, x in sites.items()}
        for layer, sites in model.site_inputs(params, windows_NT[:max_windows]).items()}
    self.sites = [(layer, site) for layer, sites in P.site_kernels(params).items()
                  for site in sites]
    self.widths = map_ranks(params, sparsity, P.per_site(params, 0.0))

  def alphas(self, genome: np.ndarray) -> dict:
    """{layer: {site: α}} from a genome (one α per site, in `sites` order)."""
    out = {}
    for (layer, site), a in zip(self.sites, genome):
      out.setdefault(layer, {})[site] = float(a)
    return out

  def genome(self, alphas: dict) -> np.ndarray:
    return np.array([alphas[layer][site] for layer, site in self.sites])

  def threshold(self, layer: str, site: str, alpha: float) -> float:
    """The |x| quantile that keeps a share (1 − s) α of the site's inputs (none: ∞)."""
    keep = kept_share(self.sparsity, alpha)
    if keep <= 0:
      return float("inf")
    return float(np.interp(1 - keep, QUANTILE_LEVELS, self.quantiles[layer][site]))

  def tree(self, alphas: dict, padded: bool = False):
    """The R-Sparse tree of α per site; padded: factors at the width of α = 0 (the same
    function; one compiled program for every candidate)."""
    for sites in alphas.values():
      for a in sites.values():
        check_budget(self.sparsity, a)
    factored = peers.weight_factors(self.params, map_ranks(self.params, self.sparsity, alphas),
                                    self.svds, self.widths if padded else None)
    return peers.apply_sparsity(factored, {
        layer: {site: self.threshold(layer, site, a) for site, a in sites.items()}
        for layer, sites in alphas.items()})


def evolve(fitness: Callable[[np.ndarray], float], start: np.ndarray, config: SearchConfig,
           progress: bool = True) -> tuple[np.ndarray, list[dict]]:
  """(the genome of lowest fitness, per generation {best, mean, evaluations}, the first
  also {start}: its fitness): genes in [0, 1]; the start is scored in the first
  generation and kept while nothing beats it."""
  rng = np.random.default_rng(config.seed)

  def mutate(genome):
    moved = rng.random(genome.shape) < config.mutation_rate
    return np.clip(genome + moved * rng.normal(0, config.mutation_scale, genome.shape), 0, 1)

  start_time = time.time()
  history = []

  def scored(genomes, survivors=()):
    ranked = sorted([*survivors, *((fitness(g), i, g) for i, g in genomes)],
                    key=lambda t: (t[0], t[1]))
    history.append({"generation": len(history), "best": float(ranked[0][0]),
                    "mean": float(np.mean([t[0] for t in ranked])),
                    "evaluations": len(genomes)})
    if progress:
      logging.info("R-Sparse search generation %d: best calibration NLL %.4f (%.0f s)",
                   len(history) - 1, ranked[0][0], time.time() - start_time)
    return ranked

  born = iter(range(10 ** 9))  # ties go to the earlier-born genome: the start first
  population = scored([(next(born), start)] +
                      [(next(born), mutate(start)) for _ in range(config.population - 1)])
  history[0]["start"] = next(float(f) for f, i, _ in population if i == 0)
  for _ in range(config.generations):
    parents = population[:config.parents]
    children = []
    for _ in range(config.population - config.parents):
      a, b = rng.choice(len(parents), 2, replace=False)
      mixed = np.where(rng.random(start.shape) < 0.5, parents[a][2], parents[b][2])
      children.append((next(born), mutate(mixed)))
    population = scored(children, parents)
  return population[0][2], history


def search(model, recipes: Recipes, windows_NT: np.ndarray, start_alpha: float,
           config: SearchConfig = SearchConfig(), progress: bool = True):
  """({layer: {site: α}}, history): R-Sparse's per-site α at the recipes' s, from one α
  everywhere; fitness is the mean next-token NLL on the first `config.windows`
  calibration windows."""
  check_budget(recipes.sparsity, start_alpha)
  ids = np.asarray(windows_NT)[:config.windows]

  def fitness(genome):
    params = recipes.tree(recipes.alphas(genome), padded=True)
    return float(metrics.score(model, params, ids)["nll"].mean())

  best, history = evolve(fitness, np.full(len(recipes.sites), start_alpha), config, progress)
  return recipes.alphas(best), history
