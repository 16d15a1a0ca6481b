"""Write a random-weight checkpoint of a published shape (sharded bf16 safetensors).

  python benchmarks/make_checkpoint.py --shape gptj-6b --out /data/gptj-6b-random

The files are large (GPT-J-6B: 12.1 GB) and never belong in the repository.
"""

import logging
import os

from absl import flags

from gsi_jax import cli, experiment
from gsi_jax.errors import GSIError
from gsi_jax.gsi.checkpoint import check_writable
from gsi_jax.loading import synthetic

_SHAPE = flags.DEFINE_enum("shape", "gptj-6b", list(synthetic.SHAPES), "Published shape.")
_OUT = flags.DEFINE_string("out", None, "Folder to write (must not hold a checkpoint).")
_LAYERS = flags.DEFINE_integer("layers", None, "Blocks to write (default: the shape's all).")
_SEED = flags.DEFINE_integer("seed", 0, "Random seed.")


def main(argv):
  del argv
  if not _OUT.value:
    raise GSIError("--out is required: the folder to write the checkpoint to")
  if os.path.exists(os.path.join(_OUT.value, "config.json")):
    raise GSIError(f"{_OUT.value} already holds a checkpoint; pass an empty or new folder")
  check_writable(_OUT.value)
  overrides = {}
  if _LAYERS.value is not None:
    experiment.positive("--layers", _LAYERS.value)
    key = "num_hidden_layers" if _SHAPE.value == "opt-6.7b" else "n_layer"
    overrides[key] = _LAYERS.value
  written = synthetic.write_random_checkpoint(synthetic.hf_config(_SHAPE.value, **overrides),
                                              _OUT.value, seed=_SEED.value)
  logging.info("wrote %s: %d files, %.2f GB, %.2f B parameters in %.0f s", _OUT.value,
               written["files"], written["bytes"] / 1e9, written["parameters"] / 1e9,
               written["seconds"])


if __name__ == "__main__":
  cli.run(main, one_process="writes a checkpoint from one process")
