"""Calibration cost: cascade against eigh, wall time and peak resident memory.

  python benchmarks/calibration.py --calib_tokens 65536 --out results/benchmarks/calibration.json

Each method runs in its own child process so that peak RSS (ru_maxrss) is
its own; the model's float32 size is reported beside it.
"""

import json
import subprocess
import sys
import time

from absl import flags

import gsi_jax
from gsi_jax import cli, experiment, text
from gsi_jax.measure.benchmarking import peak_rss_mib
from gsi_jax.errors import GSIError

_MODEL = flags.DEFINE_string("model", gsi_jax.DEFAULT_MODEL, "Preset, .gguf, HF folder or hub id.")
_TOKENS = flags.DEFINE_integer("calib_tokens", 65536, "Calibration tokens.")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 256, "Window length.")
_K = flags.DEFINE_integer("k", 256, "k_max of the bases.")
_METHOD = flags.DEFINE_string("method", None, "Internal: run one method in this process.")
_OUT = flags.DEFINE_string("out", "results/benchmarks/calibration.json", "JSON output.")


def measure(method: str) -> dict:
  t0 = time.perf_counter()
  model = gsi_jax.load_model(_MODEL.value)
  load_s = time.perf_counter() - t0
  rss_loaded = peak_rss_mib()
  ids = text.windows(model, text.PYDOC_CALIB, _SEQ_LEN.value, _TOKENS.value)
  if ids.n_tokens < _TOKENS.value:  # pydoc's calibration half is shorter: cycle it
    import numpy as np
    reps = -(-_TOKENS.value // ids.n_tokens)
    ids = text.TokenWindows(np.concatenate([ids.ids] * reps)[:_TOKENS.value // _SEQ_LEN.value],
                            ids.source + " (repeated)")
  t0 = time.perf_counter()
  bases = gsi_jax.calibrate(model, model.params, ids.ids, _K.value, method=method,
                            seq_len=_SEQ_LEN.value, progress=False)
  total_s = time.perf_counter() - t0
  f32_mib = sum(x.size for x in __import__("jax").tree.leaves(model.params)) * 4 / 2**20
  return {"method": method, "tokens": ids.n_tokens, "source": ids.source, "k": _K.value,
          "load_s": load_s, "calibrate_s": total_s, "solve_s": bases.meta["solve_seconds"],
          "solve_gflops": bases.meta["solve_flops"] / 1e9,
          "peak_rss_mib": peak_rss_mib(), "rss_after_load_mib": rss_loaded,
          "model_f32_mib": f32_mib}


def main(argv):
  del argv
  if _METHOD.value:
    print("RESULT " + json.dumps(measure(_METHOD.value)))
    return
  experiment.positive("--calib_tokens", _TOKENS.value)
  experiment.positive("--k", _K.value)
  experiment.finite("--seq_len", _SEQ_LEN.value, 2)
  out = experiment.check_output_path(_OUT.value)
  records = []
  for method in ("eigh", "cascade"):
    args = [sys.executable, __file__, f"--method={method}", f"--model={_MODEL.value}",
            f"--calib_tokens={_TOKENS.value}", f"--seq_len={_SEQ_LEN.value}", f"--k={_K.value}"]
    proc = subprocess.run(args, capture_output=True, text=True)
    line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
    if line is None:
      said = [l for l in proc.stderr.splitlines() if l.startswith("error: ")]
      if said:  # the measuring process refused its input: its line, as this one's
        raise GSIError(said[0][len("error: "):])
      raise SystemExit(f"{method} run failed:\n{proc.stderr[-2000:]}")
    rec = json.loads(line[len("RESULT "):])
    rec["peak_over_model_f32"] = rec["peak_rss_mib"] / rec["model_f32_mib"]
    records.append(rec)
    print(json.dumps(rec))
  experiment.write_json(out, {"records": records})


if __name__ == "__main__":
  cli.run(main, one_process="measures one process's calibration time and memory")
