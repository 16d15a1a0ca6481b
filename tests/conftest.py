import importlib.metadata
import os

# The tests compile the same small programs over and over (sweeps clear JAX's caches as
# they go, and scripts run in subprocesses), and compiling is much of their time: one
# persistent compilation cache serves every test process, xdist workers and the scripts
# they start alike.  It has no size limit: with one, JAX's LRU cache reads every entry's
# size and access time on every write, under one lock for all processes, which grows with
# the cache (thousands of entries by the end of CI).  Without one, a read that meets a
# half-written entry fails to decompress, and JAX warns and compiles (jax/_src/compiler.py).
COMPILATION_CACHE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                 ".cache", "jax-compilation")
for name, value in (("JAX_COMPILATION_CACHE_DIR", COMPILATION_CACHE),
                    ("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")):
  os.environ.setdefault(name, value)
# The tests' bases cache is their own, never the user's (~/.cache/gsi_jax/bases or their
# $GSI_JAX_BASES_DIR): set before gsi_jax is imported, and inherited by every script a test
# starts.
os.environ["GSI_JAX_BASES_DIR"] = os.path.join(os.path.dirname(COMPILATION_CACHE), "test-bases")

# Compiling is also most of what a cold cache costs (CI starts with none), so the tests
# compile with XLA's cheapest CPU code generation (tests/compile_flags.py), only where they
# pin the CPU (the Makefile, gpu_check's dry run), and where XLA_FLAGS is unset: a GPU's own
# code generation is left as XLA sets it, and an empty XLA_FLAGS keeps XLA's defaults (as
# tools/compile_flags.py sets it to compare the two).  Scripts a test starts inherit
# the flags; a test that sets XLA_FLAGS for its scripts adds to them (`with_xla_flags`).
from tests.compile_flags import cheap_compile_flags  # pylint: disable=wrong-import-position

if os.environ.get("JAX_PLATFORMS") == "cpu" and "XLA_FLAGS" not in os.environ:
  os.environ["XLA_FLAGS"] = cheap_compile_flags(importlib.metadata.version("jaxlib"))

import json  # pylint: disable=wrong-import-position
import time  # pylint: disable=wrong-import-position

import filelock  # pylint: disable=wrong-import-position
import jax  # pylint: disable=wrong-import-position  (after the cache's settings)
import pytest  # pylint: disable=wrong-import-position

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Shapes must match exactly: an implicit rank promotion is a bug here.
jax.config.update("jax_numpy_rank_promotion", "raise")


def methods_in_committed(json_name: str, found) -> set[str]:
  """The registered methods a committed JSON holds; one a later commit registered is not an
  error but a result not yet run, named in the run's warnings (README, Adding a method)."""
  import warnings
  from gsi_jax import methods
  found = set(found)
  unknown = found - set(methods.names())
  assert not unknown, f"{json_name} holds methods no longer registered: {sorted(unknown)}"
  missing = sorted(set(methods.names()) - found)
  if missing:
    warnings.warn(f"{json_name}: not yet run for {', '.join(missing)} (README, Adding a "
                  "method, says how to regenerate it)")
  return found


def with_xla_flags(*flags: str) -> dict[str, str]:
  """os.environ for a script, with `flags` added to XLA_FLAGS."""
  return {**os.environ, "XLA_FLAGS": " ".join([os.environ.get("XLA_FLAGS", ""), *flags]).strip()}


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


def once_per_run(tmp_path_factory, worker_id: str, name: str, build):
  """build()'s value (JSON), built once per test run: under xdist the first worker to take
  the lock builds it into the run's shared temporary folder and the others read it
  (xdist's recipe for a fixture that runs once); a module fixture alone builds on each."""
  if worker_id == "master":
    return build()
  path = tmp_path_factory.getbasetemp().parent / f"{name}.json"
  with filelock.FileLock(f"{path}.lock"):
    if not path.is_file():
      path.write_text(json.dumps(build()))
    return json.loads(path.read_text())


def pytest_collection_modifyitems(items):
  """Tests marked `long` run first: two workers that take the longest tests first end close
  together, where one picked up last would run on while the other idles.  (Every worker
  sorts alike, so xdist sees one order.)"""
  items.sort(key=lambda item: item.get_closest_marker("long") is None)


# A long run says where it is: every PROGRESS_EVERY_S, the tests done of all and an estimate
# of what is left (-q's dots alone say neither, over a run of many minutes).
PROGRESS_EVERY_S = 60.0


class RunProgress:
  """Counts finished tests where the reports arrive: the one process without xdist, xdist's
  controller with it (which learns the total from its workers' collections)."""

  def __init__(self, config, every_s: float = PROGRESS_EVERY_S):
    self.config = config  # its terminal reporter registers after this plugin's configure
    self.every_s, self.total, self.done = every_s, 0, 0
    self.start = self.said = time.monotonic()

  def pytest_collection_finish(self, session):
    self.total = self.total or len(session.items)

  @pytest.hookimpl(optionalhook=True)  # xdist's hook: a run without xdist has none
  def pytest_xdist_node_collection_finished(self, node, ids):
    self.total = max(self.total, len(ids))

  def pytest_runtest_logreport(self, report):
    if report.when != "teardown":
      return
    self.done += 1
    now = time.monotonic()
    if self.total and now - self.said >= self.every_s and self.done < self.total:
      self.said = now
      left = (now - self.start) / self.done * (self.total - self.done)
      reporter = self.config.pluginmanager.getplugin("terminalreporter")
      reporter.write("\n")  # off the line of -q's dots
      reporter.write_line(f"tests: {self.done}/{self.total} done in "
                          f"{(now - self.start) / 60:.1f} min, about {left / 60:.0f} min left")


def pytest_configure(config):
  if not hasattr(config, "workerinput"):  # xdist's workers report to the controller
    config.pluginmanager.register(RunProgress(config), "gsi-jax-run-progress")
