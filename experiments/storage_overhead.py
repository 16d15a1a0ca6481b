"""Bytes of M and V_k against the model, per k.

  python experiments/storage_overhead.py --k 128,256,384
"""

from absl import flags

import gsi_jax
from gsi_jax import cli, harness
from gsi_jax.gsi import metrics

FLAGS = flags.FLAGS
OUT = "results/storage_overhead.json"


def main(argv):
  ks = harness.ks()
  s = harness.setup(k_max=max(ks), need_eval=False)
  itemsize = s.model.dtype.itemsize
  records = []
  for k in ks:
    params = gsi_jax.apply_gsi(s.model.params, s.bases, k)
    b = metrics.byte_accounting(params, k, None)
    added = b["storage_overhead"] * b["params_total"]
    records.append({"k": k, "model_params": b["params_total"], "added_params": added,
                    "model_mb": b["params_total"] * itemsize / 2**20,
                    "added_mb": added * itemsize / 2**20, "overhead": b["storage_overhead"],
                    "dtype": str(s.model.dtype)})
  harness.write(harness.config(s), records,
                ["k", "model_mb", "added_mb", "overhead", "dtype"], OUT)


if __name__ == "__main__":
  cli.run(main)
