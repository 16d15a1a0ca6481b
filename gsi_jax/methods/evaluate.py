"""How a method's point becomes a record: scored on held-out text, its greedy generations
compared with dense, its bytes per token counted, and its batch-1 decode timed in
alternation with dense decode."""

from __future__ import annotations

import logging
import math
import time

import jax
import numpy as np

from gsi_jax import metrics, peers, progress
from gsi_jax.runtime import distributed, sharding
from gsi_jax.errors import GSIError, NonFiniteResult
from gsi_jax.measure.benchmarking import (INTERVAL_ROUNDS, decode_beside, decode_beside_each,
                                  decode_tokens_per_s, ratio_text)
from gsi_jax.methods.front import KEPT_ROWS_DENSE, XLA_DENSE
from gsi_jax.metrics import bytes as mbytes
from gsi_jax.models import params as P
from gsi_jax.ops import make_gate

UNTIMED = "untimed"  # a record's verdict with --speed_repeats=0


class NonFinitePoint(GSIError):
  """A point scored or counted as NaN or inf: the sweep ends at it, keeping what it finished."""


def batch1(gate):
  """The gate a record decodes with: the same, through the batch-1 fast paths."""
  return make_gate(0.0, batch1_switch=True) if gate is None \
      else gate.replace(batch1_switch=True)


def every_row_kept(params):
  """(tree, gate): dense's bytes through the kept-rows kernel, sparsity keeping every row."""
  return peers.apply_sparsity(params, P.per_site(params, 0.0)), make_gate(0.0, batch1_switch=True)


def best_dense(model, params, ids, n: int, rounds: int):
  """(name, (params, gate), choice): the faster dense decode of n tokens, XLA's dot or the
  kept-rows kernel keeping every row (KEPT_ROWS_DENSE where its interval over XLA's lies
  above 1, in max(rounds, INTERVAL_ROUNDS) paired rounds: a 95% interval), to time methods
  beside; `choice` is that timing (`decode_beside`'s fields, and kept_rows_over_xla).  On CPU the kernel is
  faster, and a method timed beside XLA would count the kernel's own speed as skipping's."""
  kept_all, gate = every_row_kept(params)
  with progress.step("timing dense decode through XLA's dot and the kept-rows kernel"):
    pair = decode_beside(model, ids, n, max(rounds, INTERVAL_ROUNDS), kept_all, gate, params)
  choice = {"kept_rows_over_xla": pair["measured_speedup"], **pair}
  name, tree = (KEPT_ROWS_DENSE, (kept_all, gate)) if pair["verdict"] == "faster" \
      else (XLA_DENSE, (params, None))
  logging.info("every row kept through the kept-rows kernel: %s XLA's dense; timing beside %s",
               ratio_text(pair["measured_speedup"], pair["speedup_low"], pair["speedup_high"]),
               name)
  return name, tree, choice


def release_executables():
  """Each parameter tree's structure compiles its own score and decode programs; a sweep
  over dozens of them failed in XLA's compiler ("Cannot allocate memory") unless they
  are dropped as it goes."""
  jax.clear_caches()


class Evaluator:
  """Scores a parameter tree on the held-out text and greedy generations, against
  dense, and times its batch-1 decode in alternation with dense decode.

  Generations run through the fast paths (`batch1`), which decode the same tokens
  as the masked evaluation paths (tests/test_fast_paths.py); the timed decode of
  the first prompt then reuses their compiled program.  `setup` is an
  `experiment.Setup`: the model, its config, calibration and held-out windows."""

  def __init__(self, setup, speed_repeats: int):
    self.s, self.speed_repeats, self.model = setup, speed_repeats, setup.model
    # The tree every method rewrites.  On several processes the rewrites read whole
    # weights on the host (each process the same), and every tree they write is placed
    # back on the mesh before it is scored or decoded (`placed`).
    self.mesh = sharding.make_mesh() if jax.device_count() > 1 else None
    self.base = (jax.tree.map(distributed.host_copy, setup.model.params)
                 if jax.process_count() > 1 else setup.model.params)
    with progress.step("dense: scoring the held-out text"):
      self.dense = metrics.score(setup.model, setup.model.params, setup.held_out.ids)
    self.dense_bytes = mbytes.dense_bytes(setup.model.params)
    with progress.step(f"dense: {len(setup.config.prompts)} greedy generations"):
      self.dense_gen = {p: self._generate(setup.model.params, p) for p in setup.config.prompts}
    self.dense_tokens_per_s = self.tokens_per_s(setup.model.params, None)[0]
    if self.dense_tokens_per_s:
      logging.info("dense decode: %.1f tokens/s", self.dense_tokens_per_s)
    # The dense decode every record is timed beside (`best_dense`): XLA's dot, or the
    # kept-rows kernel keeping every row where that decodes faster (its interval above 1;
    # on CPU it does), so that a record's speed is what its skipping adds and not the
    # kernel's own.  On a mesh, XLA's.
    self.best_dense, self.best_dense_choice = XLA_DENSE, None
    self.dense_tree = (setup.model.params, None)
    if self.speed_repeats and self.mesh is None:
      self.best_dense, self.dense_tree, self.best_dense_choice = best_dense(
          self.model, setup.model.params, self._timed_ids(), self.s.config.max_new_tokens,
          self.speed_repeats)

  def placed(self, params):
    """params on the mesh, as the model's own are (unchanged on one device)."""
    return params if self.mesh is None else sharding.shard_params(params, self.mesh)

  def _generate(self, params, prompt, gate=None, until_differs=None):
    ids = self.model.encode(prompt)[None]
    if until_differs is not None:
      until_differs = until_differs[:, ids.shape[1]:]
    return distributed.host_copy(self.model.generate(
        self.placed(params), ids, self.s.config.max_new_tokens, gate,
        until_differs=until_differs))

  def _timed_ids(self):
    return self.model.encode(self.s.config.prompts[0])[None]

  def tokens_per_s(self, params, gate):
    """(tokens/s, compile s) of batch-1 greedy decode; (None, None) without timing."""
    if not self.speed_repeats:
      return None, None
    return decode_tokens_per_s(self.model, self.placed(params), self._timed_ids(),
                               self.s.config.max_new_tokens, self.speed_repeats, gate)

  def time_beside_dense(self, records, trees) -> None:
    """Each record gains its tree's batch-1 decode timed in alternating rounds with dense
    decode (a drift of the machine's speed then cancels in their per-round ratios): the
    fields of `benchmarking.decode_beside_each`, for one method's trees ((params, gate)
    each) at once, so that one dense decode a round serves them all.  Its phase_s
    "timed_decode" is its share of those rounds.  Without timing, each record's verdict
    says "untimed"."""
    if not self.speed_repeats:
      for rec in records:
        rec["verdict"] = UNTIMED
      return
    if not records:
      return
    start = time.perf_counter()
    timed = decode_beside_each(self.model, self._timed_ids(), self.s.config.max_new_tokens,
                               self.speed_repeats,
                               [(self.placed(p), batch1(g)) for p, g in trees],
                               *self.dense_tree)
    share = (time.perf_counter() - start) / len(records)
    for rec, t in zip(records, timed):
      rec.update(t, beside=self.best_dense)
      rec["phase_s"]["timed_decode"] = share
      logging.info("%s %s: %.1f tokens/s (dense beside it %.1f), %s", rec["method"],
                   rec["knob"], t["tokens_per_s"], t["dense_tokens_per_s"],
                   ratio_text(t["measured_speedup"], t["speedup_low"], t["speedup_high"]))

  def calib_scores(self, params, gate, windows: int = 8) -> dict:
    """`metrics.score` on the first calibration windows, where budgets are set (never on
    held-out text)."""
    return metrics.score(self.model, self.placed(params), self.s.calib.ids[:windows], gate)

  def calib_nll(self, params, gate) -> float:
    """Mean next-token NLL on the first calibration windows."""
    return float(self.calib_scores(params, gate)["nll"].mean())

  def record(self, method, knob, params, gate, bytes_of, shares=False, bytes_fn_name="",
             **extra):
    """bytes_of(scores) -> weight bytes per token (some methods' bytes depend on the text);
    bytes_fn_name names the method's own function for an error.
    `phase_s`: the seconds each phase took (scoring, generations; compiling included),
    which is where a sweep's time goes; `time_beside_dense` adds the timed decode."""
    start = time.perf_counter()
    params = self.placed(params)  # once: placing a placed tree again moves nothing
    scoring = ("gsi_jax.metrics.score on the point's tree (check its weights, thresholds or "
               "bases for NaN or inf)")

    def nonfinite(what, value, source):
      return NonFinitePoint(f"method {method}, point {knob}: its held-out {what} is {value}, "
                            f"not a finite number, so the run ends with no record for it; "
                            f"it came from {source}")
    try:
      scores = metrics.score(self.model, params, self.s.held_out.ids, gate)
    except NonFiniteResult:  # scoring refuses NaN log-probabilities: a NaN perplexity
      raise nonfinite("perplexity ratio", math.nan, scoring) from None
    q = metrics.quality(self.dense, scores)
    bytes_per_token = bytes_of(scores)
    for what, value, source in (
        ("perplexity ratio", q["ppl_ratio"], scoring),
        ("top-1 agreement", q["top1_agreement"], scoring),
        ("bytes per token", bytes_per_token, f"the method's bytes function, {bytes_fn_name}")):
      if not math.isfinite(value):  # a NaN would sort anywhere on the fronts
        raise nonfinite(what, value, source)
    scored = time.perf_counter()
    # Each generation stops at its first token that is not dense's: whether the two are
    # the same is all a record keeps.
    same = sum(np.array_equal(g, self._generate(params, p, batch1(gate), until_differs=g))
               for p, g in self.dense_gen.items())
    rec = {"method": method, "knob": knob, "bytes_per_token": bytes_per_token,
           "bytes_fraction": bytes_per_token / self.dense_bytes, "ppl_ratio": q["ppl_ratio"],
           "top1_agreement": q["top1_agreement"], "fast_share": q["fast_share"],
           "head_fast_share": scores["head_fast_share"],
           "generations_identical": int(same), "prompts": len(self.dense_gen),
           "phase_s": {"score": scored - start, "generations": time.perf_counter() - scored}}
    if shares:
      rec.update(fast_share_by_layer=scores["fast_share_by_layer"],
                 kept_share_by_layer=scores["kept_share_by_layer"])
    rec.update(extra)
    logging.info("%s %s: bytes %.3f, ppl ratio %.4f", method, knob, rec["bytes_fraction"],
                 q["ppl_ratio"])
    return rec
