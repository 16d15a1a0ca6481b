"""Speed over the best dense decode, from a pareto run timed beside XLA's dense alone.

  python benchmarks/best_dense.py --pareto results/pareto.json --out results/pareto_best_dense.json

On CPU the kept-rows kernel keeping every row (sparsity at target 0, dense's bytes) decodes
faster than XLA's dense, so a record's speed beside XLA's dense counts the kernel's own
speed as skipping's.  pareto.py now times every record beside the faster of the two
(`best_dense`); for a run made before that, each record's `over_best_dense` here is its
median ratio divided by the every-row-kept record's median ratio in the same run (where that
one is faster than XLA's; else the ratio itself).  A ratio of two medians, each taken beside
its own dense rounds: no interval.
"""

import json
import os

from absl import flags

from gsi_jax import cli, experiment
from gsi_jax.errors import GSIError

_PARETO = flags.DEFINE_string("pareto", "results/pareto.json", "A pareto.py JSON timed beside "
                              "XLA's dense.")
_OUT = flags.DEFINE_string("out", "results/pareto_best_dense.json", "JSON output.")
KEPT_ALL = ("sparsity", "target=0.0")  # (method, knob): every row kept


def over_best_dense(records: list[dict]) -> tuple[dict, list[dict]]:
  """(the every-row-kept record's figures, each timed record's ratio over the best dense)."""
  if any(r.get("beside", "xla") != "xla" for r in records):
    raise GSIError("--pareto: its records were already timed beside the best dense path "
                   "(their `beside` field); read their measured_speedup as it is")
  kept = next((r for r in records if (r["method"], r["knob"]) == KEPT_ALL
               and r.get("measured_speedup")), None)
  if kept is None:
    raise GSIError("--pareto: the run has no timed record of sparsity with every row kept "
                   "(--sparsity 0); rerun pareto.py with it")
  best = max(1.0, kept["measured_speedup"])
  rows = [{"method": r["method"], "knob": r["knob"], "bytes_fraction": r["bytes_fraction"],
           "ppl_ratio": r["ppl_ratio"], "measured_speedup": r["measured_speedup"],
           "speedup_low": r["speedup_low"], "speedup_high": r["speedup_high"],
           "over_best_dense": r["measured_speedup"] / best}
          for r in records if r.get("measured_speedup")]
  return {"kept_all_over_xla": kept["measured_speedup"], "kept_all_low": kept["speedup_low"],
          "kept_all_high": kept["speedup_high"],
          "best_dense": "kept_rows_every_row_kept" if best > 1.0 else "xla"}, rows


def main(argv):
  del argv
  if not os.path.isfile(_PARETO.value):
    raise GSIError(f"--pareto {_PARETO.value} is not a file; give a pareto.py JSON")
  out = experiment.check_output_path(_OUT.value)
  try:
    with open(_PARETO.value, encoding="utf-8") as f:
      records = json.load(f)["records"]
  except (json.JSONDecodeError, KeyError, TypeError) as e:
    raise GSIError(f"--pareto {_PARETO.value} is not a pareto.py JSON ({e}); give one") from None
  best, rows = over_best_dense(records)
  experiment.write_records(out, {"pareto": _PARETO.value, **best}, rows,
                           ["method", "knob", "bytes_fraction", "ppl_ratio", "measured_speedup",
                            "over_best_dense"])


if __name__ == "__main__":
  cli.run(main, one_process="reads one JSON")
