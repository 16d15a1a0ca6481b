from gsi_jax.kernels.gated_linear import gated_linear, gated_linear_reference

__all__ = ["gated_linear", "gated_linear_reference"]
