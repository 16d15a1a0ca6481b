from gsi_jax.loading.load import DEFAULT_MODEL, PRESETS, load_model

__all__ = ["DEFAULT_MODEL", "PRESETS", "load_model"]
