"""How a method's point becomes a record: scored on held-out text, its greedy generations
compared with dense, its bytes per token counted, and its batch-1 decode timed in
alternation with dense decode."""

from __future__ import annotations

import logging
import time

import jax
import numpy as np

from gsi_jax import distributed, metrics, sharding
from gsi_jax.benchmarking import decode_beside, decode_tokens_per_s
from gsi_jax.metrics import bytes as mbytes
from gsi_jax.ops import make_gate


def batch1(gate):
  """The gate a record decodes with: the same, through the batch-1 fast paths."""
  return make_gate(0.0, batch1_switch=True) if gate is None \
      else gate.replace(batch1_switch=True)


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
    self.dense = metrics.score(setup.model, setup.model.params, setup.held_out.ids)
    self.dense_bytes = mbytes.dense_bytes(setup.model.params)
    self.dense_gen = {p: self._generate(setup.model.params, p) for p in setup.config.prompts}
    self.dense_tokens_per_s = self.tokens_per_s(setup.model.params, None)[0]
    if self.dense_tokens_per_s:
      logging.info("dense decode: %.1f tokens/s", self.dense_tokens_per_s)

  def placed(self, params):
    """params on the mesh, as the model's own are (unchanged on one device)."""
    return params if self.mesh is None else sharding.shard_params(params, self.mesh)

  def _generate(self, params, prompt, gate=None):
    return distributed.host_copy(self.model.generate(
        self.placed(params), self.model.encode(prompt)[None], self.s.config.max_new_tokens,
        gate))

  def _timed_ids(self):
    return self.model.encode(self.s.config.prompts[0])[None]

  def tokens_per_s(self, params, gate):
    """(tokens/s, compile s) of batch-1 greedy decode; (None, None) without timing."""
    if not self.speed_repeats:
      return None, None
    return decode_tokens_per_s(self.model, self.placed(params), self._timed_ids(),
                               self.s.config.max_new_tokens, self.speed_repeats, gate)

  def beside_dense(self, params, gate) -> dict:
    """params' decode timed in paired rounds with dense decode (a drift of the machine's
    speed then cancels in their per-round ratios): `benchmarking.decode_beside`'s
    fields; {} without timing."""
    if not self.speed_repeats:
      return {}
    return decode_beside(self.model, self._timed_ids(), self.s.config.max_new_tokens,
                         self.speed_repeats, self.placed(params), gate, self.model.params)

  def calib_nll(self, params, gate, windows: int = 8) -> float:
    """Mean next-token NLL on the first calibration windows (where budgets are set)."""
    return float(metrics.score(self.model, self.placed(params), self.s.calib.ids[:windows],
                               gate)["nll"].mean())

  def calib_bytes_fraction(self, params, gate, bytes_of, windows: int = 8) -> float:
    """Bytes per token / dense on the first calibration windows (the learned budgets'
    scale is set here, never on held-out text)."""
    scores = metrics.score(self.model, self.placed(params), self.s.calib.ids[:windows], gate)
    return bytes_of(scores) / self.dense_bytes

  def record(self, method, knob, params, gate, bytes_of, shares=False, **extra):
    """bytes_of(scores) -> weight bytes per token (some methods' bytes depend on the text).
    `phase_s`: the seconds each phase took (scoring, generations, timed decode; compiling
    included), which is where a sweep's time goes."""
    start = time.perf_counter()
    params = self.placed(params)  # once: placing a placed tree again moves nothing
    scores = metrics.score(self.model, params, self.s.held_out.ids, gate)
    q = metrics.quality(self.dense, scores)
    bytes_per_token = bytes_of(scores)
    scored = time.perf_counter()
    same = sum(np.array_equal(g, self._generate(params, p, batch1(gate)))
               for p, g in self.dense_gen.items())
    generated = time.perf_counter()
    timed = self.beside_dense(params, batch1(gate))
    phase_s = {"score": scored - start, "generations": generated - scored,
               "timed_decode": time.perf_counter() - generated}
    rec = {"method": method, "knob": knob, "bytes_per_token": bytes_per_token,
           "bytes_fraction": bytes_per_token / self.dense_bytes, "ppl_ratio": q["ppl_ratio"],
           "top1_agreement": q["top1_agreement"], "fast_share": q["fast_share"],
           "head_fast_share": scores["head_fast_share"],
           "generations_identical": int(same), "prompts": len(self.dense_gen)}
    rec.update(timed, phase_s=phase_s)
    if shares:
      rec.update(fast_share_by_layer=scores["fast_share_by_layer"],
                 kept_share_by_layer=scores["kept_share_by_layer"])
    rec.update(extra)
    logging.info("%s %s: bytes %.3f, ppl ratio %.4f%s", method, knob, rec["bytes_fraction"],
                 q["ppl_ratio"], "" if not timed else
                 f", {timed['tokens_per_s']:.1f} tokens/s (dense beside it "
                 f"{timed['dense_tokens_per_s']:.1f}), {timed['measured_speedup']:.2f}x "
                 f"[{timed['speedup_low']:.2f}, {timed['speedup_high']:.2f}]")
    return rec
