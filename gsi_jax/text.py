"""Calibration and held-out evaluation text, as windows of token ids.

The default source is CPython's own `pydoc_data.topics` (English technical
prose present in every Python install).  Its topics are split by parity of
their sorted index into a calibration half and a disjoint evaluation half,
so no evaluated token was seen by calibration.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from gsi_jax.errors import GSIError

PYDOC_CALIB = "pydoc:calibration"
PYDOC_EVAL = "pydoc:evaluation"
HF_PREFIX = "hf:"  # hf:wikitext/wikitext-2-raw-v1/test, when online


@dataclasses.dataclass(frozen=True)
class TokenWindows:
  ids: np.ndarray  # (n_windows, seq_len) int32
  source: str

  @property
  def n_tokens(self) -> int:
    return int(self.ids.size)

  def describe(self) -> dict:
    return {"source": self.source, "tokens": self.n_tokens, "windows": int(self.ids.shape[0]),
            "seq_len": int(self.ids.shape[1])}


def load_text(source: str) -> str:
  """pydoc:calibration, pydoc:evaluation, a UTF-8 file path, or hf:dataset/config/split."""
  if source in (PYDOC_CALIB, PYDOC_EVAL):
    from pydoc_data import topics
    keys = sorted(topics.topics)
    part = 0 if source == PYDOC_CALIB else 1
    return "\n\n".join(topics.topics[k] for k in keys[part::2])
  if source.startswith(HF_PREFIX):
    return _hf_dataset_text(source[len(HF_PREFIX):])
  if not os.path.isfile(source):
    raise GSIError(f"text file not found: {source}")
  try:
    with open(source, encoding="utf-8") as f:
      text = f.read()
  except UnicodeDecodeError:
    raise GSIError(f"{source} is not UTF-8 text") from None
  if not text.strip():
    raise GSIError(f"{source} is empty; calibration and evaluation need text")
  return text


def _hf_dataset_text(spec: str) -> str:
  parts = spec.split("/")
  if len(parts) != 3:
    raise GSIError(f"hf text source must be hf:dataset/config/split, got hf:{spec}")
  try:
    import datasets
  except ImportError:
    raise GSIError("hf: text sources need the `datasets` package (pip install datasets)") from None
  try:
    rows = datasets.load_dataset(parts[0], parts[1], split=parts[2])
  except Exception as e:
    raise GSIError(f"cannot load dataset hf:{spec} ({type(e).__name__}); "
                   "offline? use --calib_text_file/--eval_text_file") from None
  return "\n".join(rows["text"])


def windows(model, source: str, seq_len: int, max_tokens: int | None = None) -> TokenWindows:
  """Tokenize `source` and cut it into non-overlapping windows of seq_len."""
  if seq_len < 2:
    raise GSIError(f"seq_len must be >= 2, got {seq_len}")
  text = load_text(source)
  if not text.strip():
    raise GSIError(f"text source {source} is empty")
  ids = model.encode(text)
  if max_tokens is not None:
    ids = ids[:max_tokens]
  n = len(ids) // seq_len
  if n == 0:
    raise GSIError(f"text source {source} has {len(ids)} tokens, fewer than one window of "
                   f"{seq_len}; give more text or a smaller seq_len")
  return TokenWindows(ids[:n * seq_len].reshape(n, seq_len).astype(np.int32), source)
