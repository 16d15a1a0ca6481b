"""Bytes of M and V_k against the model, per k; and the same formula at GPT-J's shape.

  python experiments/storage_overhead.py --k 128,256,384
"""

import gsi_jax
from gsi_jax import cli, experiment, metrics
from gsi_jax.experiment import ExperimentConfig
from gsi_jax.metrics import bytes as mbytes
from gsi_jax.models import ModelConfig
from gsi_jax.models import params as P

cli.define_experiment_flags()
OUT = "results/storage_overhead.json"
COLUMNS = ["model", "k", "model_mb", "added_mb", "overhead", "M_over_W_by_site", "V_over_M",
           "dtype"]


def paper_shape_overhead(config: ModelConfig, k: int) -> dict:
  """GSI's storage on a model known only by its shape (no weights): the same formula."""
  c = config
  d, qkv = c.d_model, c.q_dim + 2 * c.kv_dim
  mlp_in = (2 if c.gated_mlp else 1) * c.d_ff
  sites = ([(d, qkv + mlp_in), (c.q_dim, d), (c.d_ff, d)] if c.parallel_block
           else [(d, qkv), (c.q_dim, d), (d, mlp_in), (c.d_ff, d)]) * c.n_layers
  linear = sum(a * b for a, b in sites)
  head = 0 if c.tied_embeddings else d * c.vocab_size
  params = linear + c.vocab_size * c.embed_dim + head + c.learned_positions * d
  added = sum(mbytes.storage_elements(a, b, k) for a, b in sites)
  return {"model": c.name, "k": k, "model_params": float(params), "added_params": float(added),
          "model_mb": params * 2 / 2**20, "added_mb": added * 2 / 2**20,
          "overhead": added / params, "dtype": "bfloat16 (shape only)"}


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
                    "added_params": added, "model_mb": b["params_total"] * itemsize / 2**20,
                    "added_mb": added * itemsize / 2**20, "overhead": b["storage_overhead"],
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
