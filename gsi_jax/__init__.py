"""Gated Subspace Inference for transformer decoding, in JAX."""

from gsi_jax.errors import GSIError
from gsi_jax.loading import DEFAULT_MODEL, PRESETS, load_model
from gsi_jax.models import Gate, Model, ModelConfig, make_gate

__all__ = ["DEFAULT_MODEL", "GSIError", "Gate", "Model", "ModelConfig", "PRESETS",
           "load_model", "make_gate"]
