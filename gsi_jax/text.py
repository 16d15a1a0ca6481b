"""Calibration and held-out evaluation text, as windows of token ids.

The default source is CPython's own `pydoc_data.topics` (English technical
prose present in every Python install).  Its topics are split by parity of
their sorted index into a calibration half and an evaluation half.  Some
topics repeat others (`specialnames` gathers several), so the halves are
also split by content: a calibration paragraph that shares any run of
OVERLAP characters with the evaluation half is dropped from calibration.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os

import numpy as np

from gsi_jax.errors import GSIError, whole

PYDOC_CALIB = "pydoc:calibration"
PYDOC_EVAL = "pydoc:evaluation"
HF_PREFIX = "hf:"  # hf:wikitext/wikitext-2-raw-v1/test, when online
OVERLAP = 60  # characters: a shared run this long counts as the same text


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


def shared_runs(text: str, width: int = OVERLAP) -> set[str]:
  """Every run of `width` characters in text."""
  return {text[i:i + width] for i in range(len(text) - width + 1)}


@functools.cache
def pydoc_halves() -> tuple[str, str]:
  """(calibration, evaluation): alternate topics, calibration stripped of shared text."""
  from pydoc_data import topics
  keys = sorted(topics.topics)
  evaluation = "\n\n".join(topics.topics[k] for k in keys[1::2])
  runs = shared_runs(evaluation)
  paragraphs = [p for k in keys[0::2] for p in topics.topics[k].split("\n\n")]
  while True:  # dropping paragraphs makes new joins: repeat until none is shared
    calibration = "\n\n".join(paragraphs)
    shared = np.zeros(len(calibration) + 1, np.int32)
    for i in range(len(calibration) - OVERLAP + 1):
      if calibration[i:i + OVERLAP] in runs:
        shared[i] += 1
        shared[i + OVERLAP] -= 1
    covered, start, kept = np.cumsum(shared) > 0, 0, []
    for p in paragraphs:
      if not covered[start:start + len(p)].any():
        kept.append(p)
      start += len(p) + 2
    if len(kept) == len(paragraphs):
      return calibration, evaluation
    paragraphs = kept


def check_source(source: str, flag: str) -> None:
  """Fail before any compute when a text source cannot be used (named by its flag): a
  file is read and decoded here, so an empty or non-UTF-8 one is caught before the model
  loads."""
  if source in (PYDOC_CALIB, PYDOC_EVAL):
    return
  if source.startswith(HF_PREFIX):
    _hf_parts(source[len(HF_PREFIX):])
    return
  _read_file(source, flag)


def text_flag(flag: str, value: str) -> str:
  """Command-line text as a tokenizer takes it: UTF-8 (bytes that are not arrive as
  surrogates, which no tokenizer encodes) and not blank; else one error naming the flag."""
  try:
    value.encode("utf-8")
  except UnicodeEncodeError:
    raise GSIError(f"{flag} is not UTF-8 text (its bytes arrived undecodable); pass UTF-8") \
        from None
  if not value.strip():
    raise GSIError(f"{flag} is empty; give the text")
  return value


def read_json(path: str, flag: str):
  """A user's JSON file: checked as a text file (`_read_file`: UTF-8, not empty), then
  parsed; one error naming the flag and the file either way."""
  try:
    return json.loads(_read_file(path, flag))
  except json.JSONDecodeError as e:
    raise GSIError(f"{flag}: {path} is not JSON ({e})") from None


def _read_file(source: str, flag: str) -> str:
  if os.path.isdir(source):
    raise GSIError(f"{flag}: {source} is a folder; pass a UTF-8 text file")
  if not os.path.exists(source):
    if os.path.islink(source):
      raise GSIError(f"{flag}: {source} is a broken symbolic link (to {os.readlink(source)})")
    raise GSIError(f"{flag}: text file not found: {source}")
  if not os.path.isfile(source):
    raise GSIError(f"{flag}: {source} is not a regular file (a FIFO or a device); pass a "
                   "UTF-8 text file")
  try:
    with open(source, encoding="utf-8") as f:
      text = f.read()
  except UnicodeDecodeError:
    raise GSIError(f"{flag}: {source} is not UTF-8 text") from None
  except OSError as e:
    raise GSIError(f"{flag}: {source} cannot be read ({e.strerror or e})") from None
  if not text.strip():
    raise GSIError(f"{flag}: {source} is empty")
  return text


def load_text(source: str, flag: str = "text source") -> str:
  """pydoc:calibration, pydoc:evaluation, a UTF-8 file path, or hf:dataset/config/split."""
  if source in (PYDOC_CALIB, PYDOC_EVAL):
    return pydoc_halves()[0 if source == PYDOC_CALIB else 1]
  if source.startswith(HF_PREFIX):
    return _hf_dataset_text(source[len(HF_PREFIX):])
  return _read_file(source, flag)


def _hf_parts(spec: str) -> list[str]:
  parts = spec.split("/")
  if len(parts) != 3 or not all(parts):
    raise GSIError(f"hf text source must be hf:dataset/config/split, got hf:{spec}")
  return parts


def _hf_dataset_text(spec: str) -> str:
  parts = _hf_parts(spec)
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


def windows(model, source: str, seq_len: int, max_tokens: int | None = None,
            flag: str = "text source") -> TokenWindows:
  """Tokenize `source` and cut it into non-overlapping windows of seq_len."""
  seq_len = whole("seq_len", seq_len, 2)
  max_tokens = None if max_tokens is None else whole(f"{flag}: max_tokens", max_tokens)
  if max_tokens is not None and max_tokens < seq_len:
    raise GSIError(f"{flag}: {max_tokens} tokens is less than one window of {seq_len}")
  text = load_text(source, flag)
  if not text.strip():
    raise GSIError(f"{flag}: {source} is empty")
  ids = model.encode(text)
  if max_tokens is not None:
    ids = ids[:max_tokens]
  n = len(ids) // seq_len
  if n == 0:
    raise GSIError(f"{flag}: {source} has {len(ids)} tokens, fewer than one window of "
                   f"{seq_len}; give more text or a smaller --seq_len")
  return TokenWindows(ids[:n * seq_len].reshape(n, seq_len).astype(np.int32), source)
