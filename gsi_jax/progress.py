"""Progress lines for long work: a step's start and its seconds when done, and a loop's
count and estimate every EVERY_S seconds.  They are log lines (absl's INFO), one per update,
so that a supervised process's log file reads as a terminal does; no carriage-return bar.
Where the program shows no INFO lines (a plain script, a notebook: logging never
configured) they go to stderr instead, so a long library call is never silent."""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time

EVERY_S = 10.0  # a loop says where it is at most this often


def say(fmt: str, *args) -> None:
  """One progress line: an INFO log line where INFO lines are shown, else on stderr."""
  if logging.getLogger().isEnabledFor(logging.INFO):
    logging.info(fmt, *args)
  else:
    print(fmt % args, file=sys.stderr, flush=True)


@contextlib.contextmanager
def step(what: str):
  """"what ..." now, and "what: done in N s" when the block ends; compiling included."""
  say("%s ...", what)
  start = time.perf_counter()
  yield
  say("%s: done in %.1f s", what, time.perf_counter() - start)


class Counter:
  """A loop of `total` items that says "what: i/total (p%), N s" every EVERY_S seconds,
  and its total time at the end if it ran longer than that; silent when quick.  A first
  item still running after EVERY_S (compiling, mostly) is said once, from a timer thread,
  so that no long first step is silent."""

  def __init__(self, what: str, total: int, every_s: float = EVERY_S):
    self.what, self.total, self.every_s, self.done = what, total, every_s, 0
    self.start = self.said = time.perf_counter()
    self._first = threading.Timer(every_s, self._still_on_first)
    self._first.daemon = True
    self._first.start()

  def _still_on_first(self) -> None:
    if self.done == 0:
      say("%s: 0/%d, the first still running after %.0f s (compiling, the first time a shape "
          "is seen)", self.what, self.total, time.perf_counter() - self.start)

  def close(self) -> None:
    """Cancel the first item's timer (a loop that ends early, or raised)."""
    self._first.cancel()

  def advance(self, n: int = 1) -> None:
    self.done += n
    self._first.cancel()
    now = time.perf_counter()
    if self.done >= self.total:
      if now - self.start >= self.every_s:
        say("%s: %d/%d, done in %.1f s", self.what, self.done, self.total, now - self.start)
    elif now - self.said >= self.every_s:
      self.said = now
      elapsed = now - self.start
      say("%s: %d/%d (%.0f%%), %.0f s, about %.0f s left", self.what, self.done, self.total,
          100 * self.done / self.total, elapsed,
          elapsed / self.done * (self.total - self.done))
