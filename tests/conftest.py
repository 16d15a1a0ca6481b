import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory):
  """name -> (folder with a saved tiny HF model, the torch model)."""
  from tests import hf_models
  cache = {}

  def make(name):
    if name not in cache:
      folder = tmp_path_factory.mktemp(name)
      cache[name] = (str(folder), hf_models.save(name, folder))
    return cache[name]
  return make
