"""One batch-1 gated map, dense against GSI with a forced fast-path share, cache-cold.

  python benchmarks/linear.py --out results/benchmarks/linear.json
  python benchmarks/linear.py --d_out 4096 --k 256 --fast_share 0,1 --copies 16

A real model's layers each have their own (V_k, M, W), so a decode step never
finds them in cache.  The benchmark cycles through --copies distinct triples
(default: enough that the copies' V_k and M alone exceed 4× the last-level
cache, at most what fits in a third of the free memory, and always at least 2;
`v_and_m_over_cache` records how far they cover the cache), token t using copy
t mod copies, in a jitted scan; dense cycles through the same W copies in the
same process.  Tokens are drawn so that a chosen share lies in span(V_k) (fast)
and the rest does not.
Dense and GSI scans alternate in --repeats paired rounds: measured_speedup is the
median of the per-round ratios, with a bootstrap 95% interval (`gsi_jax.measure.benchmarking`).
Byte-ideal speedup: the ratio of the byte formula (`gsi_jax.metrics.bytes`).
"""

import logging

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from gsi_jax import cli, experiment
from gsi_jax.measure.benchmarking import (available_memory_bytes, copies_plan, interval_fields,
                                  last_level_cache_bytes, ratio_text, scan_over_copies,
                                  timed_pair)
from gsi_jax.errors import GSIError
from gsi_jax.metrics.bytes import gated_map_elements
from gsi_jax.ops import GatedWeights, gated_linear, make_gate

_D = flags.DEFINE_list("d", ["4096"], "Input widths.")
_D_OUT = flags.DEFINE_list("d_out", ["4096", "12288", "16384"], "Output widths.")
_K = flags.DEFINE_list("k", ["128", "256", "512"], "Ranks.")
_F = flags.DEFINE_list("fast_share", ["0", "0.5", "0.9", "1.0"], "Forced fast-path shares.")
_TOKENS = flags.DEFINE_integer("tokens", 128, "Tokens decoded per timed scan.")
_REPEATS = flags.DEFINE_integer("repeats", 15, "Paired rounds (a dense scan and a GSI scan "
                                "each): the median ratio and its 95% interval.")
_COPIES = flags.DEFINE_integer("copies", 0, "Distinct (V, M, W) triples cycled (0: from the "
                               "last-level cache size).")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Weights and activations.")
_IMPL = flags.DEFINE_enum("impl", "auto", ["xla", "pallas", "auto"],
                          "GSI map: auto (the Pallas kernel on a GPU, XLA with the batch-1 "
                          "switch on cpu), xla, or pallas.")
_OUT = flags.DEFINE_string("out", "results/benchmarks/linear.json", "JSON output.")
EPS = 0.1


@jax.jit
def dense_scan(x_NCD, Ws):
  return scan_over_copies(lambda x, W: x @ W, x_NCD, [(W,) for W in Ws])


def gsi_scan(impl):
  gate = make_gate(EPS, impl=impl, batch1_switch=True)

  @jax.jit
  def run(x_NCD, triples):
    def step(x, V, M, W):
      (y,), _, _ = gated_linear(x[None, None], GatedWeights([W], V, [M]), gate.eps, gate)
      return y[0, 0]
    return scan_over_copies(step, x_NCD, triples)
  return run


def tokens(rng, Vs, n, share):
  """(n, C, d) tokens, exactly round(share · n · C) of them in span(V_c) of their copy c."""
  C, (d, k) = len(Vs), Vs[0].shape
  fast_NC = (rng.permutation(n * C) < round(share * n * C)).reshape(n, C)
  x = rng.normal(size=(n, C, d))
  for c, V in enumerate(Vs):
    rows = fast_NC[:, c]
    x[rows, c] = rng.normal(size=(rows.sum(), k)) @ V.T + 1e-3 * rng.normal(size=(rows.sum(), d))
  return x, float(fast_NC.mean())


def main(argv):
  del argv
  dtype = jnp.dtype(_DTYPE.value)
  shares = cli.numbers("fast_share", _F.value, float)
  if any(not 0 <= f <= 1 for f in shares):
    raise GSIError(f"--fast_share takes numbers in [0, 1], got {list(shares)}")
  dims = [cli.numbers(n, v, int) for n, v in (("d", _D.value), ("d_out", _D_OUT.value),
                                              ("k", _K.value))]
  if any(x < 1 for values in dims for x in values):
    raise GSIError("--d, --d_out and --k take positive whole numbers")
  experiment.positive("--tokens", _TOKENS.value)
  experiment.positive("--repeats", _REPEATS.value)
  if _COPIES.value < 0:
    raise GSIError(f"--copies must be >= 0, got {_COPIES.value}")
  out = experiment.check_output_path(_OUT.value)
  llc = last_level_cache_bytes()
  plan = copies_plan(dims, dtype.itemsize, llc, available_memory_bytes(), _COPIES.value)
  records = []
  rng = np.random.default_rng(0)
  key = jax.random.key(0)
  for d in dims[0]:
    for d_out in dims[1]:
      for k in dims[2]:
        per_copy = (d * k + k * d_out) * dtype.itemsize
        C = plan[d, d_out, k]
        n = max(1, _TOKENS.value // C)  # groups of C tokens
        logging.info("d=%d O=%d k=%d: %d copies (%.0f MB of V and M, %.0f MB of W)", d, d_out,
                     k, C, C * per_copy / 1e6, C * d * d_out * dtype.itemsize / 1e6)
        Ws, Vs, Ms = [], [], []
        for c in range(C):
          W = jax.random.normal(jax.random.fold_in(key, c), (d, d_out), jnp.float32) / np.sqrt(d)
          V_np, _ = np.linalg.qr(rng.normal(size=(d, k)))
          V = jnp.asarray(V_np, jnp.float32)
          Ws.append(W.astype(dtype))
          Vs.append(V_np)
          Ms.append((V.T @ W).astype(dtype))
        triples = [(jnp.asarray(V, dtype), M, W) for V, M, W in zip(Vs, Ms, Ws)]
        scan = gsi_scan(_IMPL.value)
        for target in shares:
          x_np, f = tokens(rng, Vs, n, target)  # f: the share the scan really sees
          x = jnp.asarray(x_np, dtype)
          pair = timed_pair(lambda: dense_scan(x, Ws).block_until_ready(),
                            lambda: scan(x, triples).block_until_ready(), _REPEATS.value)
          dense_ms, gsi_ms = (1e3 * pair[key] / (n * C) for key in ("base_s", "other_s"))
          dense_bytes = d * d_out * dtype.itemsize
          gsi_bytes = gated_map_elements(d, d_out, k, f * k, f) * dtype.itemsize
          ideal = dense_bytes / gsi_bytes
          rec = {"d": d, "d_out": d_out, "k": k, "fast_share": f, "dtype": _DTYPE.value,
                 "impl": _IMPL.value, "copies": C, "tokens": n * C,
                 "v_and_m_over_cache": C * per_copy / llc,
                 "dense_ms": dense_ms, "gsi_ms": gsi_ms,
                 "measured_speedup": pair["ratio"], **interval_fields(pair),
                 "ideal_speedup": ideal, "of_ideal": pair["ratio"] / ideal,
                 "dense_gb_s": dense_bytes / dense_ms / 1e6, "gsi_gb_s": gsi_bytes / gsi_ms / 1e6,
                 "dense_compile_ms": 1e3 * pair["base_compile_s"],
                 "gsi_compile_ms": 1e3 * pair["other_compile_s"]}
          records.append(rec)
          logging.info("d=%d O=%d k=%d f=%.2f: dense %.3f ms, GSI %.3f ms, %s (ideal %.2fx)",
                       d, d_out, k, f, dense_ms, gsi_ms,
                       ratio_text(pair["ratio"], pair["ratio_low"], pair["ratio_high"]), ideal)
  experiment.write_json(out, {"config": {"repeats": _REPEATS.value, "eps": EPS,
                                         "last_level_cache_bytes": llc,
                                         "devices": str(jax.devices())}, "records": records})


if __name__ == "__main__":
  cli.run(main, one_process="times one map on one device")
