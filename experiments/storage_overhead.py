"""Bytes of M and V_k against the model, per k; and the same formula at GPT-J's shape.

Sizes in MB are 10^6 bytes, as the paper's.

  python experiments/storage_overhead.py --k 128,256,384
"""

import jax

import gsi_jax
from gsi_jax import cli, experiment, metrics
from gsi_jax.experiment import ExperimentConfig
from gsi_jax.loading.load import param_shapes
from gsi_jax.metrics import bytes as mbytes
from gsi_jax.models import ModelConfig
from gsi_jax.models import params as P

cli.define_experiment_flags()
OUT = "results/storage_overhead.json"
COLUMNS = ["model", "k", "model_mb", "added_mb", "overhead", "M_over_W_by_site", "V_over_M",
           "dtype"]


def paper_shape_overhead(config: ModelConfig, k: int) -> dict:
  """GSI's storage on a model known only by its config: the decoder's declared parameter
  shapes (abstract, no weights), counted with the same formula."""
  shapes = param_shapes(config, "bfloat16")
  params = sum(leaf.size for leaf in jax.tree.leaves(shapes))
  added = sum(mbytes.storage_elements(d, o, k) for _, _, d, o in P.site_shapes(shapes))
  return {"model": config.name, "k": k, "model_params": float(params),
          "added_params": float(added), "model_mb": params * 2 / 1e6,
          "added_mb": added * 2 / 1e6, "overhead": added / params,
          "dtype": "bfloat16 (shape only)"}


def storage_overhead(config: ExperimentConfig) -> tuple[experiment.Setup, list[dict]]:
  s = experiment.prepare(config, need_eval=False)
  itemsize = s.model.dtype.itemsize
  records = []
  for k in config.k:
    params = gsi_jax.apply_gsi(s.model.params, s.bases, k)
    b = metrics.byte_accounting(params)
    added = b["storage_overhead"] * b["params_total"]
    by_site, v_total, m_total = {}, 0, 0
    for layer, site, d, o in P.site_shapes(params):
      kk = min(k, d)
      by_site.setdefault(site, kk * o / (d * o))
      v_total, m_total = v_total + d * kk, m_total + kk * o
    records.append({"model": s.model.config.name, "k": k, "model_params": b["params_total"],
                    "added_params": added, "model_mb": b["params_total"] * itemsize / 1e6,
                    "added_mb": added * itemsize / 1e6, "overhead": b["storage_overhead"],
                    "M_over_W_by_site": by_site, "V_over_M": v_total / m_total,
                    "dtype": str(s.model.dtype)})
  records += [paper_shape_overhead(ModelConfig.gptj_6b(), k) for k in config.k]
  return s, records


def main(argv):
  config = cli.experiment_config(OUT)
  s, records = storage_overhead(config)
  experiment.write_records(config.out, s.describe(), records, COLUMNS)


if __name__ == "__main__":
  cli.run(main)
