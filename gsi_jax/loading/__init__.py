"""Loading a model: GGUF and Hugging Face checkpoints through explicit mapping tables per
family, and random-weight checkpoints of published shapes."""

import logging

from gsi_jax.loading.load import DEFAULT_MODEL, PRESETS, load_model


class _NoTorchAdvice(logging.Filter):
  """transformers warns on import that PyTorch was not found; gsi_jax takes only its
  tokenizers and configs, which need none, so in an install without torch (the demo's) the
  warning reads as a failure that is not one.  (gsi_jax imports transformers only inside
  the functions that use it, so this filter is in place before.)"""

  def filter(self, record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("PyTorch was not found.")


logging.getLogger("transformers").addFilter(_NoTorchAdvice())

__all__ = ["DEFAULT_MODEL", "PRESETS", "load_model"]
