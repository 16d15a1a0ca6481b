"""Every registered method against dense: quality against true bytes per token, and
measured decode speed.

  python experiments/pareto.py --k 128,256,384 --eps 0.05,0.5 --eval_tokens 4096 --learned

Runs each method of `gsi_jax.methods` (those named in --methods, or all) over its grid.
A method's knobs are flags (--sparsity, --residual_k, ...: `--helpfull` lists them); a
knob given for a method this run does not evaluate is refused, naming its methods.  Each
point is scored on the held-out text, its greedy generations compared with dense, its
weight bytes per token counted (LM head and embeddings included), and its batch-1 decode
timed in alternating rounds with dense decode, one dense decode a round beside each of its
method's points; dense is the faster of XLA's dot and the kept-rows kernel keeping every
row (best_dense, chosen in 3 rounds or more at the start; on CPU the kernel), so a speedup
is what skipping adds (measured_speedup: the median of the per-round ratios; speedup_low and
speedup_high: its bootstrap 95% interval, absent below 3 rounds, as is the fastest
method per perplexity limit; verdict: faster, slower, within noise, too few rounds or
untimed).  With --learned the learned allocations run beside their uniform methods;
they and the searched one keep the uniform allocation where they score worse on
calibration text (fallback).
"""

import dataclasses
import re
import time
from typing import Any, Mapping

import jax
import matplotlib.pyplot as plt
from absl import flags

from gsi_jax import cli, experiment, methods
from gsi_jax.measure.benchmarking import MIN_ROUNDS
from gsi_jax.errors import GSIError
from gsi_jax.experiment import ExperimentConfig
from gsi_jax.methods.context import Context
from gsi_jax.methods.evaluate import Evaluator, NonFinitePoint, release_executables
from gsi_jax.methods.front import BEST_COLUMNS, best_measured, budget_rows, matched_uniform
from gsi_jax.models import params as P

cli.define_experiment_flags()
cli.define_knob_flags(methods.knobs())
flags.DEFINE_list("methods", [], "Methods to run (empty: every registered method).")
flags.DEFINE_integer("speed_repeats", 3, "Paired rounds per record, each decoding "
                     "--max_new_tokens from the first prompt with the method and with dense "
                     "(0: skip timing).")
flags.DEFINE_bool("learned", False, "Also learn per-site budgets with optax.")
FLAGS = flags.FLAGS
OUT = "results/pareto.json"
COLUMNS = ["method", "knob", "bytes_fraction", "ppl_ratio", "top1_agreement",
           "generations_identical", "tokens_per_s", "dense_tokens_per_s", "measured_speedup",
           "speedup_low", "speedup_high", "verdict"]


@dataclasses.dataclass(frozen=True)
class ParetoConfig:
  """grid: every registered knob's value; given: the knobs named on the command line."""
  base: ExperimentConfig
  grid: Mapping[str, Any]
  methods: tuple[str, ...]
  speed_repeats: int
  learned: bool
  given: frozenset = frozenset()

  def __post_init__(self):
    unknown = set(self.methods) - set(methods.REGISTRY)
    if unknown:
      raise GSIError(f"--methods: unknown {sorted(unknown)}; choose from "
                     f"{', '.join(methods.names())}")
    if self.speed_repeats < 0:
      raise GSIError(f"--speed_repeats must be >= 0, got {self.speed_repeats}")
    for name in self.methods:
      if methods.REGISTRY[name].learned and not self.learned:
        raise GSIError(f"--methods {name}: a learned allocation runs with --learned (beside "
                       f"its uniform method, {methods.REGISTRY[name].uniform}); add --learned")
    for knob in sorted(self.given):
      users = methods.users(knob)
      if not any(self.runs(name) for name in users):
        learned = all(methods.REGISTRY[name].learned for name in users)
        raise GSIError(f"--{knob} is a knob of {', '.join(users)}, which this run does not "
                       f"evaluate; drop --{knob} or add {'it' if len(users) == 1 else 'one'} "
                       f"to --methods{' (with --learned)' if learned else ''}")
    for name in self.running():
      if methods.REGISTRY[name].check:
        methods.REGISTRY[name].check(self.grid, self.base)

  @property
  def named(self) -> frozenset:
    """--methods, and with --learned the uniform method of each learned one named there
    (a learned allocation is compared with it, so it brings it in)."""
    learned = {methods.REGISTRY[name].uniform for name in self.methods
               if self.learned and methods.REGISTRY[name].learned}
    return frozenset(self.methods) | learned

  def runs(self, name: str) -> bool:
    """Whether this run evaluates a method (a learned one needs --learned and its uniform
    method, and runs with it)."""
    method = methods.REGISTRY[name]
    if method.learned and not (self.learned and self.runs(method.uniform)):
      return False
    return not self.methods or name in self.named or (
        method.learned and method.uniform in self.methods)

  def running(self) -> list[str]:
    return [name for name in methods.names() if self.runs(name)]

  def check_model(self, model):
    """A method named in --methods that the model cannot run is an error; in a sweep of
    every method it is skipped."""
    for name in self.methods:
      needs = methods.REGISTRY[name].needs
      if needs and not needs[1](model.config):
        raise GSIError(f"--methods {name} needs {needs[0]}; {model.config.name} has none: "
                       f"drop {name} from --methods")


def config_from_flags() -> ParetoConfig:
  knobs = methods.knobs()
  return ParetoConfig(
      base=cli.experiment_config(OUT),
      grid={name: cli.knob_value(knob, FLAGS[name].value) for name, knob in knobs.items()},
      methods=tuple(FLAGS.methods), speed_repeats=FLAGS.speed_repeats, learned=FLAGS.learned,
      given=frozenset(name for name in knobs if FLAGS[name].present))


def uniform_of() -> dict[str, str]:
  """{allocated method: the uniform method it is compared with}."""
  return {name: m.uniform for name, m in methods.REGISTRY.items() if m.uniform}


def function_name(fn) -> str:
  module = getattr(fn, "__module__", "") or ""
  name = getattr(fn, "__qualname__", None) or repr(fn)
  return name if name.startswith("by_tree(") or not module else f"{module}.{name}"


def stopped_partway(out: str, config: dict, finished: list[dict], why: str) -> GSIError:
  """Write the records finished before a point the sweep cannot keep beside --out, marked
  incomplete (the earlier --out stays as it was), and the error that ends the run."""
  if not finished:
    return GSIError(f"{why}; no record had finished, so nothing was written")
  partial = experiment.partial_path(out)
  experiment.write_records(partial, config, finished, COLUMNS, show=False, stopped=why)
  return GSIError(f"{why}; the {len(finished)} records finished before it are in {partial} "
                  '("complete": false)')


def timed_points(points):
  """(seconds to build it, point) for each point a method yields: its calibration, its
  learning or search, and the rewrite of the tree."""
  while True:
    start = time.perf_counter()
    point = next(points, None)
    if point is None:
      return
    yield time.perf_counter() - start, point


def pareto(c: ParetoConfig):
  s = experiment.prepare(c.base, bases=False, check_model=c.check_model)  # bases: on first use
  ev = Evaluator(s, c.speed_repeats)
  ctx = Context(ev, c.base, c.grid, c.runs)
  records = []
  for name in c.running():
    method = methods.REGISTRY[name]
    mine, trees = [], []
    if method.runs_on(c.grid, s.model.config):
      try:
        for build_s, point in timed_points(method.points(ctx)):
          mine.append(ev.record(name, point.knob, point.params, point.gate,
                                method.bytes_of(point), shares=point.shares, build_s=build_s,
                                bytes_fn_name=function_name(method.bytes_of), **point.extra))
          trees.append((point.params, point.gate))
      except NonFinitePoint as e:
        raise stopped_partway(c.base.out, s.describe(methods=c.methods), records + mine,
                              str(e)) from None
    if not mine:
      if name in c.named:  # asked for by name: an empty row of the table would hide it
        raise method.no_points()
      continue
    ev.time_beside_dense(mine, trees)
    records += mine
    release_executables()
  if not records:
    raise GSIError("no method made a record with these settings; name methods and their "
                   "knobs (--methods, --helpfull lists the knobs)")
  matched_uniform(records, uniform_of())
  beside = [r["dense_tokens_per_s"] for r in records if "dense_tokens_per_s" in r]
  speed = {"dense_tokens_per_s": ev.dense_tokens_per_s, "best_dense": ev.best_dense,
           "best_dense_choice": ev.best_dense_choice,
           "dense_tokens_per_s_end": ev.tokens_per_s(ev.base, None)[0],
           "dense_tokens_per_s_beside": [min(beside), max(beside)] if beside else None,
           "best_measured": best_measured(records)}
  return s, ev, records, budget_rows(records, methods.names()), speed


def plot(records, out):
  fig, axes = plt.subplots(1, 3, figsize=(17, 4.5))
  # A marker and a colour a method, the pair unique up to 90 methods (lcm of 18 and 10).
  symbols = "oDPs^vXh<>H1*dp82+"
  styles = {name: (symbols[i % len(symbols)], f"C{i % 10}")
            for i, name in enumerate(methods.names())}
  panels = (("bytes_fraction", "ppl_ratio"), ("bytes_fraction", "top1_agreement"),
            ("measured_speedup", "ppl_ratio"))
  for method in methods.names():
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
        marker, color = styles[method]
        ax.plot(*zip(*pts), marker=marker, color=color, label=method, ls=ls, alpha=0.8)
  axes[0].set(xlabel="weight bytes per token / dense", ylabel="perplexity ratio", yscale="log")
  axes[1].set(xlabel="weight bytes per token / dense", ylabel="top-1 agreement")
  axes[2].set(xlabel="measured batch-1 decode speedup over dense", ylabel="perplexity ratio",
              yscale="log")
  for ax in axes:
    ax.axvline(1.0, color="gray", lw=0.8)
  # From the first panel, which every record reaches (the speed panel is empty when nothing
  # was timed).
  fig.legend(*axes[0].get_legend_handles_labels(), fontsize=8, loc="center left",
             bbox_to_anchor=(1.0, 0.5))
  experiment.save_figure(fig, out)


def plot_allocation(records, out):
  """Per site and layer, each allocated record's share (kept inputs, or fast tokens: learned,
  TEAL's greedy, or R-Sparse's searched recipe) on held-out text, beside the uniform
  allocation's at the same target (the searched recipe: its uniform start)."""
  uniform = uniform_of()
  allocated = [r for r in records if r["method"] in uniform]
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
    start = next((u for u in records if u["method"] == uniform[r["method"]]
                  and u["knob"] in same and key in u), None)
    layers = P.layers(r[key])
    for i, site in enumerate(P.SITES):
      if site not in r[key][layers[0]]:
        continue
      ax.plot(range(len(layers)), [r[key][l][site] for l in layers], color=f"C{i}", label=site)
      if start:
        ax.plot(range(len(layers)), [start[key][l][site] for l in layers], color=f"C{i}",
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
  if jax.device_count() > 1 and c.grid["rsparse_recipe_sparsity"] and (
      c.runs("rsparse") or c.runs("rsparse_searched")):
    raise GSIError("--rsparse_recipe_sparsity: R-Sparse's recipes score differently once their "
                   "kernels are split over devices (BUILD_NOTES.md, several processes); pass "
                   "--rsparse_recipe_sparsity= on several devices or processes")


def main(argv):
  c = config_from_flags()
  check_mesh(c)
  s, ev, records, budgets, speed = pareto(c)
  extra = {"budgets": budgets, "dense_bytes_per_token": ev.dense_bytes, **speed, **c.grid,
           "methods": c.methods, "speed_repeats": c.speed_repeats, "learned": c.learned}
  experiment.write_records(c.base.out, s.describe(**extra), records, COLUMNS)
  print(experiment.markdown_table(budgets, list(budgets[0])))
  if speed["best_measured"]:
    print(experiment.markdown_table(speed["best_measured"], BEST_COLUMNS))
  else:
    print(f"no fastest method per perplexity limit: speed was timed in {c.speed_repeats} "
          f"paired rounds, and fewer than {MIN_ROUNDS} give no interval (--speed_repeats)")
  plot(records, c.base.out)
  plot_allocation(records, c.base.out)


if __name__ == "__main__":
  cli.run(main)
