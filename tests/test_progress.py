"""Progress lines: no step over EVERY_S is silent, a first item (compiling) included."""

import logging
import time

from gsi_jax import progress


def test_a_slow_first_item_is_said_while_it_runs(caplog):
  caplog.set_level(logging.INFO)
  counter = progress.Counter("scoring 8 tokens", 2, every_s=0.05)
  time.sleep(0.3)  # the first item compiles
  said = [r.getMessage() for r in caplog.records]
  assert any(m.startswith("scoring 8 tokens: 0/2, the first still running after") for m in said)
  counter.advance()
  counter.advance()
  assert caplog.records[-1].getMessage().startswith("scoring 8 tokens: 2/2, done in")


def test_a_quick_loop_says_nothing(caplog):
  caplog.set_level(logging.INFO)
  counter = progress.Counter("quick", 2, every_s=5)
  counter.advance(2)
  time.sleep(0.05)
  counter.close()
  assert not caplog.records


def test_a_step_says_its_start_and_its_time(caplog):
  caplog.set_level(logging.INFO)
  with progress.step("loading m"):
    pass
  said = [r.getMessage() for r in caplog.records]
  assert said[0] == "loading m ..." and said[1].startswith("loading m: done in ")
