"""Reading records as fronts: quality at a bytes budget along each method's Pareto
front, the uniform front an allocation is compared with, the fastest record under
each perplexity-ratio limit, and a run's speeds over its best dense decode."""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from gsi_jax.errors import GSIError

BUDGETS = (0.9, 0.75, 0.6, 0.5)
PPL_LIMITS = (1.01, 1.05, 1.10)
BEST_COLUMNS = ["ppl_ratio_limit", "method", "knob", "measured_speedup", "speedup_low",
                "speedup_high", "ppl_ratio", "bytes_fraction", "tokens_per_s",
                "dense_tokens_per_s"]


def frontier_at(records, budget, key):
  """Quality at a bytes budget: linear interpolation along the method's Pareto front,
  held at its last point past its largest bytes; None below its cheapest point."""
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


def budget_rows(records, methods: Sequence[str]) -> list[dict]:
  """Per budget, the perplexity ratio and top-1 along the front of each of `methods` that
  made a record (in that order): a method that did not run has no column."""
  ran = [m for m in methods if any(r["method"] == m for r in records)]
  rows = []
  for budget in BUDGETS:
    row = {"budget": budget}
    for method in ran:
      mine = [r for r in records if r["method"] == method]
      row[f"{method}_ppl_ratio"] = frontier_at(mine, budget, "ppl_ratio")
      row[f"{method}_top1"] = frontier_at(mine, budget, "top1_agreement")
    rows.append(row)
  return rows


def matched_uniform(records, uniform_of: Mapping[str, str]) -> None:
  """Each allocated record (learned, greedy, searched) gains its uniform method's
  perplexity ratio at its bytes."""
  for r in records:
    if r["method"] in uniform_of:
      uniform = [u for u in records if u["method"] == uniform_of[r["method"]]]
      r["uniform_ppl_ratio_at_bytes"] = frontier_at(uniform, r["bytes_fraction"], "ppl_ratio")


def best_measured(records) -> list[dict]:
  """Per perplexity-ratio limit, the record with the highest measured speedup among those
  with an interval (timed in at least `benchmarking.MIN_ROUNDS` paired rounds); no rows
  when no record has one, for a pick from one or two rounds is a pick of noise."""
  timed = [r for r in records if r.get("speedup_low") is not None]
  if not timed:
    return []
  rows = []
  for limit in PPL_LIMITS:
    ok = [r for r in timed if r["ppl_ratio"] <= limit]
    best = max(ok, key=lambda r: r["measured_speedup"], default=None)
    rows.append({"ppl_ratio_limit": limit,
                 **({} if best is None else
                    {key: best[key] for key in BEST_COLUMNS[1:] if key in best})})
  return rows


KEPT_ALL = ("sparsity", "target=0.0")  # (method, knob): every row kept
XLA_DENSE, KEPT_ROWS_DENSE = "xla", "kept_rows_every_row_kept"  # the dense paths timed beside


def over_best_dense(records: list[dict]) -> tuple[dict, list[dict]]:
  """For a run timed beside XLA's dense (before pareto timed beside the best dense): the
  every-row-kept record's figures, and each timed record's median ratio divided by that
  record's where it is faster than XLA's (`over_best_dense`; a ratio of two medians, each
  beside its own dense rounds, so no interval)."""
  if any(r.get("beside", XLA_DENSE) != XLA_DENSE for r in records):
    raise GSIError("these records were already timed beside the best dense path (their "
                   "`beside` field); read their measured_speedup as it is")
  kept = next((r for r in records if (r["method"], r["knob"]) == KEPT_ALL
               and r.get("measured_speedup")), None)
  if kept is None:
    raise GSIError("the run has no timed record of sparsity with every row kept "
                   "(pareto.py --sparsity 0); rerun pareto.py with it")
  best = max(1.0, kept["measured_speedup"])
  rows = [{"method": r["method"], "knob": r["knob"], "bytes_fraction": r["bytes_fraction"],
           "ppl_ratio": r["ppl_ratio"], "measured_speedup": r["measured_speedup"],
           "speedup_low": r["speedup_low"], "speedup_high": r["speedup_high"],
           "over_best_dense": r["measured_speedup"] / best}
          for r in records if r.get("measured_speedup")]
  return {"kept_all_over_xla": kept["measured_speedup"], "kept_all_low": kept["speedup_low"],
          "kept_all_high": kept["speedup_high"],
          "best_dense": KEPT_ROWS_DENSE if best > 1.0 else XLA_DENSE}, rows
