"""Loading a model: GGUF and Hugging Face checkpoints through explicit mapping tables per
family, and random-weight checkpoints of published shapes."""

from gsi_jax.loading.load import DEFAULT_MODEL, PRESETS, load_model

__all__ = ["DEFAULT_MODEL", "PRESETS", "load_model"]
