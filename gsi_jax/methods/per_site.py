"""Allocations per site, one mechanism for every method with a per-site knob: start from
the uniform allocation, find other values (learned with optax under a byte budget, or
searched by an evolutionary algorithm), and keep the uniform allocation wherever the found
one scores a higher NLL on the calibration windows that set its budget (fallback).

The learned methods are registered in `learned.py`; the searched one (rsparse_searched)
beside its recipe in `rsparse.py`."""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any, Callable

from gsi_jax.peers import allocation
from gsi_jax.methods.registry import Point
from gsi_jax.models import params as P


@dataclasses.dataclass(frozen=True)
class Space:
  """What an allocation varies: init ({knob: {layer: {site: value}}}, the uniform
  allocation), rebuild(values) -> the tree, the tree learning differentiates through,
  the gate, and bytes(params) -> scores -> bytes per token."""
  init: dict
  rebuild: Callable[[dict], Any]
  params: Any
  gate: Any
  bytes: Callable[[Any], Callable[[dict], float]]


def with_fallback(ctx, name, knob, space: Space, found: dict, nll_uniform: float | None,
                  label: str, nll_found: float | None = None) -> tuple[dict, dict]:
  """(chosen values, record fields): found unless its calibration NLL is above the
  uniform allocation's, then the uniform one.  NLLs not given are scored here."""
  nll = ctx.calib_nll(space.rebuild(found), space.gate) if nll_found is None else nll_found
  if nll_uniform is None:
    nll_uniform = ctx.calib_nll(space.rebuild(space.init), space.gate)
  fallback = nll > nll_uniform
  if fallback:
    logging.info("%s %s: %s calibration NLL %.4f > uniform %.4f, kept uniform", name, knob,
                 label, nll, nll_uniform)
  return (space.init if fallback else found), {
      "fallback": bool(fallback), f"calib_nll_{label}": nll, "calib_nll_uniform": nll_uniform}


def learned_point(ctx, name: str, knob: str, space: Space) -> Point:
  """Learn the space's knobs per site at the uniform allocation's bytes on calibration
  text, scale the knob (not RANK) back to those bytes, and keep it unless it falls back."""
  key = next(k for k in space.init if k != allocation.RANK)
  scored = {}

  def calib(values) -> tuple[float, float]:
    """(NLL, bytes fraction) on the calibration windows, scored once per allocation: the
    budget and the fallback read the trees the bisection and the uniform start scored."""
    at = json.dumps(values, sort_keys=True)
    if at not in scored:
      tree = space.rebuild(values)
      scores = ctx.calib_scores(tree, space.gate)
      scored[at] = (float(scores["nll"].mean()), space.bytes(tree)(scores) / ctx.dense_bytes)
    return scored[at]

  budget = calib(space.init)[1]
  learned, history = allocation.learn_allocation(
      ctx.model, space.params, space.init, ctx.calib_ids, allocation.AllocationConfig(
          budget=budget, lam=ctx.grid["learned_lambda"], steps=ctx.grid["learned_steps"]),
      dense_logp_cache=ctx.shared("dense_logp", dict))
  matched = {**learned, key: allocation.scale_to_budget(
      learned[key], lambda v: calib({**learned, key: v})[1], budget)}
  chosen, fields = with_fallback(ctx, name, knob, space, matched, calib(space.init)[0],
                                 "learned", nll_found=calib(matched)[0])
  final = space.rebuild(chosen)
  ranks = {} if allocation.RANK not in chosen else {"ranks": {
      layer: {site: int(final[layer][site][P.V].shape[1]) for site in sites}
      for layer, sites in chosen[allocation.RANK].items()}}
  return Point(knob, final, space.gate, shares=True, extra={
      "allocation": chosen[key], **ranks, "calib_bytes_fraction_uniform": budget,
      "learning": history, **fields})
