"""R-Sparse's per-layer recipe (`gsi_jax.peers.rsparse_search`): the budget split, the padded
candidates, the fast path, and the evolutionary search on a known fitness."""

import numpy as np
import pytest

import gsi_jax
from gsi_jax import make_gate, metrics
from gsi_jax.peers import rsparse_search
from gsi_jax.metrics import bytes as mbytes
from gsi_jax.models import params as P
from gsi_jax.peers.rsparse_search import Recipes, SearchConfig, evolve, map_ranks

RNG = np.random.default_rng(3)
CALIB = RNG.integers(0, 101, (8, 16)).astype(np.int32)


@pytest.fixture(scope="module")
def recipes(tiny_folder):
  model = gsi_jax.load_model(tiny_folder("llama_gqa")[0])
  return model, Recipes(model, model.params, CALIB, 0.5)


def mixed_alphas(params, values=(0.0, 0.3, 0.7, 1.0)):
  """α per site cycling through `values`: pure rank, both, and pure sparsity."""
  sites = [(layer, site) for layer, s in P.site_kernels(params).items() for site in s]
  out = {}
  for i, (layer, site) in enumerate(sites):
    out.setdefault(layer, {})[site] = values[i % len(values)]
  return out


def test_each_site_spends_one_minus_s_of_its_bytes(recipes):
  """Kept rows at (1 − s) α plus the rank's factors: (1 − s) of the site's dense
  elements, short of it by less than one rank step (d + O) per map."""
  model, r = recipes
  alphas = mixed_alphas(model.params)
  tree = r.tree(alphas)
  for layer, site, d, o in P.site_shapes(model.params):
    a = alphas[layer][site]
    node = tree[layer][site]
    for name, W in node[P.KERNEL].items():
      rank = rsparse_search.map_rank(d, W.shape[1], 0.5, a)
      assert node[P.FACTOR_IN][name].shape == (d, rank)
      assert node[P.FACTOR_OUT][name].shape == (rank, W.shape[1])
    spent = mbytes.kept_site_elements(node, d, o, (1 - 0.5) * a)
    slack = sum(d + W.shape[1] for W in node[P.KERNEL].values())
    assert 0.5 * d * o - slack < spent <= 0.5 * d * o + 1e-6
  assert map_ranks(model.params, 0.5, P.per_site(model.params, 1.0)) == {
      layer: {site: {n: 0 for n in k} for site, k in s.items()}
      for layer, s in P.site_kernels(model.params).items()}


def test_kept_shares_follow_alpha(recipes):
  """The first site sees the dense model's inputs, on which thresholds are set: it keeps
  (1 − s) α of them; α = 0 keeps none anywhere."""
  model, r = recipes
  first = P.layers(model.params)[0]
  for a in (0.3, 0.7, 1.0):
    kept = metrics.score(model, r.tree(P.per_site(model.params, a)), CALIB)
    assert kept["kept_share_by_layer"][first]["attn_in"] == pytest.approx(0.5 * a, abs=0.01)
  nothing = metrics.score(model, r.tree(P.per_site(model.params, 0.0)), CALIB)
  assert all(v == 0 for s in nothing["kept_share_by_layer"].values() for v in s.values())


def test_padded_candidates_compute_the_same_function(recipes):
  model, r = recipes
  alphas = mixed_alphas(model.params, (0.2, 0.9, 0.0, 0.5))
  padded = r.tree(alphas, padded=True)
  for layer, sites in r.widths.items():
    for site, maps in sites.items():
      assert {n: A.shape[1] for n, A in padded[layer][site][P.FACTOR_IN].items()} == maps
  np.testing.assert_allclose(np.asarray(model.logits(padded, CALIB[:2])),
                             np.asarray(model.logits(r.tree(alphas), CALIB[:2])), atol=1e-5)


def test_fast_path_decodes_the_evaluation_paths_tokens(recipes):
  model, r = recipes
  params = r.tree(mixed_alphas(model.params))
  prompt = CALIB[:1, :5]
  fast = model.generate(params, prompt, 10, make_gate(0.0, batch1_switch=True),
                        stop_at_eos=False)
  np.testing.assert_array_equal(np.asarray(fast),
                                np.asarray(model.generate(params, prompt, 10, None,
                                                          stop_at_eos=False)))


def test_search_scores_candidates_and_keeps_the_best(recipes):
  model, r = recipes
  config = SearchConfig(population=3, parents=2, generations=1, windows=2)
  alphas, history = rsparse_search.search(model, r, CALIB, 0.8, config, progress=False)
  assert [h["evaluations"] for h in history] == [3, 1]
  assert history[1]["best"] <= history[0]["best"] <= history[0]["start"]
  uniform = r.tree(P.per_site(model.params, 0.8), padded=True)
  assert history[0]["start"] == pytest.approx(
      metrics.score(model, uniform, CALIB[:2])["nll"].mean(), abs=1e-6)
  best = metrics.score(model, r.tree(alphas), CALIB[:2])["nll"].mean()
  assert best == pytest.approx(history[-1]["best"], abs=1e-4)


def test_evolve_improves_a_known_fitness_and_never_loses_its_start():
  target = np.linspace(0.1, 0.9, 12)
  fitness = lambda g: float(np.sum((g - target) ** 2))
  start = np.full(12, 0.5)
  config = SearchConfig(population=8, parents=3, generations=30, mutation_rate=0.3,
                        mutation_scale=0.1, seed=1)
  best, history = evolve(fitness, start, config, progress=False)
  bests = [h["best"] for h in history]
  assert bests == sorted(bests, reverse=True) and len(history) == 31
  assert fitness(best) == bests[-1] < 0.25 * fitness(start)
  assert np.all((0 <= best) & (best <= 1))
  again, _ = evolve(fitness, start, config, progress=False)
  np.testing.assert_array_equal(best, again)  # one seed, one result
  at_optimum, _ = evolve(fitness, target.copy(), SearchConfig(generations=3), progress=False)
  np.testing.assert_array_equal(at_optimum, target)  # nothing beats the start: kept


@pytest.mark.parametrize("kwargs, message", [
    ({"population": 4, "parents": 4}, "parents < population"),
    ({"parents": 1}, "parents < population"),
    ({"generations": -1}, "generations must be >= 0"),
    ({"mutation_rate": 0.0}, "mutation rate must lie in"),
    ({"mutation_scale": 0.0}, "mutation scale must be > 0"),
    ({"windows": 0}, "windows must be >= 1"),
])
def test_bad_search_configs_are_refused(kwargs, message):
  with pytest.raises(gsi_jax.GSIError, match=message):
    SearchConfig(**kwargs)


def test_bad_budgets_are_refused(recipes):
  model, r = recipes
  with pytest.raises(gsi_jax.GSIError, match="sparsity s must lie in"):
    Recipes(model, model.params, CALIB, 1.0)
  with pytest.raises(gsi_jax.GSIError, match="ratio alpha must lie in"):
    r.tree(P.per_site(model.params, 1.5))
