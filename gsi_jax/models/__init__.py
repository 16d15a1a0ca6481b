"""One Flax decoder for GPT-2, GPT-J, OPT and Llama, its config and its parameter layout."""

from gsi_jax.models.config import ModelConfig
from gsi_jax.models.decoder import Decoder, init_cache
from gsi_jax.models.model import Model

__all__ = ["Decoder", "Model", "ModelConfig", "init_cache"]
