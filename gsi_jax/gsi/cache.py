"""Reuse calibrated bases across runs: one Orbax checkpoint per (model, text, settings).

The cache key hashes everything the bases depend on: every byte of the weights, the
architecture, the compute dtype, the calibration windows (ids and shape) and the
solver.  A restored checkpoint must also carry that identity in its checksummed
metadata, so neither a key collision nor an edited checkpoint hands on bases
calibrated for something else.  Runs that share a cache entry take turns
(`checkpoint.exclusive`): the second restores what the first calibrated.  A cache this
run cannot write (a cluster's shared, read-only one) is read: it is refused only when it
holds no bases for this run, since only a calibration would write.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import time

from gsi_jax.runtime import distributed
from gsi_jax.errors import GSIError
from gsi_jax.gsi.bases import Bases, calibration_identity
from gsi_jax.gsi.calibration import calibrate
from gsi_jax.gsi.checkpoint import check_writable, exclusive, load_bases, save_bases
from gsi_jax.text import TokenWindows

# Where every script's --bases_dir points unless told: $GSI_JAX_BASES_DIR, else the user's
# cache folder.
DEFAULT_BASES_DIR = os.environ.get("GSI_JAX_BASES_DIR") or os.path.join(
    os.path.expanduser("~"), ".cache", "gsi_jax", "bases")


def bases_path(bases_dir: str, model_name: str, identity: dict, method: str) -> str:
  key = hashlib.sha256(json.dumps({**identity, "method": method}, sort_keys=True).encode())
  label = re.sub(r"[^A-Za-z0-9._-]+", "_", model_name)[:64] or "model"
  return os.path.join(bases_dir, f"{label}-{method}-{key.hexdigest()[:24]}")


def _restore(path: str, identity: dict, method: str, k_max: int) -> Bases | None:
  """The bases at `path` if they are this run's and reach k_max; else None (and why)."""
  try:
    bases = load_bases(path)
  except GSIError as e:
    logging.warning("ignoring cached bases: %s", e)
    return None
  other = sorted(k for k, v in {**identity, "method": method}.items() if bases.meta.get(k) != v)
  if other:
    logging.warning("ignoring cached bases at %s: calibrated with another %s", path,
                    ", ".join(other))
    return None
  if bases.k_max < k_max:
    logging.info("cached bases at %s reach k_max=%d, and this run asks for k up to %d: "
                 "calibrating again to %d (they then serve every k up to it)", path,
                 bases.k_max, k_max, k_max)
    return None
  logging.info("bases restored from %s (k_max=%d)", path, bases.k_max)
  return bases


def cached_bases(model, params, windows: TokenWindows, k_max: int, method: str = "eigh",
                 bases_dir: str | None = DEFAULT_BASES_DIR, mesh=None) -> Bases:
  """Restore bases calibrated on exactly these windows, or calibrate and save them
  (on `mesh`, as `calibrate` does, when given)."""
  if not bases_dir:
    return _calibrate(model, params, windows, k_max, method, None, mesh)
  identity = calibration_identity(model, params, windows.ids)
  path = bases_path(bases_dir, model.config.name or model.config.family, identity, method)
  try:
    check_writable(path)  # before the calibration, not after it
  except GSIError as e:
    bases = _read_only(path, identity, method, k_max)
    if bases is None:
      raise GSIError(f"{e}; it holds no bases for this run to read instead") from None
    return bases
  with exclusive(path):  # a second run waits, then restores what this one saved
    cached = os.path.isdir(path)
    bases = _restore(path, identity, method, k_max) if cached else None
    distributed.same_as_primary(int(bases is not None), "cached bases", path)
    if bases is None:
      # Resumes an interrupted calibration of these settings; one of another k_max (the one
      # setting the path does not key) keeps its own.
      progress = f"{path}-layers-k{k_max}"
      if not cached:
        logging.info("no cached bases for this model, text and method in %s: calibrating "
                     "once, layer by layer (later runs restore them; --bases_dir or "
                     "$GSI_JAX_BASES_DIR moves this cache)", bases_dir)
      bases = _calibrate(model, params, windows, k_max, method, progress, mesh)
      save_bases(path, bases)
      if distributed.is_primary():
        shutil.rmtree(progress, ignore_errors=True)
      logging.info("bases saved to %s", path)
  return bases


def _read_only(path: str, identity: dict, method: str, k_max: int) -> Bases | None:
  """This run's bases from a cache it cannot write, or None."""
  with exclusive(path, create=False):  # a writer elsewhere may be saving them
    bases = _restore(path, identity, method, k_max) if os.path.isdir(path) else None
  distributed.same_as_primary(int(bases is not None), "cached bases", path)
  if bases is not None:
    logging.info("read-only bases cache: restored from %s", path)
  return bases


def _calibrate(model, params, windows: TokenWindows, k_max: int, method: str,
               progress: str | None, mesh) -> Bases:
  t0 = time.time()
  logging.info("calibrating %s on %d tokens of %s (k_max=%d, %s)", model.config.name,
               windows.n_tokens, windows.source, k_max, method)
  bases = calibrate(model, params, windows.ids, k_max, method=method, source=windows.source,
                    seq_len=windows.ids.shape[1], resume_dir=progress, mesh=mesh)
  logging.info("calibration took %.1f s", time.time() - t0)
  return bases
