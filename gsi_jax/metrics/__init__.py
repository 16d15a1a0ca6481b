"""Scoring (quality), bytes (the one byte formula) and analysis, one concept a module."""

from gsi_jax.metrics.analysis import (depth_coherence, principal_cosines, random_subspace_cosine,
                                      residual_ratios, theorem4_tightness)
from gsi_jax.metrics.bytes import byte_accounting, dense_bytes
from gsi_jax.metrics.scoring import mean_share, quality, score, share_by_site

__all__ = ["byte_accounting", "dense_bytes", "depth_coherence", "mean_share",
           "principal_cosines", "quality", "random_subspace_cosine", "residual_ratios", "score",
           "share_by_site", "theorem4_tightness"]
