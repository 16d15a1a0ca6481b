"""Gated Subspace Inference for transformer decoding, in JAX."""

from gsi_jax.errors import GSIError
from gsi_jax.gsi import (Bases, apply_gsi, apply_gsi_head, apply_residual_sparsity, calibrate,
                         head_basis, load_bases, save_bases, truncate_ranks)
from gsi_jax.loading import DEFAULT_MODEL, PRESETS, load_model
from gsi_jax.metrics import depth_coherence
from gsi_jax.models import Model, ModelConfig
from gsi_jax.models.params import dense_params
from gsi_jax.ops import Gate, make_gate

__all__ = ["Bases", "DEFAULT_MODEL", "GSIError", "Gate", "Model", "ModelConfig", "PRESETS",
           "apply_gsi", "apply_gsi_head", "apply_residual_sparsity", "calibrate", "dense_params", "depth_coherence",
           "head_basis", "load_bases", "load_model", "make_gate", "save_bases", "truncate_ranks"]
