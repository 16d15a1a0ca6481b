"""GSI against its peers: quality against true bytes per token, and against measured speed.

  python experiments/pareto.py --k 128,256,384 --eps 0.05,0.1,0.2,0.5 --eval_tokens 4096 \
      --learned

Methods: gsi (k × eps), static projection (k), activation-aware weight SVD
(rank), magnitude activation sparsity (target sparsity), and three
extensions beyond the paper: gsi_out (the output-aware gate
‖W r‖ < eps ‖W x‖, k × eps), gsi_ladder (nested ranks: the --ladder ranks
below k, then k; k × eps), head (the LM head gated at --head_k, dense
sites; --head_eps), sparsity+head (both; sparsity × head_eps), larosa
(sparsity on inputs rotated into their PCA basis, at --larosa_sites),
residual (subspace plus sparse residual y = g M + r_S W_S: --residual_k ×
--residual_sparsity, the residual's target sparsity) and rsparse (R-Sparse:
kept inputs exact, dropped ones through a rank-r SVD of W: --rsparse_ranks ×
--rsparse_sparsity, and R-Sparse's own recipe, each map's bytes cut to 1 − s and
split by a ratio alpha between kept inputs and rank: --rsparse_recipe_sparsity ×
--rsparse_alpha), rsparse_searched (that recipe's alpha searched per site by
R-Sparse's evolutionary search from the best uniform alpha, `gsi_jax.rsparse_search`)
and cats (CATS, gated MLPs only: channels with small
|act(x W_gate)| skip their columns of W_up and rows of W_down; --cats_sparsity,
the share of channels dropped), and sparsity_greedy (TEAL's block-wise greedy
per-site levels, `gsi_jax.greedy_sparsity`, at --greedy_sparsity: the baseline
that learned allocations must beat).  With --learned, also sparsity_learned,
gsi_learned and residual_learned: per-site thresholds or ε learned with optax
(`gsi_jax.allocation`) at the uniform allocation's bytes on calibration text,
and residual_rank_learned: the residual's rank per site (up to
--learned_rank_max, from the nested bases) learned jointly with its threshold;
where the learned allocation scores worse than the uniform one on calibration
text, the uniform one is kept and the record says so (fallback).
--methods runs a subset of the sweeps.  Bytes count every weight each
method reads per decoded token, the LM head and embeddings included
(`gsi_jax.metrics.bytes`).  Every record also decodes at batch 1 through
its fast path (the batch-1 switch, kept rows only, two thin maps) for
tokens/s, beside dense decode timed in alternation with it: its
measured_speedup is against that dense figure.  One sweep per method.
"""

import dataclasses
import logging
import re

import jax
import matplotlib.pyplot as plt
import numpy as np
from absl import flags

import gsi_jax
from gsi_jax import (allocation, cli, distributed, experiment, greedy_sparsity, metrics, peers,
                     rsparse_search, sharding)
from gsi_jax.benchmarking import decode_tokens_per_s, paired_tokens_per_s
from gsi_jax.errors import GSIError
from gsi_jax.experiment import ExperimentConfig
from gsi_jax.gsi import calibration
from gsi_jax.metrics import bytes as mbytes
from gsi_jax.models import params as P

cli.define_experiment_flags()
flags.DEFINE_list("svd_ranks", ["32", "64", "128", "192", "256"], "Weight-SVD ranks.")
flags.DEFINE_list("sparsity", ["0.1", "0.25", "0.4", "0.5", "0.6", "0.7"],
                  "Magnitude-sparsity targets in [0, 1).")
flags.DEFINE_integer("output_sketch", 32, "Sketch columns of the output-aware gate (0: skip it).")
flags.DEFINE_list("ladder", ["64", "128", "256"], "Rank-ladder rungs (those below each k; "
                  "empty: skip the ladder).")
flags.DEFINE_integer("head_k", 384, "Rank of the gated LM head (0: skip it).")
flags.DEFINE_list("head_eps", ["0.1", "0.2"], "Gate thresholds of the LM head.")
flags.DEFINE_list("larosa_sites", ["attn_in", "mlp_in"], "Sites LaRoSA rotates (empty: skip "
                  "it); the rest stay plain magnitude sparsity.")
flags.DEFINE_list("residual_k", ["16", "32", "64", "128"], "Ranks of the sparse-residual sweep.")
flags.DEFINE_list("residual_sparsity", ["0.4", "0.5", "0.6", "0.7"],
                  "Target sparsities of the residual r = x - V_k g, in [0, 1).")
flags.DEFINE_list("rsparse_ranks", ["8", "32", "64"], "R-Sparse ranks of each map's SVD.")
flags.DEFINE_list("rsparse_sparsity", ["0.5", "0.6", "0.7"],
                  "R-Sparse target input sparsities in [0, 1).")
flags.DEFINE_list("rsparse_recipe_sparsity", ["0.4", "0.5"],
                  "R-Sparse recipes' s: each map reads 1 - s of its dense bytes, in [0, 1) "
                  "(empty: skip the recipes and their search).")
flags.DEFINE_list("rsparse_alpha", ["0.8", "0.9", "1.0"],
                  "R-Sparse recipes' uniform alpha, the share of each map's budget spent on "
                  "kept inputs (the rest on rank), in [0, 1]; the search starts from the best.")
flags.DEFINE_integer("rsparse_search_population", 8, "Candidates per generation of the "
                     "R-Sparse search.")
flags.DEFINE_integer("rsparse_search_parents", 4, "Candidates kept per generation.")
flags.DEFINE_integer("rsparse_search_generations", 6, "Generations of the R-Sparse search.")
flags.DEFINE_integer("rsparse_search_windows", 8, "Calibration windows of the R-Sparse "
                     "search's fitness (mean NLL; 8 are the windows its fallback is judged on).")
flags.DEFINE_list("cats_sparsity", ["0.4", "0.5", "0.6", "0.7", "0.8"],
                  "CATS target shares of dropped MLP channels, in [0, 1).")
flags.DEFINE_list("greedy_sparsity", ["0.4", "0.5", "0.6"],
                  "Layer sparsity targets of TEAL's greedy allocation, in (0, 1).")
flags.DEFINE_float("greedy_step", 0.02, "Layer sparsity added per greedy step.")
flags.DEFINE_integer("greedy_windows", 2, "Calibration windows the greedy block errors use.")
flags.DEFINE_integer("learned_residual_k", 32, "Rank of the learned sparse residual (where "
                     "residual_rank_learned's ranks start).")
flags.DEFINE_integer("learned_rank_max", 64, "Largest rank residual_rank_learned may give a "
                     "site.")
flags.DEFINE_integer("speed_repeats", 3, "Timed decodes per record, the best kept (0: skip "
                     "timing); each decodes --max_new_tokens from the first prompt.")
flags.DEFINE_bool("learned", False, "Also learn per-site budgets with optax.")
flags.DEFINE_list("learned_sparsity", ["0.4", "0.5", "0.6"],
                  "Uniform sparsity targets whose bytes the learned thresholds match.")
flags.DEFINE_list("learned_eps", ["0.5"],
                  "Uniform eps (at the largest --k) whose bytes the learned eps match.")
flags.DEFINE_float("learned_lambda", 100.0, "Penalty on leaving the byte budget while learning "
                   "(KL nats per squared bytes fraction).")
flags.DEFINE_integer("learned_steps", 24, "Adam steps per learned allocation.")
flags.DEFINE_list("methods", [], "Sweeps to run (empty: every method).")
FLAGS = flags.FLAGS
OUT = "results/pareto.json"
BUDGETS = (0.9, 0.75, 0.6, 0.5)
PPL_LIMITS = (1.01, 1.05, 1.10)
METHODS = ("gsi", "gsi_out", "gsi_ladder", "static", "svd", "sparsity", "head", "sparsity+head",
           "larosa", "residual", "rsparse", "cats", "sparsity_greedy", "sparsity_learned",
           "gsi_learned", "residual_learned", "residual_rank_learned", "rsparse_searched")
BEST_COLUMNS = ["ppl_ratio_limit", "method", "knob", "measured_speedup", "ppl_ratio",
                "bytes_fraction", "tokens_per_s", "dense_tokens_per_s"]
UNIFORM = {"sparsity_learned": "sparsity", "gsi_learned": "gsi", "residual_learned": "residual",
           "residual_rank_learned": "residual"}
# Records that gain the uniform method's perplexity ratio at their bytes.
ALLOCATED = {**UNIFORM, "sparsity_greedy": "sparsity", "rsparse_searched": "rsparse"}
COLUMNS = ["method", "knob", "bytes_fraction", "ppl_ratio", "top1_agreement",
           "generations_identical", "tokens_per_s", "dense_tokens_per_s", "measured_speedup"]


@dataclasses.dataclass(frozen=True)
class ParetoConfig:
  base: ExperimentConfig
  svd_ranks: tuple[int, ...]
  sparsity: tuple[float, ...]
  output_sketch: int
  ladder: tuple[int, ...]
  head_k: int
  head_eps: tuple[float, ...]
  larosa_sites: tuple[str, ...]
  residual_k: tuple[int, ...]
  residual_sparsity: tuple[float, ...]
  rsparse_ranks: tuple[int, ...]
  rsparse_sparsity: tuple[float, ...]
  rsparse_recipe_sparsity: tuple[float, ...]
  rsparse_alpha: tuple[float, ...]
  rsparse_search_population: int
  rsparse_search_parents: int
  rsparse_search_generations: int
  rsparse_search_windows: int
  cats_sparsity: tuple[float, ...]
  greedy_sparsity: tuple[float, ...]
  greedy_step: float
  greedy_windows: int
  learned_residual_k: int
  learned_rank_max: int
  methods: tuple[str, ...]
  speed_repeats: int
  learned: bool
  learned_sparsity: tuple[float, ...]
  learned_eps: tuple[float, ...]
  learned_lambda: float
  learned_steps: int

  def __post_init__(self):
    if any(r < 1 for r in self.svd_ranks):
      raise GSIError(f"--svd_ranks must be positive, got {list(self.svd_ranks)}")
    if any(not 0 <= s < 1 for s in self.sparsity):
      raise GSIError(f"--sparsity targets must lie in [0, 1), got {list(self.sparsity)}")
    if self.output_sketch < 0 or self.head_k < 0:
      raise GSIError("--output_sketch and --head_k must be >= 0")
    if any(r < 1 for r in self.ladder):
      raise GSIError(f"--ladder ranks must be positive, got {list(self.ladder)}")
    for e in self.head_eps + self.learned_eps:
      gsi_jax.ops.check_threshold("--head_eps and --learned_eps values", e)
    for name in ("learned_sparsity", "greedy_sparsity"):
      if any(not 0 < s < 1 for s in getattr(self, name)):
        raise GSIError(f"--{name} targets must lie in (0, 1), got {list(getattr(self, name))}")
    if any(e == 0 for e in self.learned_eps):
      raise GSIError("--learned_eps must be > 0: a zero gate has no allocation to learn")
    unknown = set(self.larosa_sites) - set(P.SITES)
    if unknown:
      raise GSIError(f"--larosa_sites: unknown sites {sorted(unknown)}; choose from {P.SITES}")
    for name in ("residual_sparsity", "rsparse_sparsity", "rsparse_recipe_sparsity",
                 "cats_sparsity"):
      if any(not 0 <= v < 1 for v in getattr(self, name)):
        raise GSIError(f"--{name} targets must lie in [0, 1), got {list(getattr(self, name))}")
    for name in ("residual_k", "rsparse_ranks"):
      if any(r < 1 for r in getattr(self, name)):
        raise GSIError(f"--{name} must be positive, got {list(getattr(self, name))}")
    if any(not 0 <= a <= 1 for a in self.rsparse_alpha):
      raise GSIError(f"--rsparse_alpha values must lie in [0, 1], got {list(self.rsparse_alpha)}")
    if self.runs("rsparse_searched") and self.rsparse_recipe_sparsity and not self.rsparse_alpha:
      raise GSIError("rsparse_searched starts from the best --rsparse_alpha: give at least one")
    _ = self.rsparse_search  # built now, so its flags are checked before any compute
    if self.learned_residual_k < 1:
      raise GSIError(f"--learned_residual_k must be positive, got {self.learned_residual_k}")
    if self.runs("residual_rank_learned") and not (
        self.learned_residual_k <= self.learned_rank_max):
      raise GSIError(f"--learned_rank_max ({self.learned_rank_max}) must be at least "
                     f"--learned_residual_k ({self.learned_residual_k}), where ranks start")
    ranks = self.residual_k + ((self.learned_residual_k,) if self.runs("residual_learned") else ()) \
        + ((self.learned_rank_max,) if self.runs("residual_rank_learned") else ())
    if self.runs("residual") and max(ranks) > self.base.k_max:
      raise GSIError(f"--residual_k, --learned_residual_k and --learned_rank_max (up to "
                     f"{max(ranks)}) need bases of at least that rank; the largest --k is "
                     f"{self.base.k_max}")
    unknown = set(self.methods) - set(METHODS)
    if unknown:
      raise GSIError(f"--methods: unknown {sorted(unknown)}; choose from {', '.join(METHODS)}")
    if self.speed_repeats < 0:
      raise GSIError(f"--speed_repeats must be >= 0, got {self.speed_repeats}")
    allocation.AllocationConfig(budget=1.0, lam=self.learned_lambda,
                                steps=self.learned_steps)  # checks the flags now
    if not 0 < self.greedy_step < 1:
      raise GSIError(f"--greedy_step must lie in (0, 1), got {self.greedy_step}")
    if self.greedy_windows < 1:
      raise GSIError(f"--greedy_windows must be >= 1, got {self.greedy_windows}")

  @property
  def rsparse_search(self) -> rsparse_search.SearchConfig:
    return rsparse_search.SearchConfig(
        population=self.rsparse_search_population, parents=self.rsparse_search_parents,
        generations=self.rsparse_search_generations, windows=self.rsparse_search_windows)

  @property
  def greedy(self) -> greedy_sparsity.GreedyConfig:
    return greedy_sparsity.GreedyConfig(step=self.greedy_step, windows=self.greedy_windows)

  def check_model(self, model):
    """CATS needs a gated MLP: named in --methods on a model without one, that is an
    error; in a sweep of every method it is skipped."""
    if not model.config.gated_mlp and "cats" in self.methods:
      raise GSIError(f"--methods cats needs a gated MLP (gate and up projections); "
                     f"{model.config.name} has none: drop cats from --methods")

  def runs(self, method: str) -> bool:
    """Whether this run sweeps `method` (a learned one needs --learned and its uniform one)."""
    if method in UNIFORM and not (self.learned and self.runs(UNIFORM[method])):
      return False
    return not self.methods or method in self.methods or (
        method in UNIFORM and UNIFORM[method] in self.methods)


def config_from_flags() -> ParetoConfig:
  return ParetoConfig(
      base=cli.experiment_config(OUT),
      svd_ranks=cli.numbers("svd_ranks", FLAGS.svd_ranks, int),
      sparsity=cli.numbers("sparsity", FLAGS.sparsity, float),
      output_sketch=FLAGS.output_sketch,
      ladder=tuple(sorted(cli.numbers("ladder", FLAGS.ladder, int))) if FLAGS.ladder else (),
      head_k=FLAGS.head_k, head_eps=cli.numbers("head_eps", FLAGS.head_eps, float),
      larosa_sites=tuple(FLAGS.larosa_sites),
      residual_k=cli.numbers("residual_k", FLAGS.residual_k, int),
      residual_sparsity=cli.numbers("residual_sparsity", FLAGS.residual_sparsity, float),
      rsparse_ranks=cli.numbers("rsparse_ranks", FLAGS.rsparse_ranks, int),
      rsparse_sparsity=cli.numbers("rsparse_sparsity", FLAGS.rsparse_sparsity, float),
      rsparse_recipe_sparsity=cli.numbers("rsparse_recipe_sparsity",
                                          FLAGS.rsparse_recipe_sparsity, float)
      if FLAGS.rsparse_recipe_sparsity else (),
      rsparse_alpha=cli.numbers("rsparse_alpha", FLAGS.rsparse_alpha, float)
      if FLAGS.rsparse_alpha else (),
      rsparse_search_population=FLAGS.rsparse_search_population,
      rsparse_search_parents=FLAGS.rsparse_search_parents,
      rsparse_search_generations=FLAGS.rsparse_search_generations,
      rsparse_search_windows=FLAGS.rsparse_search_windows,
      cats_sparsity=cli.numbers("cats_sparsity", FLAGS.cats_sparsity, float),
      greedy_sparsity=cli.numbers("greedy_sparsity", FLAGS.greedy_sparsity, float),
      greedy_step=FLAGS.greedy_step, greedy_windows=FLAGS.greedy_windows,
      learned_residual_k=FLAGS.learned_residual_k, learned_rank_max=FLAGS.learned_rank_max,
      methods=tuple(FLAGS.methods),
      speed_repeats=FLAGS.speed_repeats,
      learned=FLAGS.learned,
      learned_sparsity=cli.numbers("learned_sparsity", FLAGS.learned_sparsity, float),
      learned_eps=cli.numbers("learned_eps", FLAGS.learned_eps, float),
      learned_lambda=FLAGS.learned_lambda, learned_steps=FLAGS.learned_steps)


def frontier_at(records, budget, key):
  """Quality at a bytes budget: linear interpolation along the method's Pareto front."""
  pts = sorted((r["bytes_fraction"], r[key]) for r in records)
  better = (lambda a, b: a < b) if key == "ppl_ratio" else (lambda a, b: a > b)
  front = []
  for b, q in pts:
    if not front or better(q, front[-1][1]):
      front.append((b, q))
  if not front or budget < front[0][0]:
    return None  # the method cannot get this cheap
  xs, ys = zip(*front)
  return float(np.interp(budget, xs, ys))


def batch1(gate):
  """The gate a record decodes with: the same, through the batch-1 fast paths."""
  return gsi_jax.make_gate(0.0, batch1_switch=True) if gate is None \
      else gate.replace(batch1_switch=True)


class Evaluator:
  """Scores a parameter tree on the held-out text and greedy generations, against
  dense, and times its batch-1 decode in alternation with dense decode.

  Generations run through the fast paths (`batch1`), which decode the same tokens
  as the masked evaluation paths (tests/test_fast_paths.py); the timed decode of
  the first prompt then reuses their compiled program."""

  def __init__(self, s: experiment.Setup, c: ParetoConfig):
    self.s, self.c, self.model = s, c, s.model
    # The tree every method rewrites.  On several processes the rewrites read whole
    # weights on the host (each process the same), and every tree they write is placed
    # back on the mesh before it is scored or decoded (`placed`).
    self.mesh = sharding.make_mesh() if jax.device_count() > 1 else None
    self.base = (jax.tree.map(distributed.host_copy, s.model.params)
                 if jax.process_count() > 1 else s.model.params)
    self.dense = metrics.score(s.model, s.model.params, s.held_out.ids)
    self.dense_bytes = mbytes.dense_bytes(s.model.params)
    self.dense_gen = {p: self._generate(s.model.params, p) for p in s.config.prompts}
    self.dense_tokens_per_s = self.tokens_per_s(s.model.params, None)[0]
    if self.dense_tokens_per_s:
      logging.info("dense decode: %.1f tokens/s", self.dense_tokens_per_s)

  def placed(self, params):
    """params on the mesh, as the model's own are (unchanged on one device)."""
    return params if self.mesh is None else sharding.shard_params(params, self.mesh)

  def _generate(self, params, prompt, gate=None):
    return distributed.host_copy(self.model.generate(
        self.placed(params), self.model.encode(prompt)[None], self.s.config.max_new_tokens,
        gate))

  def _timed_ids(self):
    return self.model.encode(self.s.config.prompts[0])[None]

  def tokens_per_s(self, params, gate):
    """(tokens/s, compile s) of batch-1 greedy decode; (None, None) without timing."""
    if not self.c.speed_repeats:
      return None, None
    return decode_tokens_per_s(self.model, self.placed(params), self._timed_ids(),
                               self.s.config.max_new_tokens, self.c.speed_repeats, gate)

  def beside_dense(self, params, gate):
    """((tokens/s, compile s) of params, dense tokens/s), dense timed in alternation with
    it (a drift of the machine's speed over the run then cancels in their ratio); None
    without timing."""
    if not self.c.speed_repeats:
      return None
    (tps, compile_s), (dense_tps, _) = paired_tokens_per_s(
        self.model, self._timed_ids(), self.s.config.max_new_tokens, self.c.speed_repeats,
        [(self.placed(params), gate), (self.model.params, None)])
    return tps, compile_s, dense_tps

  def calib_nll(self, params, gate, windows: int = 8) -> float:
    """Mean next-token NLL on the first calibration windows (where budgets are set)."""
    return float(metrics.score(self.model, self.placed(params), self.s.calib.ids[:windows],
                               gate)["nll"].mean())

  def calib_bytes_fraction(self, params, gate, bytes_of, windows: int = 8) -> float:
    """Bytes per token / dense on the first calibration windows (the learned budgets'
    scale is set here, never on held-out text)."""
    scores = metrics.score(self.model, self.placed(params), self.s.calib.ids[:windows], gate)
    return bytes_of(scores) / self.dense_bytes

  def record(self, method, knob, params, gate, bytes_of, **extra):
    """bytes_of(scores) -> weight bytes per token (some methods' bytes depend on the text)."""
    params = self.placed(params)  # once: placing a placed tree again moves nothing
    scores = metrics.score(self.model, params, self.s.held_out.ids, gate)
    q = metrics.quality(self.dense, scores)
    bytes_per_token = bytes_of(scores)
    same = sum(np.array_equal(g, self._generate(params, p, batch1(gate)))
               for p, g in self.dense_gen.items())
    timed = self.beside_dense(params, batch1(gate))
    rec = {"method": method, "knob": knob, "bytes_per_token": bytes_per_token,
           "bytes_fraction": bytes_per_token / self.dense_bytes, "ppl_ratio": q["ppl_ratio"],
           "top1_agreement": q["top1_agreement"], "fast_share": q["fast_share"],
           "head_fast_share": scores["head_fast_share"],
           "generations_identical": int(same), "prompts": len(self.dense_gen)}
    if timed is not None:
      tps, compile_s, dense_tps = timed
      rec.update(tokens_per_s=tps, dense_tokens_per_s=dense_tps,
                 measured_speedup=tps / dense_tps, compile_s=compile_s)
    if extra.pop("shares", False):
      rec.update(fast_share_by_layer=scores["fast_share_by_layer"],
                 kept_share_by_layer=scores["kept_share_by_layer"])
    rec.update(extra)
    logging.info("%s %s: bytes %.3f, ppl ratio %.4f%s", method, knob, rec["bytes_fraction"],
                 q["ppl_ratio"], "" if timed is None else
                 f", {timed[0]:.1f} tokens/s (dense beside it {timed[2]:.1f})")
    return rec


def release_executables():
  """Each parameter tree's structure compiles its own score and decode programs; a sweep
  over dozens of them failed in XLA's compiler ("Cannot allocate memory") unless they
  are dropped as it goes."""
  jax.clear_caches()


def gated_bytes(params):
  return lambda sc: metrics.byte_accounting(params, sc["fast_share_by_layer"],
                                            sc["rows_by_layer"])["bytes_per_token"]


def sweep_gsi(ev, c: ParetoConfig, method: str, variant) -> list[dict]:
  """gsi, gsi_out or gsi_ladder: variant(k) -> params (None: skip that k)."""
  records = []
  for k in c.base.k:
    params = variant(k)
    if params is None:
      continue
    for eps in c.base.eps:
      gate = gsi_jax.make_gate(eps, impl=c.base.impl)
      records.append(ev.record(method, f"k={k},eps={eps}", params, gate, gated_bytes(params)))
  release_executables()
  return records


def sweep_static(ev, c: ParetoConfig) -> list[dict]:
  records = []
  for k in c.base.k:
    params = gsi_jax.apply_gsi(ev.base, ev.s.bases, k)
    records.append(ev.record("static", f"k={k}", params,
                             gsi_jax.make_gate(0.0, "static", impl=c.base.impl),
                             gated_bytes(params)))
  release_executables()
  return records


def sweep_svd(ev, c: ParetoConfig, grams: dict) -> list[dict]:
  base = ev.base
  svds = peers.whitened_svds(base, grams)
  records = [ev.record("svd", f"rank={rank}", peers.svd_truncate(base, svds, rank), None,
                       lambda sc, r=rank: mbytes.svd_bytes(base, r)) for rank in c.svd_ranks]
  release_executables()
  return records


def uniform_thresholds(ev, params, targets) -> dict:
  """{target: {layer: {site: t}}}: per site, the |x| quantile for each target sparsity."""
  return {sp: peers.sparsity_thresholds(ev.model, params, ev.s.calib.ids, sp) for sp in targets}


def sparse_bytes(params):
  return lambda sc: mbytes.sparsity_bytes(params, sc["kept_share_by_layer"],
                                          sc["head_fast_share"])


def sweep_sparsity(ev, c: ParetoConfig, sparse: dict) -> list[dict]:
  records = [ev.record("sparsity", f"target={sp}", params, None, sparse_bytes(params),
                       shares=c.learned and sp in c.learned_sparsity)
             for sp, params in sparse.items()]
  release_executables()
  return records


def sweep_larosa(ev, c: ParetoConfig, grams: dict) -> list[dict]:
  """Magnitude sparsity in each site's PCA basis (GSI's eigenbasis, all d columns) at
  the LaRoSA sites; Q is read at every token and counted."""
  rotated = peers.apply_rotation(ev.base, peers.pca_bases(grams, c.larosa_sites))
  records = []
  for sp, thresholds in uniform_thresholds(ev, rotated, c.sparsity).items():
    params = peers.apply_sparsity(rotated, thresholds)
    records.append(ev.record("larosa", f"target={sp}", params, None, sparse_bytes(params)))
  release_executables()
  return records


def sweep_head(ev, c: ParetoConfig, sparse: dict) -> list[dict]:
  """The gated LM head alone (dense sites), then on top of each sparsity level."""
  V_head, _, _ = gsi_jax.head_basis(ev.model, ev.base, ev.s.calib.ids, c.head_k)
  records = []
  for head_eps in c.head_eps:
    gate = gsi_jax.make_gate(0.0, head_eps=head_eps, impl=c.base.impl)  # sites stay dense
    if c.runs("head"):
      head_only = gsi_jax.apply_gsi_head(ev.base, V_head, c.head_k)
      records.append(ev.record("head", f"head_k={c.head_k},head_eps={head_eps}", head_only,
                               gate, sparse_bytes(head_only)))
    for sp, params in sparse.items() if c.runs("sparsity+head") else ():
      both = gsi_jax.apply_gsi_head(params, V_head, c.head_k)
      records.append(ev.record("sparsity+head", f"target={sp},head_eps={head_eps}", both, gate,
                               sparse_bytes(both)))
  release_executables()
  return records


def learned_record(ev, c: ParetoConfig, method, target, params, init, rebuild, gate, bytes_of):
  """Learn init's knobs ({knob: {layer: {site: value}}}) per site, scale the knob (not
  RANK) to the uniform allocation's bytes on calibration text, and evaluate it hard.
  rebuild(values) -> params.

  Where the learned allocation's calibration NLL is above the uniform one's (the
  same windows that set the budget), the uniform allocation is kept: fallback."""
  knob = next(k for k in init if k != allocation.RANK)
  uniform = rebuild(init)
  budget = ev.calib_bytes_fraction(uniform, gate, bytes_of(uniform))
  learned, history = allocation.learn_allocation(
      ev.model, params, init, ev.s.calib.ids,
      allocation.AllocationConfig(budget=budget, lam=c.learned_lambda, steps=c.learned_steps))
  with_knob = lambda v: rebuild({**learned, knob: v})
  matched = {**learned, knob: allocation.scale_to_budget(
      learned[knob], lambda v: ev.calib_bytes_fraction(with_knob(v), gate,
                                                       bytes_of(with_knob(v))), budget)}
  nll_learned, nll_uniform = ev.calib_nll(rebuild(matched), gate), ev.calib_nll(uniform, gate)
  fallback = nll_learned > nll_uniform
  if fallback:
    logging.info("%s %s: learned calibration NLL %.4f > uniform %.4f, kept uniform", method,
                 target, nll_learned, nll_uniform)
  chosen = init if fallback else matched
  final = rebuild(chosen)
  ranks = {} if allocation.RANK not in chosen else {"ranks": {
      layer: {site: int(final[layer][site][P.V].shape[1]) for site in sites}
      for layer, sites in chosen[allocation.RANK].items()}}
  return ev.record(method, target, final, gate, bytes_of(final), shares=True,
                   allocation=chosen[knob], **ranks, calib_bytes_fraction_uniform=budget,
                   learning=history, fallback=bool(fallback), calib_nll_learned=nll_learned,
                   calib_nll_uniform=nll_uniform)


def sweep_learned(ev, c: ParetoConfig, thresholds: dict) -> list[dict]:
  """Learned per-site sparsity levels, learned per-site ε at the largest k, learned
  per-site residual thresholds at --learned_residual_k, and those thresholds learned
  with the residual's rank per site (from --learned_residual_k, up to --learned_rank_max)."""
  base = ev.base
  records = []
  if c.runs("sparsity_learned"):
    rebuild = lambda v: peers.apply_sparsity(base, v[P.THRESHOLD])
    records += [learned_record(ev, c, "sparsity_learned", f"target={sp}", base,
                               {P.THRESHOLD: allocation.floored(thresholds[sp])}, rebuild, None,
                               sparse_bytes)
                for sp in c.learned_sparsity]
    release_executables()
  if c.runs("gsi_learned"):
    k = max(c.base.k)
    gsi_params = gsi_jax.apply_gsi(base, ev.s.bases, k)
    rebuild = lambda v: P.with_site_values(gsi_params, P.EPS, v[P.EPS])
    gate = gsi_jax.make_gate(0.0, impl=c.base.impl)  # every site's own ε overrides it
    for eps in c.learned_eps:
      records.append(learned_record(ev, c, "gsi_learned", f"k={k},eps={eps}", gsi_params,
                                    {P.EPS: P.per_site(base, eps)}, rebuild, gate, gated_bytes))
    release_executables()
  k = c.learned_residual_k
  if c.runs("residual_learned") or c.runs("residual_rank_learned"):
    gsi_params = gsi_jax.apply_gsi(base, ev.s.bases, k)
    residual_init = {sp: allocation.floored(t)
                     for sp, t in uniform_thresholds(ev, gsi_params, c.learned_sparsity).items()}
  if c.runs("residual_learned"):
    rebuild = lambda v: gsi_jax.apply_residual_sparsity(gsi_params, v[P.RESIDUAL_THRESHOLD])
    for sp, t in residual_init.items():
      records.append(learned_record(ev, c, "residual_learned", f"k={k},target={sp}", gsi_params,
                                    {P.RESIDUAL_THRESHOLD: t}, rebuild, None, sparse_bytes))
    release_executables()
  if c.runs("residual_rank_learned"):
    k_max = c.learned_rank_max
    wide = gsi_jax.apply_gsi(base, ev.s.bases, k_max)
    rebuild = lambda v: gsi_jax.apply_residual_sparsity(
        gsi_jax.truncate_ranks(wide, allocation.kept_ranks(wide, v[allocation.RANK])),
        v[P.RESIDUAL_THRESHOLD])
    for sp, t in residual_init.items():
      init = {P.RESIDUAL_THRESHOLD: t, allocation.RANK: P.per_site(base, float(k))}
      records.append(learned_record(ev, c, "residual_rank_learned",
                                    f"k={k}..{k_max},target={sp}", wide, init, rebuild, None,
                                    sparse_bytes))
    release_executables()
  return records


def sweep_residual(ev, c: ParetoConfig) -> list[dict]:
  """The subspace plus sparse residual: per k, the residual's thresholds for each target."""
  records = []
  for k in c.residual_k:
    gsi_params = gsi_jax.apply_gsi(ev.base, ev.s.bases, k)
    for sp, t in uniform_thresholds(ev, gsi_params, c.residual_sparsity).items():
      params = gsi_jax.apply_residual_sparsity(gsi_params, t)
      records.append(ev.record("residual", f"k={k},target={sp}", params, None,
                               sparse_bytes(params), shares=c.runs("residual_learned") and
                               k == c.learned_residual_k and sp in c.learned_sparsity))
    release_executables()
  return records


def sweep_rsparse(ev, c: ParetoConfig) -> list[dict]:
  """R-Sparse: magnitude thresholds on x, the dropped inputs through a rank-r SVD of W."""
  records = []
  thresholds = uniform_thresholds(ev, ev.base, c.rsparse_sparsity)
  for rank in c.rsparse_ranks:
    factored = peers.weight_factors(ev.base, rank)
    for sp, t in thresholds.items():
      params = peers.apply_sparsity(factored, t)
      records.append(ev.record("rsparse", f"rank={rank},target={sp}", params, None,
                               sparse_bytes(params)))
    release_executables()
  return records


def sweep_rsparse_recipes(ev, c: ParetoConfig) -> list[dict]:
  """R-Sparse's own recipe at each s: one alpha everywhere (rsparse records, its grid),
  then alpha per site searched from the grid's best on calibration text (rsparse_searched).
  Where the searched recipe's calibration NLL (8 windows, as for learned allocations) is
  above its start's, the start is kept: fallback."""
  base = ev.base
  svds = peers.weight_svds(base)
  records = []
  for s in c.rsparse_recipe_sparsity:
    recipes = rsparse_search.Recipes(ev.model, base, ev.s.calib.ids, s, svds)
    uniform = {}
    for alpha in c.rsparse_alpha:
      params = recipes.tree(P.per_site(base, alpha))
      uniform[alpha] = ev.calib_nll(params, None)
      # The search scores candidates with padded factors: the same function, other roundings.
      padded = ev.calib_nll(recipes.tree(P.per_site(base, alpha), padded=True), None)
      records.append(ev.record("rsparse", f"s={s},alpha={alpha}", params, None,
                               sparse_bytes(params), shares=True, calib_nll=uniform[alpha],
                               calib_nll_padded=padded))
    if c.runs("rsparse_searched"):
      start = min(uniform, key=uniform.get)
      searched, history = rsparse_search.search(ev.model, recipes, ev.s.calib.ids, start,
                                                c.rsparse_search)
      nll = ev.calib_nll(recipes.tree(searched), None)
      fallback = nll > uniform[start]
      if fallback:
        logging.info("rsparse_searched s=%s: searched calibration NLL %.4f > uniform %.4f, "
                     "kept uniform", s, nll, uniform[start])
      chosen = P.per_site(base, start) if fallback else searched
      params = recipes.tree(chosen)
      records.append(ev.record(
          "rsparse_searched", f"s={s}", params, None, sparse_bytes(params), shares=True,
          allocation=chosen, map_ranks=rsparse_search.map_ranks(base, s, chosen),
          searched_allocation=searched, start_alpha=start, search=history,
          search_config=dataclasses.asdict(c.rsparse_search), fallback=bool(fallback),
          calib_nll_searched=nll, calib_nll_uniform=uniform[start]))
    release_executables()
  return records


def sweep_cats(ev, c: ParetoConfig) -> list[dict]:
  """CATS: per layer, the |act(x W_gate)| threshold that drops each target share of the
  MLP channels; attention stays dense."""
  base = ev.base
  records = []
  for sp in c.cats_sparsity:
    params = peers.apply_cats(ev.model, base, peers.cats_thresholds(ev.model, base,
                                                                    ev.s.calib.ids, sp))
    records.append(ev.record("cats", f"target={sp}", params, None, sparse_bytes(params)))
  release_executables()
  return records


def sweep_greedy(ev, c: ParetoConfig) -> list[dict]:
  """TEAL's greedy per-site sparsity levels, one path walked to the largest target."""
  base = ev.base
  thresholds, levels = greedy_sparsity.greedy_allocation(ev.model, base, ev.s.calib.ids,
                                                         c.greedy_sparsity, c.greedy)
  records = []
  for sp in c.greedy_sparsity:
    params = peers.apply_sparsity(base, thresholds[sp])
    records.append(ev.record("sparsity_greedy", f"target={sp}", params, None,
                             sparse_bytes(params), shares=True, allocation=levels[sp]))
  release_executables()
  return records


def matched_uniform(records):
  """Each allocated record (learned, greedy) gains the uniform method's perplexity
  ratio at its bytes."""
  for r in records:
    if r["method"] in ALLOCATED:
      uniform = [u for u in records if u["method"] == ALLOCATED[r["method"]]]
      r["uniform_ppl_ratio_at_bytes"] = frontier_at(uniform, r["bytes_fraction"], "ppl_ratio")


def best_measured(records) -> list[dict]:
  """Per perplexity-ratio limit, the record with the highest measured speedup (records
  written before dense was timed beside each one have no dense_tokens_per_s)."""
  rows = []
  for limit in PPL_LIMITS:
    ok = [r for r in records if r["ppl_ratio"] <= limit and "measured_speedup" in r]
    best = max(ok, key=lambda r: r["measured_speedup"], default=None)
    rows.append({"ppl_ratio_limit": limit,
                 **({} if best is None else
                    {key: best[key] for key in BEST_COLUMNS[1:] if key in best})})
  return rows


def pareto(c: ParetoConfig):
  s = experiment.prepare(c.base, check_model=c.check_model)
  ev = Evaluator(s, c)
  base = ev.base
  records = []
  if c.runs("gsi"):
    records += sweep_gsi(ev, c, "gsi", lambda k: gsi_jax.apply_gsi(base, s.bases, k))
  if c.output_sketch and c.runs("gsi_out"):
    records += sweep_gsi(ev, c, "gsi_out",
                         lambda k: gsi_jax.apply_gsi(base, s.bases, k, c.output_sketch))
  if c.ladder and c.runs("gsi_ladder"):
    records += sweep_gsi(ev, c, "gsi_ladder", lambda k: gsi_jax.apply_gsi(
        base, s.bases, k, ladder=[r for r in c.ladder if r < k]) if c.ladder[0] < k else None)
  if c.runs("static"):
    records += sweep_static(ev, c)
  if c.runs("svd") or (c.larosa_sites and c.runs("larosa")):
    grams = calibration.gram_matrices(ev.model, base, s.calib.ids, progress=False)
  if c.runs("svd"):
    records += sweep_svd(ev, c, grams)
  thresholds = uniform_thresholds(ev, base, sorted(set(c.sparsity + c.learned_sparsity)))
  sparse = {sp: peers.apply_sparsity(base, thresholds[sp]) for sp in c.sparsity}
  if c.runs("sparsity"):
    records += sweep_sparsity(ev, c, sparse)
  if c.head_k and (c.runs("head") or c.runs("sparsity+head")):
    records += sweep_head(ev, c, sparse)
  if c.larosa_sites and c.runs("larosa"):
    records += sweep_larosa(ev, c, grams)
  if c.runs("residual"):
    records += sweep_residual(ev, c)
  if c.runs("rsparse"):
    records += sweep_rsparse(ev, c)
  if c.rsparse_recipe_sparsity and (c.runs("rsparse") or c.runs("rsparse_searched")):
    records += sweep_rsparse_recipes(ev, c)
  if c.runs("cats") and s.model.config.gated_mlp:
    records += sweep_cats(ev, c)
  if c.runs("sparsity_greedy"):
    records += sweep_greedy(ev, c)
  if c.learned:
    records += sweep_learned(ev, c, thresholds)
  matched_uniform(records)
  dense_end = ev.tokens_per_s(base, None)[0]
  budgets = []
  for budget in BUDGETS:
    row = {"budget": budget}
    for method in METHODS:
      mine = [r for r in records if r["method"] == method]
      row[f"{method}_ppl_ratio"] = frontier_at(mine, budget, "ppl_ratio")
      row[f"{method}_top1"] = frontier_at(mine, budget, "top1_agreement")
    budgets.append(row)
  beside = [r["dense_tokens_per_s"] for r in records if "dense_tokens_per_s" in r]
  speed = {"dense_tokens_per_s": ev.dense_tokens_per_s, "dense_tokens_per_s_end": dense_end,
           "dense_tokens_per_s_beside": [min(beside), max(beside)] if beside else None,
           "best_measured": best_measured(records)}
  return s, ev, records, budgets, speed


def plot(records, out):
  fig, axes = plt.subplots(1, 3, figsize=(17, 4.5))
  markers = dict(zip(METHODS, "oDPs^vXh<>H1*dp82+"))
  panels = (("bytes_fraction", "ppl_ratio"), ("bytes_fraction", "top1_agreement"),
            ("measured_speedup", "ppl_ratio"))
  for method in METHODS:
    mine = sorted((r for r in records if r["method"] == method),
                  key=lambda r: r["bytes_fraction"])
    if not mine:
      continue
    # Swept over two knobs (k × eps): points, not a line.
    ls = "none" if method.startswith("gsi") or method in ("sparsity+head", "residual", "rsparse") \
        else "-"
    for ax, (x, y) in zip(axes, panels):
      pts = [(r[x], r[y]) for r in mine if x in r]
      if pts:
        ax.plot(*zip(*pts), markers[method], label=method, ls=ls, alpha=0.8)
  axes[0].set(xlabel="weight bytes per token / dense", ylabel="perplexity ratio", yscale="log")
  axes[1].set(xlabel="weight bytes per token / dense", ylabel="top-1 agreement")
  axes[2].set(xlabel="measured batch-1 decode speedup over dense", ylabel="perplexity ratio",
              yscale="log")
  for ax in axes:
    ax.axvline(1.0, color="gray", lw=0.8)
  axes[2].legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
  experiment.save_figure(fig, out)


def plot_allocation(records, out):
  """Per site and layer, each allocated record's share (kept inputs, or fast tokens: learned,
  TEAL's greedy, or R-Sparse's searched recipe) on held-out text, beside the uniform
  allocation's at the same target (the searched recipe: its uniform start)."""
  allocated = [r for r in records if r["method"] in ALLOCATED]
  if not allocated:
    return
  cols = min(4, len(allocated))
  rows = -(-len(allocated) // cols)
  fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False)
  for ax in axes.flat[len(allocated):]:
    ax.axis("off")
  for ax, r in zip(axes.flat, allocated):
    key = "fast_share_by_layer" if r["method"] == "gsi_learned" else "kept_share_by_layer"
    same = (r["knob"], r["knob"].split(",")[-1], re.sub(r"\.\.\d+", "", r["knob"]),  # k=16..64
            f"{r['knob']},alpha={r.get('start_alpha')}")  # rsparse_searched: its start
    uniform = next((u for u in records if u["method"] == ALLOCATED[r["method"]]
                    and u["knob"] in same and key in u), None)
    layers = P.layers(r[key])
    for i, site in enumerate(P.SITES):
      if site not in r[key][layers[0]]:
        continue
      ax.plot(range(len(layers)), [r[key][l][site] for l in layers], color=f"C{i}", label=site)
      if uniform:
        ax.plot(range(len(layers)), [uniform[key][l][site] for l in layers], color=f"C{i}",
                ls=":", lw=0.8)
    ax.set(title=f"{r['method']} {r['knob']}", xlabel="layer",
           ylabel="kept share" if key.startswith("kept") else "fast share", ylim=(0, 1.02))
    if "ranks" in r:  # residual_rank_learned: each site's learned rank on a second axis
      ranks = ax.twinx()
      for i, site in enumerate(P.SITES):
        if site in r["ranks"][layers[0]]:
          ranks.plot(range(len(layers)), [r["ranks"][l][site] for l in layers], color=f"C{i}",
                     ls="--", marker=".", ms=3, lw=0.7)
      ranks.set_ylabel("rank k (dashed)")
  axes[0][0].legend(fontsize=7)
  fig.suptitle("learned, greedy or searched per-site allocation (solid) and uniform (dotted), "
               "held-out text; learned ranks dashed", fontsize=9)
  experiment.save_figure(fig, out.replace(".json", "_allocation.json"))


def check_mesh(c: ParetoConfig) -> None:
  """Refuse, before any compute, what does not yet score on a mesh as on one device."""
  if jax.device_count() > 1 and c.rsparse_recipe_sparsity and (
      c.runs("rsparse") or c.runs("rsparse_searched")):
    raise GSIError("--rsparse_recipe_sparsity: R-Sparse's recipes score differently once their "
                   "kernels are split over devices (BUILD_NOTES.md, several processes); pass "
                   "--rsparse_recipe_sparsity= on several devices or processes")


def main(argv):
  c = config_from_flags()
  check_mesh(c)
  s, ev, records, budgets, speed = pareto(c)
  extra = {"budgets": budgets, "dense_bytes_per_token": ev.dense_bytes, **speed,
           **{f.name: getattr(c, f.name) for f in dataclasses.fields(c) if f.name != "base"}}
  experiment.write_records(c.base.out, s.describe(**extra), records, COLUMNS)
  print(experiment.markdown_table(budgets, list(budgets[0])))
  print(experiment.markdown_table(speed["best_measured"], BEST_COLUMNS))
  plot(records, c.base.out)
  plot_allocation(records, c.base.out)


if __name__ == "__main__":
  cli.run(main)
