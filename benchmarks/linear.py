"""One batch-1 linear map, dense against GSI with a forced fast-path share.

  python benchmarks/linear.py --out results/benchmarks/linear.json
  python benchmarks/linear.py --d 4096 --d_out 4096 --k 256 --fast_share 0,1

Tokens are drawn so that a chosen share lies in span(V_k) (fast) and the
rest does not (slow); a jitted scan decodes them one at a time through the
library's gated map with the batch-1 skip, against a scan of x @ W.
Byte-ideal speedup: d*O / (d*k + f*k*O + (1-f)*d*O): V_k is read for every
token's gate, then M (fast) or W (slow).
"""

import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags, logging

from gsi_jax import cli
from gsi_jax.errors import GSIError
from gsi_jax.models.linear import gated_outputs

_D = flags.DEFINE_list("d", ["4096"], "Input widths.")
_D_OUT = flags.DEFINE_list("d_out", ["4096", "12288", "16384"], "Output widths.")
_K = flags.DEFINE_list("k", ["128", "256", "512"], "Ranks.")
_F = flags.DEFINE_list("fast_share", ["0", "0.5", "0.9", "1.0"], "Forced fast-path shares.")
_TOKENS = flags.DEFINE_integer("tokens", 64, "Tokens decoded per timed scan.")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed scans (best kept).")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Weights and activations.")
_IMPL = flags.DEFINE_enum("impl", "xla", ["xla", "pallas"],
                          "GSI map: XLA with the batch-1 switch, or the Pallas kernel (GPU).")
_OUT = flags.DEFINE_string("out", "results/benchmarks/linear.json", "JSON output.")
EPS = 0.1


@jax.jit
def dense_scan(x_TD, W_DO):
  return jax.lax.scan(lambda c, x: (c, x @ W_DO), None, x_TD)[1]


@jax.jit
def gsi_scan(x_TD, V_DK, M_KO, W_DO):
  def step(c, x):
    (y,), _, _ = gated_outputs(x[None, None], [W_DO], V_DK, M_KO, EPS, static=False,
                               skip_residual=True)
    return c, y[0, 0]
  return jax.lax.scan(step, None, x_TD)[1]


@jax.jit
def pallas_scan(x_TD, V_DK, M_KO, W_DO):
  from gsi_jax.kernels import gated_linear

  def step(c, x):
    y, _ = gated_linear(x[None], V_DK, M_KO, W_DO, EPS)
    return c, y[0]
  return jax.lax.scan(step, None, x_TD)[1]


def best_ms(fn, repeats):
  jax.block_until_ready(fn())
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t0)
  return 1e3 * min(times)


def tokens(rng, V, n, share):
  d, k = V.shape
  n_fast = int(round(share * n))
  fast = rng.normal(size=(n_fast, k)) @ V.T + 1e-3 * rng.normal(size=(n_fast, d))
  slow = rng.normal(size=(n - n_fast, d))
  x = np.concatenate([fast, slow])
  return x[rng.permutation(n)]


def ints(name, values):
  try:
    return [int(v) for v in values]
  except ValueError:
    raise GSIError(f"--{name} takes whole numbers, got {values}") from None


def main(argv):
  del argv
  dtype = jnp.dtype(_DTYPE.value)
  try:
    shares = [float(f) for f in _F.value]
  except ValueError:
    raise GSIError(f"--fast_share takes numbers in [0, 1], got {_F.value}") from None
  records = []
  rng = np.random.default_rng(0)
  n = _TOKENS.value
  for d in ints("d", _D.value):
    for d_out in ints("d_out", _D_OUT.value):
      W = jnp.asarray(rng.normal(size=(d, d_out)) / np.sqrt(d), dtype)
      x_any = jnp.asarray(rng.normal(size=(n, d)), dtype)
      dense_ms = best_ms(lambda: dense_scan(x_any, W), _REPEATS.value) / n
      for k in ints("k", _K.value):
        V_np, _ = np.linalg.qr(rng.normal(size=(d, k)))
        V = jnp.asarray(V_np, dtype)
        M = (V.astype(jnp.float32).T @ W.astype(jnp.float32)).astype(dtype)
        for f in shares:
          x = jnp.asarray(tokens(rng, V_np, n, f), dtype)
          scan = pallas_scan if _IMPL.value == "pallas" else gsi_scan
          gsi_ms = best_ms(lambda: scan(x, V, M, W), _REPEATS.value) / n
          gsi_bytes = (d * k + f * k * d_out + (1 - f) * d * d_out) * dtype.itemsize
          dense_bytes = d * d_out * dtype.itemsize
          ideal = dense_bytes / gsi_bytes
          rec = {"d": d, "d_out": d_out, "k": k, "fast_share": f, "dtype": _DTYPE.value,
                 "impl": _IMPL.value, "dense_ms": dense_ms, "gsi_ms": gsi_ms,
                 "measured_speedup": dense_ms / gsi_ms, "ideal_speedup": ideal,
                 "of_ideal": dense_ms / gsi_ms / ideal,
                 "dense_gb_s": dense_bytes / dense_ms / 1e6, "gsi_gb_s": gsi_bytes / gsi_ms / 1e6}
          records.append(rec)
          logging.info("d=%d O=%d k=%d f=%.2f: dense %.3f ms, GSI %.3f ms, %.2fx (ideal %.2fx)",
                       d, d_out, k, f, dense_ms, gsi_ms, rec["measured_speedup"], ideal)
  result = {"config": {"tokens": n, "repeats": _REPEATS.value, "eps": EPS,
                       "devices": str(jax.devices())}, "records": records}
  os.makedirs(os.path.dirname(os.path.abspath(_OUT.value)), exist_ok=True)
  with open(_OUT.value, "w") as fh:
    json.dump(result, fh, indent=2)
  print(json.dumps(records, indent=1))


if __name__ == "__main__":
  cli.run(main)
