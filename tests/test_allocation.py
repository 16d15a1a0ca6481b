"""Learned per-site budgets: the straight-through gate, per-site knobs, the budget search."""

import jax
import numpy as np
import pytest

import gsi_jax
from gsi_jax import GSIError, make_gate, metrics, peers
from gsi_jax.peers import allocation, greedy_sparsity
from gsi_jax.metrics import bytes as mbytes
from gsi_jax.models import params as P

RNG = np.random.default_rng(2)
CALIB = RNG.integers(0, 101, (8, 16)).astype(np.int32)


@pytest.fixture(scope="module")
def llama_bases(tiny_folder):
  model = gsi_jax.load_model(tiny_folder("llama_gqa")[0])
  return model, gsi_jax.calibrate(model, model.params, CALIB, k_max=24, seq_len=16,
                                  progress=False)


@pytest.fixture(scope="module")
def llama(llama_bases):
  model, bases = llama_bases
  return model, gsi_jax.apply_gsi(model.params, bases, 24)



def test_soft_mode_computes_the_hard_model(llama):
  """Straight-through: the forward pass of the soft gate is the hard one."""
  model, gsi = llama
  thresholds = peers.sparsity_thresholds(model, model.params, CALIB, 0.5)
  sparse = peers.apply_sparsity(model.params, thresholds)
  np.testing.assert_allclose(np.asarray(model.logits(sparse, CALIB[:2], make_gate(0.0, "soft"))),
                             np.asarray(model.logits(sparse, CALIB[:2])), atol=1e-5)
  eps = P.with_site_values(gsi, P.EPS, P.per_site(gsi, 0.4))
  np.testing.assert_allclose(np.asarray(model.logits(eps, CALIB[:2], make_gate(0.0, "soft"))),
                             np.asarray(model.logits(gsi, CALIB[:2], make_gate(0.4))), atol=1e-5)


def test_site_eps_overrides_the_gate(llama):
  model, gsi = llama
  values = P.per_site(gsi, 0.0)
  values["layer_0"]["mlp_out"] = 10.0  # one site always fast, the rest never
  _, state = model.forward(P.with_site_values(gsi, P.EPS, values), CALIB[:2], make_gate(0.5))
  fast = {(layer, site): float(np.mean(v["fast"][0]))
          for layer, sites in state["gate_stats"].items() for site, v in sites.items()}
  assert fast.pop(("layer_0", "mlp_out")) == 1.0
  assert set(fast.values()) == {0.0}


@pytest.mark.parametrize("knob", [P.THRESHOLD, P.EPS])
def test_learning_moves_every_knob_and_keeps_the_budget_term(llama, knob):
  model, gsi = llama
  if knob == P.THRESHOLD:
    params, init = model.params, allocation.floored(
        peers.sparsity_thresholds(model, model.params, CALIB, 0.5))
  else:
    params, init = gsi, P.per_site(gsi, 0.4)
  config = allocation.AllocationConfig(budget=0.5, steps=3, batch_windows=2, seq_len=16)
  learned, history = allocation.learn_allocation(model, params, {knob: init}, CALIB, config,
                                                 progress=False)
  assert [h["step"] for h in history] == [0, 1, 2]
  assert all(h["loss"] >= h["kl"] >= -1e-6 and 0 < h["bytes_fraction"] for h in history)
  assert jax.tree.structure(learned) == jax.tree.structure({knob: init})
  assert np.mean(moved(learned[knob], init) > 1e-4) > 0.5  # Adam moves the knobs with a gradient


def moved(learned, init):
  return np.array([abs(np.log(learned[l][s] / init[l][s])) for l in init for s in init[l]])


def test_rank_mask_computes_the_truncated_tree_and_its_bytes(llama):
  """A rank r masks V to its first kept_columns(r) columns: the soft-gate forward pass
  and the expected bytes are those of the tree truncate_ranks cuts, and the rank has
  a gradient (the columns beside the cut)."""
  model, gsi = llama
  t = peers.sparsity_thresholds(model, gsi, CALIB, 0.5)
  ranks = P.per_site(gsi, 7.3)
  ranks["layer_0"]["mlp_in"] = 0.2  # no subspace: the residual is the input
  kept = allocation.kept_ranks(gsi, ranks)
  assert kept["layer_0"]["attn_in"] == 7 and kept["layer_0"]["mlp_in"] == 0
  cut = gsi_jax.apply_residual_sparsity(gsi_jax.truncate_ranks(gsi, kept), t)
  values = {P.RESIDUAL_THRESHOLD: t, allocation.RANK: ranks}
  masked = allocation.with_values(gsi, values)
  soft = make_gate(0.0, "soft")
  logits, stats = model.forward(masked, CALIB[:2], soft, ("sparsity_stats",))
  np.testing.assert_allclose(np.asarray(logits), np.asarray(model.logits(cut, CALIB[:2])),
                             atol=1e-5)
  shares = {l: {s: float(np.mean(v["kept"][0])) for s, v in sites.items()}
            for l, sites in stats["sparsity_stats"].items()}
  assert float(allocation.expected_bytes(masked, values, stats)) == pytest.approx(
      mbytes.sparsity_bytes(cut, shares, None), rel=1e-6)

  def first_logit(rank):
    r = {**ranks, "layer_0": {**ranks["layer_0"], "attn_in": rank}}
    return model.forward(allocation.with_values(gsi, {**values, allocation.RANK: r}),
                         CALIB[:1], soft)[0][0, -1, 0]
  assert abs(float(jax.grad(first_logit)(7.3))) > 0


def test_truncated_ranks_are_the_lower_rank_tree(llama_bases):
  """The bases are nested: cutting the rank-24 tree to rank 9 gives apply_gsi's rank-9
  tree (V exactly, M up to float32 rounding)."""
  model, bases = llama_bases
  cut = gsi_jax.truncate_ranks(gsi_jax.apply_gsi(model.params, bases, 24),
                               P.per_site(model.params, 9))
  built = gsi_jax.apply_gsi(model.params, bases, 9)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5,
                                                       atol=1e-6), cut, built)


def test_truncated_ranks_decode_alike_on_both_paths(llama):
  """Sites at different ranks, one at rank 0: the batch-1 fast path gives the
  evaluation path's greedy tokens."""
  model, gsi = llama
  ranks = {l: {s: (3 * i + len(s)) % 25 for s in sites}
           for i, (l, sites) in enumerate(P.per_site(gsi, 0).items())}
  ranks["layer_0"]["attn_in"] = 0
  cut = gsi_jax.truncate_ranks(gsi, ranks)
  assert cut["layer_0"]["mlp_in"][P.V].shape == (gsi["layer_0"]["mlp_in"][P.V].shape[0],
                                                 ranks["layer_0"]["mlp_in"])
  sparse = gsi_jax.apply_residual_sparsity(cut, peers.sparsity_thresholds(model, cut, CALIB, 0.5))
  prompt = CALIB[:1, :6]
  fast = model.generate(sparse, prompt, 6, make_gate(0.0, batch1_switch=True), stop_at_eos=False)
  np.testing.assert_array_equal(np.asarray(fast),
                                np.asarray(model.generate(sparse, prompt, 6, stop_at_eos=False)))
  with pytest.raises(GSIError, match="rank 25 is outside 0..24"):
    gsi_jax.truncate_ranks(gsi, {"layer_0": {"mlp_in": 25}})
  with pytest.raises(GSIError, match="has no V_k"):
    gsi_jax.truncate_ranks(model.params, {"layer_0": {"mlp_in": 2}})


def test_learning_ranks_with_the_residual_threshold(llama):
  model, gsi = llama
  t = allocation.floored(peers.sparsity_thresholds(model, gsi, CALIB, 0.5))
  init = {P.RESIDUAL_THRESHOLD: t, allocation.RANK: P.per_site(gsi, 8.0)}
  config = allocation.AllocationConfig(budget=0.4, steps=3, batch_windows=2, seq_len=16,
                                       learning_rate=0.2)
  learned, history = allocation.learn_allocation(model, gsi, init, CALIB, config,
                                                 progress=False)
  assert jax.tree.structure(learned) == jax.tree.structure(init) and len(history) == 3
  assert np.mean(moved(learned[allocation.RANK], init[allocation.RANK]) > 1e-4) > 0.5
  assert np.mean(moved(learned[P.RESIDUAL_THRESHOLD], t) > 1e-4) > 0.5


def test_a_dense_log_prob_cache_learns_the_same_values(llama):
  """Allocations learned one after another on the same windows share the dense model's
  log-probs: one entry a batch drawn, and the values learned without it, bit for bit."""
  model, gsi = llama
  t = allocation.floored(peers.sparsity_thresholds(model, gsi, CALIB, 0.5))
  init = {P.RESIDUAL_THRESHOLD: t}
  config = allocation.AllocationConfig(budget=0.4, steps=3, batch_windows=2, seq_len=16)
  alone, _ = allocation.learn_allocation(model, gsi, init, CALIB, config, progress=False)
  cache = {}
  for _ in range(2):
    shared, _ = allocation.learn_allocation(model, gsi, init, CALIB, config, progress=False,
                                            dense_logp_cache=cache)
    assert shared == alone
  assert 1 <= len(cache) <= 3 and all(key[0] == 16 for key in cache)


def test_scale_to_budget_meets_the_target():
  values = {"layer_0": {"attn_in": 1.0, "mlp_in": 4.0}}
  cost = lambda v: 1.0 / (1.0 + v["layer_0"]["attn_in"] + v["layer_0"]["mlp_in"])
  scaled = allocation.scale_to_budget(values, cost, 0.1, iterations=30)
  assert cost(scaled) <= 0.1 and cost(scaled) == pytest.approx(0.1, rel=1e-3)
  assert scaled["layer_0"]["mlp_in"] / scaled["layer_0"]["attn_in"] == pytest.approx(4.0)


def test_bad_allocation_input(llama):
  model, gsi = llama
  with pytest.raises(GSIError, match="budget must be > 0"):
    allocation.AllocationConfig(budget=0.0)
  with pytest.raises(GSIError, match="steps must be >= 1"):
    allocation.AllocationConfig(budget=0.5, steps=0)
  config = allocation.AllocationConfig(budget=0.5, steps=1)
  learn = lambda init: allocation.learn_allocation(model, gsi, init, CALIB, config)
  with pytest.raises(GSIError, match=r"learns one knob of .*, got \['width'\]"):
    learn({"width": P.per_site(gsi, 0.4)})
  with pytest.raises(GSIError, match="learns one knob"):
    learn({P.EPS: P.per_site(gsi, 0.4), P.THRESHOLD: P.per_site(gsi, 0.4)})
  with pytest.raises(GSIError, match="ranks are learned beside 'residual_threshold' only"):
    learn({P.EPS: P.per_site(gsi, 0.4), allocation.RANK: P.per_site(gsi, 4.0)})
  with pytest.raises(GSIError, match=r"a learned rank starts in \(0, 24\]"):
    learn({P.RESIDUAL_THRESHOLD: P.per_site(gsi, 0.4), allocation.RANK: P.per_site(gsi, 30.0)})
  with pytest.raises(GSIError, match="positive knob values only"):
    learn({P.EPS: P.per_site(gsi, 0.0)})
  assert allocation.floored({"a": {"b": 0.0}}) == {"a": {"b": 1e-6}}


def test_greedy_allocation_meets_each_target_and_thresholds_its_levels(llama):
  """TEAL's greedy path: each target takes the first point at or above it, and each
  site's threshold drops its level's share of that site's dense inputs."""
  model, _ = llama
  config = greedy_sparsity.GreedyConfig(step=0.05, windows=4)
  thresholds, levels = greedy_sparsity.greedy_allocation(model, model.params, CALIB,
                                                         (0.3, 0.6), config, progress=False)
  sizes = {site: sum(W.size for W in kernels.values())
           for site, kernels in P.site_kernels(model.params)["layer_0"].items()}
  for target in (0.3, 0.6):
    for layer, by_site in levels[target].items():
      weighted = sum(by_site[s] * sizes[s] for s in sizes) / sum(sizes.values())
      assert target - 1e-9 <= weighted < target + config.step + 1e-9
      assert all(0 <= v <= config.max_site_sparsity for v in by_site.values())
  assert levels[0.6]["layer_0"] != {s: 0.6 for s in sizes}  # not uniform
  # Layer 0's attention input is the dense model's: its kept share there is 1 - level.
  sparse = peers.apply_sparsity(model.params, thresholds[0.6])
  kept = metrics.score(model, sparse, CALIB[:4])["kept_share_by_layer"]["layer_0"]["attn_in"]
  assert kept == pytest.approx(1 - levels[0.6]["layer_0"]["attn_in"], abs=0.02)
  with pytest.raises(GSIError, match="greedy targets must lie in"):
    greedy_sparsity.greedy_allocation(model, model.params, CALIB, (1.0,), config)
  with pytest.raises(GSIError, match="greedy step must lie in"):
    greedy_sparsity.GreedyConfig(step=0)


def test_block_error_is_teals_norm_over_the_last_positions():
  dense = np.zeros((2, 8, 3))
  y = dense.copy()
  y[:, :6] = 5.0  # outside the last quarter: not measured
  assert greedy_sparsity.block_error(y, dense, 0.25) == 0.0
  y[:, 6:] = 1.0  # norm over 2 positions of ones
  assert greedy_sparsity.block_error(y, dense, 0.25) == pytest.approx(np.sqrt(2))
