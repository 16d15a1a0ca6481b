import os

# The tests compile the same small programs over and over (sweeps clear JAX's caches as
# they go, and scripts run in subprocesses), and compiling is much of their time: one
# persistent compilation cache serves every test process, xdist workers and the scripts
# they start alike.  A size limit turns on JAX's file lock around each read and write.
COMPILATION_CACHE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                 ".cache", "jax-compilation")
for name, value in (("JAX_COMPILATION_CACHE_DIR", COMPILATION_CACHE),
                    ("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0"),
                    ("JAX_COMPILATION_CACHE_MAX_SIZE", str(4 << 30))):
  os.environ.setdefault(name, value)

import jax  # pylint: disable=wrong-import-position  (after the cache's settings)
import pytest  # pylint: disable=wrong-import-position

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


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups into each test's id
def pytest_collection_modifyitems(items):
  """Under `--dist loadgroup` (the Makefile's): a test that uses a module-scoped fixture
  runs on the worker that holds its file's other such tests, so the fixture is built once;
  every other test goes to whichever worker is free.  One long file (the scripts end to
  end) then no longer runs on one worker while the other idles."""
  for item in items:
    info = getattr(item, "_fixtureinfo", None)
    if info and any(d.scope == "module" for defs in info.name2fixturedefs.values()
                    for d in defs):
      item.add_marker(pytest.mark.xdist_group(item.module.__name__))
