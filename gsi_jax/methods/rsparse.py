"""R-Sparse (beyond the paper's peers): kept inputs exactly through W's rows, dropped ones
through a rank-r SVD of W.  rsparse sweeps one rank everywhere and R-Sparse's own recipe
(each map's bytes cut to 1 − s and split by a ratio α between kept inputs and rank);
rsparse_searched searches α per site from the recipe grid's best, an allocation
(`per_site.with_fallback`) found by R-Sparse's evolutionary search."""

from __future__ import annotations

import dataclasses

from gsi_jax import peers
from gsi_jax.peers import rsparse_search
from gsi_jax.errors import GSIError
from gsi_jax.methods.per_site import Space, with_fallback
from gsi_jax.methods.common import KEPT_ROWS, by_tree, in_unit, positive, sparse_bytes
from gsi_jax.methods.registry import Knob, Method, Point, register
from gsi_jax.models import params as P

RSPARSE_RANKS = Knob("rsparse_ranks", int, ("8", "32", "64"), "R-Sparse ranks of each map's SVD.",
                     check=positive("rsparse_ranks"))
RSPARSE_SPARSITY = Knob("rsparse_sparsity", float, ("0.5", "0.6", "0.7"),
                        "R-Sparse target input sparsities in [0, 1).",
                        check=in_unit("rsparse_sparsity"))
RECIPE_SPARSITY = Knob("rsparse_recipe_sparsity", float, ("0.4", "0.5"),
                       "R-Sparse recipes' s: each map reads 1 - s of its dense bytes, in [0, 1) "
                       "(empty: skip the recipes and their search).",
                       check=in_unit("rsparse_recipe_sparsity"), may_be_empty=True)
ALPHA = Knob("rsparse_alpha", float, ("0.8", "0.9", "1.0"),
             "R-Sparse recipes' uniform alpha, the share of each map's budget spent on kept "
             "inputs (the rest on rank), in [0, 1]; the search starts from the best.",
             check=lambda v: None if all(0 <= a <= 1 for a in v) else
             f"--rsparse_alpha values must lie in [0, 1], got {list(v)}", may_be_empty=True)
POPULATION = Knob("rsparse_search_population", int, 8, "Candidates per generation of the "
                  "R-Sparse search.", many=False)
PARENTS = Knob("rsparse_search_parents", int, 4, "Candidates kept per generation.", many=False)
GENERATIONS = Knob("rsparse_search_generations", int, 6, "Generations of the R-Sparse search.",
                   many=False)
WINDOWS = Knob("rsparse_search_windows", int, 8, "Calibration windows of the R-Sparse search's "
               "fitness (mean NLL; 8 are the windows its fallback is judged on).", many=False)


def search_config(grid) -> rsparse_search.SearchConfig:
  return rsparse_search.SearchConfig(
      population=grid["rsparse_search_population"], parents=grid["rsparse_search_parents"],
      generations=grid["rsparse_search_generations"], windows=grid["rsparse_search_windows"])


def _recipes(ctx, s) -> rsparse_search.Recipes:
  svds = ctx.shared("weight_svds", lambda: peers.weight_svds(ctx.base))
  return ctx.shared(("rsparse_recipes", s), lambda: rsparse_search.Recipes(
      ctx.model, ctx.base, ctx.calib_ids, s, svds))


def _uniform_nll(ctx, s, alpha) -> float:
  """The calibration NLL of the recipe at one alpha everywhere (the grid's and the
  search's start, computed once)."""
  return ctx.shared(("rsparse_nll", s, alpha), lambda: ctx.calib_nll(
      _recipes(ctx, s).tree(P.per_site(ctx.base, alpha)), None))


def _points(ctx):
  for rank in ctx.grid["rsparse_ranks"]:
    factored = peers.weight_factors(ctx.base, rank)
    for sp in ctx.grid["rsparse_sparsity"]:
      yield Point(f"rank={rank},target={sp}", peers.apply_sparsity(factored,
                                                                   ctx.thresholds(sp)))
  for s in ctx.grid["rsparse_recipe_sparsity"]:
    recipes = _recipes(ctx, s)
    for alpha in ctx.grid["rsparse_alpha"]:
      alphas = P.per_site(ctx.base, alpha)
      # The search scores candidates with padded factors: the same function, other roundings.
      padded = ctx.calib_nll(recipes.tree(alphas, padded=True), None)
      yield Point(f"s={s},alpha={alpha}", recipes.tree(alphas), shares=True,
                  extra={"calib_nll": _uniform_nll(ctx, s, alpha), "calib_nll_padded": padded})


def _searched_points(ctx):
  config = search_config(ctx.grid)
  for s in ctx.grid["rsparse_recipe_sparsity"]:
    recipes = _recipes(ctx, s)
    uniform = {alpha: _uniform_nll(ctx, s, alpha) for alpha in ctx.grid["rsparse_alpha"]}
    start = min(uniform, key=uniform.get)
    searched, history = rsparse_search.search(ctx.model, recipes, ctx.calib_ids, start, config)
    space = Space(P.per_site(ctx.base, start), recipes.tree, ctx.base, None, sparse_bytes)
    chosen, fields = with_fallback(ctx, "rsparse_searched", f"s={s}", space, searched,
                                   uniform[start], "searched")
    yield Point(f"s={s}", recipes.tree(chosen), shares=True, extra={
        "allocation": chosen, "map_ranks": rsparse_search.map_ranks(ctx.base, s, chosen),
        "searched_allocation": searched, "start_alpha": start, "search": history,
        "search_config": dataclasses.asdict(config), **fields})


def _check_searched(grid, experiment):
  search_config(grid)  # its own checks, before any compute
  if grid["rsparse_recipe_sparsity"] and not grid["rsparse_alpha"]:
    raise GSIError("rsparse_searched starts from the best --rsparse_alpha: give at least one")


R_SPARSE_PATH = {platform: f"kept rows: {path}; dropped inputs: two thin maps x A B"
                 for platform, path in KEPT_ROWS.items()}
register(Method(
    "rsparse", "R-Sparse: kept inputs through W's rows, dropped ones through W's rank-r SVD; "
    "one rank everywhere, and R-Sparse's recipe at each s and alpha.",
    (RSPARSE_RANKS, RSPARSE_SPARSITY, RECIPE_SPARSITY, ALPHA), _points, by_tree(sparse_bytes),
    R_SPARSE_PATH))
register(Method(
    "rsparse_searched", "R-Sparse's recipe with alpha searched per site by its evolutionary "
    "search, from the grid's best alpha.",
    (RECIPE_SPARSITY, ALPHA, POPULATION, PARENTS, GENERATIONS, WINDOWS), _searched_points,
    by_tree(sparse_bytes), R_SPARSE_PATH, uniform="rsparse", check=_check_searched,
    runs_on=lambda grid, model: bool(grid["rsparse_recipe_sparsity"])))
