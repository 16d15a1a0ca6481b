"""Orbax checkpoints of calibrated bases.

Each save is a new step of an Orbax CheckpointManager: Orbax writes into a
temporary folder and renames it only once complete, so an interrupted or
failed save never touches the steps already there, and restore reads the
newest complete one.  The metadata carries a SHA-256 of every array, and a
restore checks it, then that the values are finite and the vectors
orthonormal: damaged bases are never handed on.
"""

from __future__ import annotations

import hashlib
import os
import tempfile

import jax
import numpy as np

from gsi_jax.errors import GSIError
from gsi_jax.gsi.bases import FORMAT_VERSION, Bases

ORTHONORMAL_TOL = 1e-3  # float32 vectors of width up to 16384


def _manager(path: str, create: bool):
  import orbax.checkpoint as ocp
  options = ocp.CheckpointManagerOptions(max_to_keep=2, create=create,
                                         enable_async_checkpointing=False)
  return ocp.CheckpointManager(os.path.abspath(path), options=options,
                               item_names=("arrays", "meta"))


def checksums(arrays: dict) -> dict[str, str]:
  """{"field/layer/site": sha256 of the array's bytes}."""
  flat = jax.tree_util.tree_flatten_with_path(arrays)[0]
  return {"/".join(str(p.key) for p in path): hashlib.sha256(
      np.ascontiguousarray(leaf).tobytes()).hexdigest() for path, leaf in flat}


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


def save_bases(path: str, bases: Bases) -> int:
  """Save as the next step under `path`; returns the step."""
  import orbax.checkpoint as ocp
  check_writable(path)
  arrays = jax.tree.map(np.asarray, bases.arrays())
  meta = {**bases.meta, "format_version": FORMAT_VERSION, "checksums": checksums(arrays)}
  try:
    with _manager(path, create=True) as manager:
      step = (manager.latest_step() or 0) + 1
      manager.save(step, args=ocp.args.Composite(arrays=ocp.args.StandardSave(arrays),
                                                 meta=ocp.args.JsonSave(meta)))
      manager.wait_until_finished()
  except OSError as e:
    raise GSIError(f"cannot save bases to {path} ({e.strerror or e}); earlier steps there "
                   "are untouched") from None
  return step


def _check_values(path: str, bases: Bases) -> None:
  stored = bases.meta.get("checksums")
  if stored is None:
    raise GSIError(f"{path}: bases carry no checksums (an older format); calibrate again")
  if checksums(bases.arrays()) != stored:
    raise GSIError(f"{path}: bases fail their checksums; the checkpoint is damaged, "
                   "delete it and calibrate again")
  for layer, site in bases.sites():
    V = bases.vectors[layer][site]
    w = bases.eigenvalues[layer][site]
    if V.ndim != 2 or w.shape != (V.shape[1],):
      raise GSIError(f"{path}: arrays of {layer}/{site} have inconsistent shapes; damaged")
    if not (np.all(np.isfinite(V)) and np.all(np.isfinite(w))):
      raise GSIError(f"{path}: {layer}/{site} holds non-finite values; damaged")
    gram = V.astype(np.float64).T @ V.astype(np.float64)
    if np.abs(gram - np.eye(V.shape[1])).max() > ORTHONORMAL_TOL:
      raise GSIError(f"{path}: the vectors of {layer}/{site} are not orthonormal; damaged")


def load_bases(path: str, fingerprint: str | None = None, k: int | None = None) -> Bases:
  """Restore the newest complete step; check integrity, model identity and k when given."""
  import orbax.checkpoint as ocp
  if not os.path.isdir(path):
    raise GSIError(f"no bases checkpoint at {path}; calibrate first")
  try:
    with _manager(path, create=False) as manager:
      step = manager.latest_step()
      if step is None:
        raise GSIError(f"{path} holds no complete bases checkpoint; calibrate again")
      restored = manager.restore(step, args=ocp.args.Composite(
          arrays=ocp.args.StandardRestore(), meta=ocp.args.JsonRestore()))
  except GSIError:
    raise
  except Exception as e:
    raise GSIError(f"bases checkpoint {path} is damaged ({type(e).__name__}); "
                   "delete it and calibrate again") from None
  meta = dict(restored["meta"] or {})
  if meta.get("format_version") != FORMAT_VERSION:
    raise GSIError(f"{path}: bases format {meta.get('format_version')} is not "
                   f"{FORMAT_VERSION}; calibrate again")
  arrays = jax.tree.map(np.asarray, restored["arrays"])
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
