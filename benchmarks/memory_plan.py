"""Memory per host and per device for loading and calibrating published shapes on 1-16
hosts, from their parameter shapes, checked against measured runs.

  python benchmarks/memory_plan.py --out results/benchmarks/memory_plan.json

The model (gsi_jax/measure/footprint.py): each device holds the replicated leaves, its column
share of the split ones, its rows of one layer's float32 Gram matrices and the
replicated calibration windows.  A host running one process per device adds a constant
per phase (runtime and transients), fitted on `--fit_on`, a one-process
`benchmarks/scale.py` record; each `--check` record is then predicted and compared with
what it measured.  Nothing is allocated.
"""

import logging

from absl import flags

from gsi_jax import cli, experiment, text
from gsi_jax.measure import footprint
from gsi_jax.errors import GSIError
from gsi_jax.loading import synthetic

_SHAPES = flags.DEFINE_list("shapes", ["gptj-6b", "opt-6.7b", "opt-66b", "opt-175b"],
                            "Published shapes.")
_CALIB_TOKENS = flags.DEFINE_integer("calib_tokens", 16384, "Calibration tokens (hidden states).")
_HOSTS = flags.DEFINE_list("hosts", ["1", "2", "4", "8", "16"], "Host counts.")
_DEVICES_PER_HOST = flags.DEFINE_integer("devices_per_host", 8,
                                         "Accelerators per host, for the per-device plan.")
_FIT_ON = flags.DEFINE_string(
    "fit_on", "results/benchmarks/scale-gptj-6b-4-layers-1-process.json",
    "A one-process scale.py JSON: fits each phase's per-process constant.")
_CHECK = flags.DEFINE_list(
    "check", ["results/benchmarks/scale-gptj-6b-4-layers-2-processes.json",
              "results/benchmarks/scale-gptj-6b-4-layers-4-processes.json",
              "results/benchmarks/scale-gptj-6b.json", "results/benchmarks/scale-opt-6.7b.json"],
    "scale.py JSONs the fitted model predicts.")
_OUT = flags.DEFINE_string("out", "results/benchmarks/memory_plan.json", "JSON output.")


def measured_run(path: str) -> footprint.MeasuredRun:
  record = text.read_json(path, "--check")
  if not isinstance(record, dict):
    raise GSIError(f"--check: {path} is not a JSON object; pass a JSON that "
                   "benchmarks/scale.py wrote")
  return footprint.MeasuredRun.from_record(path, record)


def plan(shape: str, calib_tokens: int, hosts: tuple[int, ...], devices_per_host: int,
         constants: dict) -> dict:
  one = footprint.device_bytes(shape, 1, calib_tokens)
  per_host, per_device = {}, {}
  for n in hosts:
    host = footprint.device_bytes(shape, n, calib_tokens)
    per_host[str(n)] = {phase: constants[phase] + host.phase_gb(phase.split(":")[0])
                        for phase in constants}
    device = footprint.device_bytes(shape, n * devices_per_host, calib_tokens)
    per_device[str(n)] = {"load": device.load_gb, "calibration": device.calibration_gb}
  return {
      "shape": shape, "layers": one.layers, "weights_gb": one.replicated_gb + one.split_gb,
      "replicated_gb": one.replicated_gb, "gram_one_layer_gb": one.gram_layer_gb,
      "gram_all_layers_gb": footprint.gram_all_layers_gb(shape), "hidden_states_gb": one.hidden_gb,
      "per_host_gb": per_host, "per_device_gb": per_device,
  }


def main(argv):
  del argv
  for shape in _SHAPES.value:
    if shape not in synthetic.SHAPES:
      raise GSIError(f"--shapes: unknown shape {shape!r}; use {', '.join(synthetic.SHAPES)}")
  hosts = tuple(experiment.positive("--hosts", n) for n in cli.numbers("hosts", _HOSTS.value, int))
  experiment.positive("--calib_tokens", _CALIB_TOKENS.value)
  experiment.positive("--devices_per_host", _DEVICES_PER_HOST.value)
  out = experiment.check_output_path(_OUT.value)
  fit = measured_run(_FIT_ON.value)
  checked = [measured_run(path) for path in _CHECK.value]
  constants = footprint.fit_constants(fit)
  checks = [row for run in checked for row in footprint.check(run, constants)]
  for row in checks:
    logging.info("%s, %d layers, %d process(es), %s: predicted %.2f GB, measured %.2f GB (%+.1f%%)",
                 row["shape"], row["layers"], row["processes"], row["phase"],
                 row["predicted_gb"], row["measured_gb"], 100 * row["relative_error"])
  records = [plan(s, _CALIB_TOKENS.value, hosts, _DEVICES_PER_HOST.value, constants)
             for s in _SHAPES.value]
  experiment.write_json(out, {
      "calib_tokens": _CALIB_TOKENS.value, "devices_per_host": _DEVICES_PER_HOST.value,
      "fit_on": fit.path, "constants_gb": constants, "checks": checks,
      "worst_relative_error": max((abs(r["relative_error"]) for r in checks), default=None),
      "records": records})


if __name__ == "__main__":
  cli.run(main, one_process="models memory from records, with no compute to share")
