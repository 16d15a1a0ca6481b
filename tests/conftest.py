import os

import jax
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Shapes must match exactly: an implicit rank promotion is a bug here.
jax.config.update("jax_numpy_rank_promotion", "raise")


# Tiny models saved beforehand (`python -m tests.hf_models DIR`), for an environment
# without torch (`make test-jax011`): the folder's NAME/ holds each model.
PREBUILT = os.environ.get("GSI_JAX_TINY_MODELS")


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory):
  """name -> (folder with a saved tiny HF model and a char tokenizer, the torch model;
  None for a prebuilt folder, where torch may be absent)."""
  cache = {}

  def make(name):
    if name not in cache and PREBUILT:
      folder = os.path.join(PREBUILT, name)
      if not os.path.isdir(folder):
        raise FileNotFoundError(f"{folder}: GSI_JAX_TINY_MODELS holds no {name}; rebuild it "
                                "with python -m tests.hf_models")
      cache[name] = (folder, None)
    if name not in cache:
      from tests import hf_models
      folder = tmp_path_factory.mktemp(name)
      model = hf_models.save(name, folder)
      hf_models.save_char_tokenizer(folder)
      cache[name] = (str(folder), model)
    return cache[name]
  return make
