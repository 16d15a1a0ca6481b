"""GSI itself: streaming calibration of the bases, their solvers and Orbax checkpoints, and
the pure transforms that rewrite a parameter tree into (V_k, M, W)."""

from gsi_jax.gsi.bases import Bases, fingerprint
from gsi_jax.gsi.calibration import calibrate
from gsi_jax.gsi.checkpoint import load_bases, save_bases
from gsi_jax.gsi.head import apply_gsi_head, head_basis
from gsi_jax.gsi.transform import apply_gsi, apply_residual_sparsity, gsi_shapes, truncate_ranks

__all__ = ["Bases", "apply_gsi", "apply_gsi_head", "apply_residual_sparsity", "calibrate", "fingerprint", "gsi_shapes",
           "head_basis", "load_bases", "save_bases", "truncate_ranks"]
