"""Orbax checkpoints of calibrated bases.

Each save is a new step of an Orbax CheckpointManager: Orbax writes into a
temporary folder and renames it only once complete, so an interrupted or
failed save never touches the steps already there, and restore reads the
newest complete one.
"""

from __future__ import annotations

import os

import jax
import numpy as np

from gsi_jax.errors import GSIError
from gsi_jax.gsi.bases import FORMAT_VERSION, Bases


def _manager(path: str, create: bool):
  import orbax.checkpoint as ocp
  options = ocp.CheckpointManagerOptions(max_to_keep=2, create=create,
                                         enable_async_checkpointing=False)
  return ocp.CheckpointManager(os.path.abspath(path), options=options,
                               item_names=("arrays", "meta"))


def save_bases(path: str, bases: Bases) -> int:
  """Save as the next step under `path`; returns the step."""
  import orbax.checkpoint as ocp
  arrays = jax.tree.map(lambda a: np.asarray(a), bases.arrays())
  with _manager(path, create=True) as manager:
    step = (manager.latest_step() or 0) + 1
    manager.save(step, args=ocp.args.Composite(arrays=ocp.args.StandardSave(arrays),
                                               meta=ocp.args.JsonSave(bases.meta)))
    manager.wait_until_finished()
  return step


def load_bases(path: str, fingerprint: str | None = None, k: int | None = None) -> Bases:
  """Restore the newest complete step; check model identity and k when given."""
  import orbax.checkpoint as ocp
  if not os.path.isdir(path):
    raise GSIError(f"no bases checkpoint at {path}; calibrate first")
  with _manager(path, create=False) as manager:
    step = manager.latest_step()
    if step is None:
      raise GSIError(f"{path} holds no complete bases checkpoint; calibrate again")
    try:
      restored = manager.restore(step, args=ocp.args.Composite(
          arrays=ocp.args.StandardRestore(), meta=ocp.args.JsonRestore()))
    except Exception as e:
      raise GSIError(f"bases checkpoint {path} (step {step}) is damaged "
                     f"({type(e).__name__}); delete it and calibrate again") from None
  meta = dict(restored["meta"])
  if meta.get("format_version") != FORMAT_VERSION:
    raise GSIError(f"{path}: bases format {meta.get('format_version')} is not "
                   f"{FORMAT_VERSION}; calibrate again")
  arrays = jax.tree.map(np.asarray, restored["arrays"])
  bases = Bases(arrays["vectors"], arrays["eigenvalues"], arrays["trace"], meta)
  if fingerprint is not None and meta.get("fingerprint") != fingerprint:
    raise GSIError(f"{path} holds bases of model {meta.get('model')!r} "
                   f"(fingerprint {meta.get('fingerprint')}), not of this model ({fingerprint})")
  if k is not None and k > bases.k_max:
    raise GSIError(f"{path} holds bases up to k={bases.k_max}; k={k} needs a new calibration")
  for layer, site in bases.sites():
    V = bases.vectors[layer][site]
    if V.ndim != 2 or bases.eigenvalues[layer][site].shape != (V.shape[1],):
      raise GSIError(f"{path}: arrays of {layer}/{site} have inconsistent shapes; damaged")
  return bases
