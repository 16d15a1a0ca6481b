"""Memory of calibration and inference per device, from the published shapes alone.

  python benchmarks/memory_plan.py --out results/benchmarks/memory_plan.json

For each shape: the weights in bf16, the float32 Gram matrices of one layer (what
streaming calibration holds) and of all layers (what an all-at-once calibration
held), the calibration windows' hidden states, and per device on meshes of 1-16
devices with weights split by columns and Gram matrices by rows
(gsi_jax.sharding, calibrate(mesh=...)).  Arithmetic on parameter shapes that
the decoder itself declares; nothing is allocated.
"""

import logging

import jax
import jax.numpy as jnp
from absl import flags

from gsi_jax import cli, experiment
from gsi_jax.errors import GSIError
from gsi_jax.loading import synthetic
from gsi_jax.loading.hf_config import config_from_hf
from gsi_jax.loading.load import param_shapes
from gsi_jax.models import params as P

_SHAPES = flags.DEFINE_list("shapes", ["gptj-6b", "opt-6.7b", "opt-66b"], "Published shapes.")
_CALIB_TOKENS = flags.DEFINE_integer("calib_tokens", 16384, "Calibration tokens (hidden states).")
_DEVICES = flags.DEFINE_list("devices", ["1", "4", "8", "16"], "Mesh sizes.")
_OUT = flags.DEFINE_string("out", "results/benchmarks/memory_plan.json", "JSON output.")

GB = 1e9


def plan(shape: str, calib_tokens: int, devices: tuple[int, ...]) -> dict:
  config = config_from_hf(synthetic.hf_config(shape).to_dict(), name=shape)
  shapes = param_shapes(config, jnp.bfloat16)
  weights = sum(x.size * 2 for x in jax.tree.leaves(shapes))
  widths = P.site_widths(shapes)
  gram_layer = max(sum(4 * d * d for d in sites.values()) for sites in widths.values())
  gram_all = sum(4 * d * d for sites in widths.values() for d in sites.values())
  hidden = calib_tokens * config.d_model * 2  # bf16 hidden states, replicated
  return {
      "shape": shape, "layers": config.n_layers, "d_model": config.d_model,
      "site_widths": sorted({d for sites in widths.values() for d in sites.values()}),
      "weights_gb": weights / GB, "gram_one_layer_gb": gram_layer / GB,
      "gram_all_layers_gb": gram_all / GB, "hidden_states_gb": hidden / GB,
      "per_device_gb": {str(n): (weights / n + gram_layer / n + hidden) / GB for n in devices},
  }


def main(argv):
  del argv
  for shape in _SHAPES.value:
    if shape not in synthetic.SHAPES:
      raise GSIError(f"--shapes: unknown shape {shape!r}; use {', '.join(synthetic.SHAPES)}")
  devices = tuple(experiment.positive("--devices", n)
                  for n in cli.numbers("devices", _DEVICES.value, int))
  experiment.positive("--calib_tokens", _CALIB_TOKENS.value)
  out = experiment.check_output_path(_OUT.value)
  records = [plan(s, _CALIB_TOKENS.value, devices) for s in _SHAPES.value]
  for r in records:
    logging.info("%s: weights %.1f GB, Grams %.2f GB per layer (%.1f GB all layers)", r["shape"],
                 r["weights_gb"], r["gram_one_layer_gb"], r["gram_all_layers_gb"])
  experiment.write_json(out, {"calib_tokens": _CALIB_TOKENS.value, "records": records})


if __name__ == "__main__":
  cli.run(main)
