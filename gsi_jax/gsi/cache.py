"""Reuse calibrated bases across runs: one Orbax checkpoint per (model, text, settings)."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import time

from gsi_jax.errors import GSIError
from gsi_jax.gsi.bases import Bases, fingerprint
from gsi_jax.gsi.calibration import calibrate
from gsi_jax.gsi.checkpoint import check_writable, load_bases, save_bases
from gsi_jax.text import TokenWindows

DEFAULT_BASES_DIR = os.path.join(os.path.expanduser("~"), ".cache", "gsi_jax", "bases")


def bases_path(bases_dir: str, model_fingerprint: str, windows: TokenWindows, method: str) -> str:
  text_id = hashlib.sha256(windows.ids.tobytes()).hexdigest()[:12]
  return os.path.join(bases_dir, f"{model_fingerprint}-{text_id}-{method}")


def cached_bases(model, params, windows: TokenWindows, k_max: int, method: str = "eigh",
                 bases_dir: str | None = DEFAULT_BASES_DIR) -> Bases:
  """Restore bases calibrated on exactly these windows, or calibrate and save them."""
  fp = fingerprint(params)
  path = bases_path(bases_dir, fp, windows, method) if bases_dir else None
  if path:
    check_writable(path)  # before the calibration, not after it
  if path and os.path.isdir(path):
    try:
      bases = load_bases(path, fingerprint=fp)
      if bases.k_max >= k_max:
        logging.info("bases restored from %s (k_max=%d)", path, bases.k_max)
        return bases
    except GSIError as e:
      logging.warning("ignoring cached bases: %s", e)
  t0 = time.time()
  logging.info("calibrating %s on %d tokens of %s (k_max=%d, %s)", model.config.name,
               windows.n_tokens, windows.source, k_max, method)
  progress = path + "-layers" if path else None  # resumes an interrupted calibration
  bases = calibrate(model, params, windows.ids, k_max, method=method, source=windows.source,
                    resume_dir=progress)
  logging.info("calibration took %.1f s", time.time() - t0)
  if path:
    save_bases(path, bases)
    shutil.rmtree(progress, ignore_errors=True)
    logging.info("bases saved to %s", path)
  return bases
