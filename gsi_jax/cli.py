"""absl entry points: flags -> one library call; bad input exits 2 with one line."""

from __future__ import annotations

import logging
import sys

from absl import app, flags

from gsi_jax.errors import GSIError


def _parse(argv):
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)


def run(main) -> None:
  """app.run with project errors turned into `error: ...` and exit status 2."""
  def wrapped(argv):
    if len(argv) > 1:
      print(f"error: unexpected arguments {argv[1:]}; all options are --flags", file=sys.stderr)
      sys.exit(2)
    for noisy in ("jax", "orbax", "absl", "httpx"):
      logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
      main(argv)
    except GSIError as e:
      print(f"error: {e}", file=sys.stderr)
      sys.exit(2)
  app.run(wrapped, flags_parser=_parse)
