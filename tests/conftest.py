import os

import jax
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Shapes must match exactly: an implicit rank promotion is a bug here.
jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory):
  """name -> (folder with a saved tiny HF model and a char tokenizer, the torch model)."""
  from tests import hf_models
  cache = {}

  def make(name):
    if name not in cache:
      folder = tmp_path_factory.mktemp(name)
      model = hf_models.save(name, folder)
      hf_models.save_char_tokenizer(folder)
      cache[name] = (str(folder), model)
    return cache[name]
  return make
