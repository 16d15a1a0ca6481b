"""Orbax checkpoints of calibrated bases.

Each save is a new step of an Orbax CheckpointManager, a folder gsi_bases_<step>: Orbax
writes into a temporary folder and renames it only once complete, so an interrupted or
failed save never touches the steps already there, and restore reads the newest complete
one.  Older saves are pruned past `keep` (one by default), and only saves: nothing else in
the folder is ever taken for a step.  The metadata carries a SHA-256 of every array and one of
itself, and a restore checks both, then that the values are finite and the
vectors orthonormal: damaged or edited bases are never handed on, and bases
that fail those checks are never saved.  Every writer and reader of a checkpoint
folder holds its lock (`exclusive`), so two runs never number, write or prune the same
steps at once.  In a run of several processes (gsi_jax.runtime.distributed) every process holds
the same bases: process 0 alone locks and writes, on a file system they all share.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import shlex
import tempfile
import threading

import jax
import numpy as np

from gsi_jax.runtime import distributed
from gsi_jax.errors import GSIError, whole
from gsi_jax.errors import path as path_arg
from gsi_jax.gsi.bases import FORMAT_VERSION, Bases, expect_bases
from gsi_jax.models import params as P

ORTHONORMAL_TOL = 1e-3  # float32 vectors of width up to 16384
META_SHA256 = "meta_sha256"


# Saved bases are steps named gsi_bases_<n>.  Orbax takes every folder its step format
# matches for a step, and prunes the oldest: with bare numbers it would take a user's own
# folders named 1, 2, ... for steps and delete them.  With the prefix it sees only ours.
BASES_STEP_PREFIX = "gsi_bases"


def _manager(path: str, create: bool, max_to_keep: int | None = 2,
             step_prefix: str | None = None):
  """A manager of this process alone: bases are host arrays that every process holds
  whole, so the primary writes them and each process reads them, with no barrier."""
  import orbax.checkpoint as ocp
  me = jax.process_index()
  if create:  # Orbax creates no root for a manager of a subset of processes
    os.makedirs(path, exist_ok=True)
  options = ocp.CheckpointManagerOptions(
      max_to_keep=max_to_keep, step_prefix=step_prefix, create=False,
      enable_async_checkpointing=False,
      multiprocessing_options=ocp.options.MultiprocessingOptions(primary_host=me,
                                                                 active_processes={me}))
  return ocp.CheckpointManager(os.path.abspath(path), options=options,
                               item_names=("arrays", "meta"))


def checksums(arrays: dict) -> dict[str, str]:
  """{"field/layer/site": sha256 of the array's bytes}."""
  flat = jax.tree_util.tree_flatten_with_path(arrays)[0]
  return {"/".join(str(p.key) for p in path): hashlib.sha256(
      np.ascontiguousarray(leaf).tobytes()).hexdigest() for path, leaf in flat}


def _meta_digest(meta: dict) -> str:
  body = {k: v for k, v in meta.items() if k != META_SHA256}
  return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def sealed(meta: dict, arrays: dict) -> dict:
  """`meta` with the arrays' checksums, then a checksum over all of it: an edit to the
  metadata (k_max, the fingerprint, ...) is caught like an edit to the arrays."""
  meta = {**meta, "checksums": checksums(arrays)}
  return {**meta, META_SHA256: _meta_digest(meta)}


def can_create_in(folder: str) -> bool:
  """Whether a file can be created in `folder` (tried, since permissions lie to root)."""
  try:
    with tempfile.TemporaryFile(dir=folder):
      return True
  except OSError:
    return False


def existing_ancestor(path: str) -> str:
  """`path` itself, or the nearest folder above it that exists (where a create would start)."""
  probe = os.path.abspath(path)
  while not os.path.exists(probe):
    if os.path.islink(probe):  # a create would fail here, and the message should say why
      raise GSIError(f"{probe} is a broken symbolic link (to {os.readlink(probe)}); fix or "
                     "remove it")
    probe = os.path.dirname(probe)
  return probe


def check_writable(path: str) -> None:
  """Fail now, not after a calibration, if `path` cannot hold a checkpoint."""
  probe = existing_ancestor(path)
  if not os.path.isdir(probe):
    raise GSIError(f"cannot save bases under {path}: {probe} is a file, not a folder")
  if not can_create_in(probe):
    raise GSIError(f"cannot save bases under {path}: {probe} is not writable; "
                   "pass a writable --bases_dir (or '' to skip the cache)")


_held: dict[str, list] = {}  # lock file -> [open file, depth], for this process
_held_guard = threading.Lock()


@contextlib.contextmanager
def exclusive(path: str, create: bool = True):
  """Hold `path`.lock, an flock beside the folder; another process waits here (and says so).

  Re-entrant within a process, so a run that holds an entry (calibrate, then save)
  does not wait on itself.  With create=False (a reader) a lock file that cannot be
  made, as beside a read-only folder, is skipped: nothing can write there either.
  """
  if not distributed.is_primary():  # the primary locks for its run, which only it writes
    yield
    return
  lock = os.path.abspath(path) + ".lock"
  with _held_guard:
    entry = _held.get(lock)
    if entry:
      entry[1] += 1
  if not entry:
    try:
      if create:
        os.makedirs(os.path.dirname(lock), exist_ok=True)
      f = open(lock, "a")
    except OSError:
      if create:
        raise GSIError(f"cannot create the lock file {lock}; pass a writable folder") from None
      yield
      return
    try:
      fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      logging.info("another process is using %s; waiting for it", path)
      fcntl.flock(f, fcntl.LOCK_EX)
    with _held_guard:
      entry = _held[lock] = [f, 1]
  try:
    yield
  finally:
    with _held_guard:
      entry[1] -= 1
      last = entry[1] == 0
      if last:
        del _held[lock]
    if last:
      fcntl.flock(entry[0], fcntl.LOCK_UN)
      entry[0].close()


def storage_cause(e: BaseException) -> str:
  """What a failed save or restore says, on one line: an OSError's own words, else the
  first line of whatever Orbax or tensorstore raised (a full disk reaches us from
  tensorstore as a ValueError: RESOURCE_EXHAUSTED ... No space left on device)."""
  if isinstance(e, OSError) and e.strerror:
    return e.strerror
  first = (str(e).strip().splitlines() or [""])[0]
  return f"{type(e).__name__}: {first[:300]}" if first else type(e).__name__


def save_bases(path: str, bases: Bases, keep: int | None = 1) -> int:
  """Save as the next step under `path` (a folder gsi_bases_<step>); returns the step.

  keep: how many saves stay, the newest first (None: all).  The older ones go only once
  the new one is complete, and nothing in `path` that is not a save of bases is touched."""
  expect_bases(bases)
  path = path_arg("path", path)
  keep = None if keep is None else whole("keep", keep)
  check_writable(path)
  problem = _invalid(bases)
  if problem:
    raise GSIError(f"refusing to save bases to {path}: {problem}; the model or the "
                   "calibration text gives activations that no basis can describe")
  arrays = jax.tree.map(np.asarray, bases.arrays())
  meta = sealed({**bases.meta, "format_version": FORMAT_VERSION}, arrays)
  step = 0
  if distributed.is_primary():
    try:
      with exclusive(path), _manager(path, True, keep, BASES_STEP_PREFIX) as manager:
        step = (manager.latest_step() or 0) + 1
        _save(manager, step, arrays, meta)
    except GSIError:
      raise
    except Exception as e:  # any storage failure, tensorstore's included, is one line
      raise GSIError(f"cannot save bases to {path} ({storage_cause(e)}); earlier steps there "
                     "are untouched") from None
  return distributed.from_primary(step)


def _check_sums(path: str, arrays: dict, meta: dict) -> None:
  if meta.get("checksums") is None or META_SHA256 not in meta:
    raise GSIError(f"{path}: bases carry no checksums (an older format); calibrate again")
  if _meta_digest(meta) != meta[META_SHA256] or checksums(arrays) != meta["checksums"]:
    raise GSIError(f"{path}: bases fail their checksums; the checkpoint is damaged, "
                   "delete it and calibrate again")


def _check_values(path: str, bases: Bases) -> None:
  _check_sums(path, bases.arrays(), bases.meta)
  _check_orthonormal(path, bases)


def _invalid(bases: Bases) -> str | None:
  """What makes these bases unusable (shapes, non-finite values, not orthonormal), or None."""
  for layer, site in bases.sites():
    V = np.asarray(bases.vectors[layer][site])
    w = np.asarray(bases.eigenvalues[layer][site])
    if V.ndim != 2 or w.shape != (V.shape[1],):
      return f"the arrays of {layer}/{site} have inconsistent shapes"
    if not (np.all(np.isfinite(V)) and np.all(np.isfinite(w))
            and np.all(np.isfinite(bases.trace[layer][site]))):
      return f"{layer}/{site} holds non-finite values"
    gram = V.astype(np.float64).T @ V.astype(np.float64)
    if np.abs(gram - np.eye(V.shape[1])).max() > ORTHONORMAL_TOL:
      return f"the vectors of {layer}/{site} are not orthonormal"
  return None


def check_layer(name: str, vectors: dict, eigenvalues: dict, trace: dict,
                dtype: str = "") -> None:
  """One calibrated layer's bases, checked as they are made (not only when saved)."""
  problem = _invalid(Bases({name: vectors}, {name: eigenvalues}, {name: trace}, {}))
  if problem:
    cause = (" a float16 forward overflows past 65504: calibrate in bfloat16 or float32"
             if dtype == "float16" else " the model or the calibration text gives "
             "activations that no basis can describe")
    raise GSIError(f"calibration of {name} failed: {problem};{cause}")


def _check_orthonormal(path: str, bases: Bases) -> None:
  problem = _invalid(bases)
  if problem:
    raise GSIError(f"{path}: {problem}; damaged, delete it and calibrate again")


def _restore(manager, step: int, path: str):
  import orbax.checkpoint as ocp
  try:
    restored = manager.restore(step, args=ocp.args.Composite(
        arrays=ocp.args.StandardRestore(), meta=ocp.args.JsonRestore()))
  except Exception as e:
    raise GSIError(f"checkpoint {path} cannot be restored ({storage_cause(e)}): damaged or "
                   "unreadable; delete it and calibrate again") from None
  return jax.tree.map(np.asarray, restored["arrays"]), dict(restored["meta"] or {})


class _BackgroundWriteError(logging.Filter):
  """Orbax logs a failed background write (a full disk: tensorstore's RESOURCE_EXHAUSTED)
  with its traceback, then raises the same exception to the save, which reports it as one
  line naming the folder: the logged copy is dropped."""

  def filter(self, record: logging.LogRecord) -> bool:
    return not (record.exc_info and "orbax" in record.pathname
                and record.pathname.endswith("future.py"))


def _save(manager, step: int, arrays: dict, meta: dict) -> None:
  import orbax.checkpoint as ocp
  absl_logger, quiet = logging.getLogger("absl"), _BackgroundWriteError()
  absl_logger.addFilter(quiet)
  try:
    manager.save(step, args=ocp.args.Composite(arrays=ocp.args.StandardSave(arrays),
                                               meta=ocp.args.JsonSave(meta)))
    manager.wait_until_finished()
  finally:
    absl_logger.removeFilter(quiet)


class LayerProgress:
  """The finished layers of one streaming calibration, as Orbax steps under `path`.

  layers/ keeps one step per finished layer (its bases); carry/ keeps only the
  newest hidden states of the calibration windows, the next layer's input.
  Each step is written to a temporary folder and renamed when complete, so an
  interruption loses at most the layer being solved.  `run` (model, text,
  settings) must match for a resume; every array is checked against its SHA-256.
  A calibration holds `exclusive(path)` from its restore to its last save, so a
  second run on the same folder waits, then resumes after every layer the first
  one finished.
  """

  def __init__(self, path: str, run: dict):
    check_writable(path)
    self.path, self.run = path, run

  def _layers(self, create: bool):
    return _manager(os.path.join(self.path, "layers"), create, max_to_keep=None)

  def _carry(self, create: bool):
    return _manager(os.path.join(self.path, "carry"), create, max_to_keep=1)

  def _done(self) -> int:
    if not os.path.isdir(os.path.join(self.path, "carry")):
      return 0
    with self._carry(create=False) as manager:
      return manager.latest_step() or 0

  def save(self, index: int, vectors, eigenvalues, trace, costs, x_NTD) -> None:
    layer = {"vectors": vectors, "eigenvalues": eigenvalues, "trace": trace}
    check_layer(P.layer_name(index), vectors, eigenvalues, trace)
    carry = {"hidden": distributed.host_copy(x_NTD)}
    if not distributed.is_primary():
      return  # the primary writes every process's (identical) progress
    try:
      with self._layers(create=True) as manager:
        _save(manager, index + 1, layer,
              sealed({"run": self.run, "index": index, "costs": costs}, layer))
      with self._carry(create=True) as manager:
        _save(manager, index + 1, carry, sealed({"run": self.run}, carry))
    except GSIError:
      raise
    except Exception as e:  # any storage failure, tensorstore's included, is one line
      raise GSIError(f"cannot save calibration progress to {self.path} "
                     f"({storage_cause(e)}); earlier layers there are untouched") from None

  def restore(self, vectors: dict, eigenvalues: dict, trace: dict, costs: dict):
    """Fill the dicts with the finished layers; returns (layers done, their output or None)."""
    done = self._done()
    distributed.same_as_primary(done, "calibration progress", self.path)
    if not done:
      return 0, None
    with self._carry(create=False) as manager:
      carry, meta = _restore(manager, done, self.path)
    _check_sums(self.path, carry, meta)
    if meta.get("run") != self.run:
      theirs = meta.get("run") if isinstance(meta.get("run"), dict) else {}
      other = sorted(k for k in {**theirs, **self.run} if theirs.get(k) != self.run.get(k))
      raise GSIError(f"{self.path} holds an interrupted calibration with another "
                     f"{', '.join(other)}; to start afresh, delete it (rm -r "
                     f"{shlex.quote(self.path)}) or pass another folder")
    with self._layers(create=False) as manager:
      for step in range(1, done + 1):
        arrays, meta = _restore(manager, step, self.path)
        _check_sums(self.path, arrays, meta)
        if meta.get("run") != self.run or meta.get("index") != step - 1:
          raise GSIError(f"{self.path}: layer step {step} belongs to another calibration; "
                         f"to start afresh, delete it (rm -r {shlex.quote(self.path)}) or "
                         "pass another folder")
        layer = P.layer_name(step - 1)
        _check_orthonormal(self.path, Bases({layer: arrays["vectors"]},
                                            {layer: arrays["eigenvalues"]},
                                            {layer: arrays["trace"]}, {}))
        vectors[layer], eigenvalues[layer] = arrays["vectors"], arrays["eigenvalues"]
        trace[layer], costs[layer] = arrays["trace"], meta["costs"]
    return done, carry["hidden"]


# What a restore reads from the metadata, beyond its format version and checksums.
REQUIRED_META = {"k_max": int, "fingerprint": str, "method": str}


def _saved_steps(path: str, prefix: str | None) -> list[int]:
  """The complete saves of bases in `path`: folders <prefix>_<n> (bare <n> from earlier
  versions, which saved without a prefix) that hold both of a save's items.  A user's
  folder that merely has a number for a name is not one."""
  name = re.compile(rf"^{re.escape(prefix)}_(\d+)$" if prefix else r"^(\d+)$")
  steps = []
  for entry in os.listdir(path):
    found = name.match(entry)
    if found and all(os.path.isdir(os.path.join(path, entry, item))
                     for item in ("arrays", "meta")):
      steps.append(int(found.group(1)))
  return steps


def load_bases(path: str, fingerprint: str | None = None, k: int | None = None) -> Bases:
  """Restore the newest complete step; check integrity, model identity and k when given."""
  path = path_arg("path", path)
  if k is not None:
    k = whole("k", k)
  if not os.path.isdir(path):
    raise GSIError(f"no bases checkpoint at {path}; calibrate first")
  prefix, steps = BASES_STEP_PREFIX, _saved_steps(path, BASES_STEP_PREFIX)
  if not steps:  # an earlier version's saves, or none
    prefix, steps = None, _saved_steps(path, None)
  try:
    with exclusive(path, create=False), _manager(path, False, None, prefix) as manager:
      step = max(steps, default=None)
      if step is None:
        raise GSIError(f"{path} holds no complete bases checkpoint; calibrate again")
      arrays, meta = _restore(manager, step, path)
  except GSIError:
    raise
  except Exception as e:
    raise GSIError(f"bases checkpoint {path} is damaged ({type(e).__name__}); "
                   "delete it and calibrate again") from None
  if meta.get("format_version") != FORMAT_VERSION:
    raise GSIError(f"{path}: bases format {meta.get('format_version')} is not "
                   f"{FORMAT_VERSION}; calibrate again")
  for field, kind in REQUIRED_META.items():
    if not isinstance(meta.get(field), kind) or isinstance(meta.get(field), bool):
      raise GSIError(f"{path}: the bases' metadata has no {kind.__name__} {field!r} (another "
                     f"version of gsi_jax wrote it, got {meta.get(field)!r}); calibrate again")
  try:
    bases = Bases(arrays["vectors"], arrays["eigenvalues"], arrays["trace"], meta)
  except (KeyError, TypeError):
    raise GSIError(f"{path}: bases checkpoint lacks its arrays; damaged") from None
  _check_values(path, bases)
  if fingerprint is not None and meta.get("fingerprint") != fingerprint:
    raise GSIError(f"{path} holds bases of model {meta.get('model')!r} "
                   f"(fingerprint {meta.get('fingerprint')}), not of this model ({fingerprint})")
  if k is not None and k > bases.k_max:
    raise GSIError(f"{path} holds bases up to k={bases.k_max}; k={k} needs a new calibration")
  return bases
