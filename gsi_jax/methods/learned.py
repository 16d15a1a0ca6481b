"""The learned allocations (`per_site.learned_point`): per-site thresholds or ε learned with
optax under a byte budget, beside their uniform methods (sparsity_learned, gsi_learned,
residual_learned), and the sparse residual's rank learned with its threshold
(residual_rank_learned).  They run with --learned."""

from __future__ import annotations

import gsi_jax
from gsi_jax import peers
from gsi_jax.peers import allocation
from gsi_jax.errors import GSIError
from gsi_jax.methods.common import (GATED, KEPT_ROWS, by_tree, gated_bytes, in_unit,
                                    sparse_bytes, thresholds_ok)
from gsi_jax.methods.per_site import Space, learned_point
from gsi_jax.methods.registry import Knob, Method, register
from gsi_jax.methods.residual import RESIDUAL_PATH, check_ranks, residual_thresholds
from gsi_jax.models import params as P
from gsi_jax.ops import make_gate

LEARNED_SPARSITY = Knob("learned_sparsity", float, ("0.4", "0.5", "0.6"),
                        "Uniform sparsity targets whose bytes the learned thresholds match.",
                        check=in_unit("learned_sparsity", closed_low=False))
def _learning_ok(**setting):
  """AllocationConfig's own checks of one setting (it raises on a bad one)."""
  allocation.AllocationConfig(budget=1.0, **setting)


def _learned_eps_ok(values):
  thresholds_ok("learned_eps")(values)
  if any(e == 0 for e in values):
    return "--learned_eps must be > 0: a zero gate has no allocation to learn"
  return None


LEARNED_EPS = Knob("learned_eps", float, ("0.5",), "Uniform eps (at the largest --k) whose "
                   "bytes the learned eps match.", check=_learned_eps_ok)
LEARNED_LAMBDA = Knob("learned_lambda", float, 100.0, "Penalty on leaving the byte budget "
                      "while learning (KL nats per squared bytes fraction).",
                      check=lambda v: _learning_ok(lam=v),
                      many=False)
LEARNED_STEPS = Knob("learned_steps", int, 24, "Adam steps per learned allocation.",
                     check=lambda v: _learning_ok(steps=v),
                     many=False)
LEARNED_RESIDUAL_K = Knob("learned_residual_k", int, 32, "Rank of the learned sparse residual "
                          "(where residual_rank_learned's ranks start).",
                          check=lambda v: None if v >= 1 else
                          f"--learned_residual_k must be positive, got {v}", many=False)
LEARNED_RANK_MAX = Knob("learned_rank_max", int, 64, "Largest rank residual_rank_learned may "
                        "give a site.", many=False)
LEARNING = (LEARNED_LAMBDA, LEARNED_STEPS)


def learned(name: str, uniform: str, doc: str, knobs: tuple, targets: str, space, label,
            bytes_formula, fast_path, check=None) -> Method:
  """Register the learned allocation of a uniform method: at each value of the knob
  `targets` (the uniform allocation whose bytes it holds), space(ctx, target) -> Space,
  learned by `per_site.learned_point` and recorded under label(ctx, target)."""
  def points(ctx):
    for target in ctx.grid[targets]:
      yield learned_point(ctx, name, label(ctx, target), space(ctx, target))
  return register(Method(name, doc, (*knobs, *LEARNING), points, by_tree(bytes_formula),
                         fast_path, uniform=uniform, learned=True, check=check))


def _sparsity_space(ctx, target):
  base = ctx.base
  return Space({P.THRESHOLD: allocation.floored(ctx.thresholds(target))},
               lambda v: peers.apply_sparsity(base, v[P.THRESHOLD]), base, None, sparse_bytes)


def _gsi_space(ctx, eps):
  gsi_params = ctx.gsi(max(ctx.experiment.k))
  gate = make_gate(0.0, impl=ctx.experiment.impl)  # every site's own ε overrides it
  return Space({P.EPS: P.per_site(ctx.base, eps)},
               lambda v: P.with_site_values(gsi_params, P.EPS, v[P.EPS]), gsi_params, gate,
               gated_bytes)


def _residual_init(ctx, target):
  return allocation.floored(residual_thresholds(ctx, ctx.grid["learned_residual_k"], target))


def _residual_space(ctx, target):
  gsi_params = ctx.gsi(ctx.grid["learned_residual_k"])
  return Space({P.RESIDUAL_THRESHOLD: _residual_init(ctx, target)},
               lambda v: gsi_jax.apply_residual_sparsity(gsi_params, v[P.RESIDUAL_THRESHOLD]),
               gsi_params, None, sparse_bytes)


def _residual_rank_space(ctx, target):
  """The residual's threshold and its rank per site, ranks from --learned_residual_k on
  nested bases up to --learned_rank_max."""
  wide = ctx.gsi(ctx.grid["learned_rank_max"])
  rebuild = lambda v: gsi_jax.apply_residual_sparsity(
      gsi_jax.truncate_ranks(wide, allocation.kept_ranks(wide, v[allocation.RANK])),
      v[P.RESIDUAL_THRESHOLD])
  init = {P.RESIDUAL_THRESHOLD: _residual_init(ctx, target),
          allocation.RANK: P.per_site(ctx.base, float(ctx.grid["learned_residual_k"]))}
  return Space(init, rebuild, wide, None, sparse_bytes)


def _check_residual_learned(grid, experiment):
  check_ranks((grid["learned_residual_k"],), experiment)


def _check_rank_learned(grid, experiment):
  if not grid["learned_residual_k"] <= grid["learned_rank_max"]:
    raise GSIError(f"--learned_rank_max ({grid['learned_rank_max']}) must be at least "
                   f"--learned_residual_k ({grid['learned_residual_k']}), where ranks start")
  check_ranks((grid["learned_rank_max"],), experiment)


learned("sparsity_learned", "sparsity", "Magnitude sparsity with per-site thresholds learned "
        "under a byte budget.", (LEARNED_SPARSITY,), "learned_sparsity", _sparsity_space,
        lambda ctx, sp: f"target={sp}", sparse_bytes, KEPT_ROWS)
learned("gsi_learned", "gsi", "GSI with ε learned per site under a byte budget, at the "
        "largest --k.", (LEARNED_EPS,), "learned_eps", _gsi_space,
        lambda ctx, eps: f"k={max(ctx.experiment.k)},eps={eps}", gated_bytes, GATED)
learned("residual_learned", "residual", "The sparse residual with per-site thresholds "
        "learned under a byte budget.", (LEARNED_SPARSITY, LEARNED_RESIDUAL_K),
        "learned_sparsity", _residual_space,
        lambda ctx, sp: f"k={ctx.grid['learned_residual_k']},target={sp}", sparse_bytes,
        RESIDUAL_PATH, check=_check_residual_learned)
learned("residual_rank_learned", "residual", "The sparse residual with its rank and threshold "
        "learned per site (nested bases up to --learned_rank_max).",
        (LEARNED_SPARSITY, LEARNED_RESIDUAL_K, LEARNED_RANK_MAX), "learned_sparsity",
        _residual_rank_space, lambda ctx, sp: f"k={ctx.grid['learned_residual_k']}.."
        f"{ctx.grid['learned_rank_max']},target={sp}", sparse_bytes, RESIDUAL_PATH,
        check=_check_rank_learned)
