"""What several method families share: bytes as the one byte formula counts them, the
gate a point decodes with, and the knobs of checks that recur."""

from __future__ import annotations

from gsi_jax import metrics
from gsi_jax.metrics import bytes as mbytes
from gsi_jax.ops import check_threshold


def gated_bytes(params):
  """A GSI tree: V_k always, then M on fast tokens and W on slow ones, per site."""
  return lambda sc: metrics.byte_accounting(params, sc["fast_share_by_layer"],
                                            sc["rows_by_layer"])["bytes_per_token"]


def sparse_bytes(params):
  """A kept-share tree (sparsity and its kin): the rows each site kept, and the head."""
  return lambda sc: mbytes.sparsity_bytes(params, sc["kept_share_by_layer"],
                                          sc["head_fast_share"], sc["head_v_columns"])


def by_tree(formula):
  """A method's bytes_of from a formula over its point's tree alone (named after the
  formula, so that an error about its value names it)."""
  def bytes_of(point):
    return formula(point.params)
  bytes_of.__qualname__ = f"by_tree({formula.__module__}.{formula.__qualname__})"
  return bytes_of


def in_unit(name: str, closed_low: bool = True, closed_high: bool = False):
  """A check that every value lies in [0, 1) (or another of the unit intervals)."""
  low, high = "[" if closed_low else "(", "]" if closed_high else ")"

  def check(values):
    ok = all((0 <= v if closed_low else 0 < v) and (v <= 1 if closed_high else v < 1)
             for v in values)
    return None if ok else f"--{name} targets must lie in {low}0, 1{high}, got {list(values)}"
  return check


def positive(name: str, what: str = "must be positive"):
  def check(values):
    values = values if isinstance(values, tuple) else (values,)
    return None if all(v >= 1 for v in values) else f"--{name} {what}, got {list(values)}"
  return check


def thresholds_ok(name: str):
  def check(values):
    for v in values:
      check_threshold(f"--{name} values", v)
  return check


CPU_KEPT_ROWS = "kept_rows_matmul: the C++ kernel through XLA's FFI (float32), else XLA's gather"
GPU_KEPT_ROWS = "kept_kernel.kept_rows, the Pallas kernel in Triton (impl pallas or auto)"
TPU_KEPT_ROWS = "the masked product in XLA (Mosaic has no masked loads)"
KEPT_ROWS = {"cpu": CPU_KEPT_ROWS, "cuda": GPU_KEPT_ROWS, "rocm": GPU_KEPT_ROWS,
             "tpu": TPU_KEPT_ROWS}
GATED = {"cpu": "gated_linear, impl xla: the batch-1 lax.switch (V_k and M, or V_k and W; "
                "W alone at eps <= 0)",
         "cuda": "gated_matmul, the Pallas kernel in Triton (impl pallas or auto)",
         "rocm": "gated_matmul, the Pallas kernel in Triton (impl pallas or auto)",
         "tpu": "gated_matmul, the Pallas kernel in Mosaic (impl pallas or auto)"}
