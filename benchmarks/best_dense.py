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


from absl import flags

from gsi_jax import cli, experiment, text
from gsi_jax.errors import GSIError
from gsi_jax.methods.front import over_best_dense

_PARETO = flags.DEFINE_string("pareto", "results/pareto.json", "A pareto.py JSON timed beside "
                              "XLA's dense.")
_OUT = flags.DEFINE_string("out", "results/pareto_best_dense.json", "JSON output.")


def main(argv):
  del argv
  out = experiment.check_output_path(_OUT.value)
  result = text.read_json(_PARETO.value, "--pareto")
  records = result.get("records") if isinstance(result, dict) else None
  if not isinstance(records, list) or not all(
      isinstance(r, dict) and {"method", "knob"} <= set(r) for r in records):
    raise GSIError(f"--pareto {_PARETO.value} is not a pareto.py JSON (its \"records\" must be "
                   "a list of records, each with a method and a knob); give one")
  try:
    best, rows = over_best_dense(records)
  except GSIError as e:
    raise GSIError(f"--pareto {_PARETO.value}: {e}") from None
  experiment.write_records(out, {"pareto": _PARETO.value, **best}, rows,
                           ["method", "knob", "bytes_fraction", "ppl_ratio", "measured_speedup",
                            "over_best_dense"])


if __name__ == "__main__":
  cli.run(main, one_process="reads one JSON")
