"""Weight SVD (SVD-LLM-style whitened truncation of every W): rank r, stored as two thin
maps wherever r (d + O) < d O."""

from __future__ import annotations

from gsi_jax import peers
from gsi_jax.methods.common import positive
from gsi_jax.methods.registry import Knob, Method, Point, register
from gsi_jax.metrics import bytes as mbytes

SVD_RANKS = Knob("svd_ranks", int, ("32", "64", "128", "192", "256"), "Weight-SVD ranks.",
                 check=positive("svd_ranks"))


def _points(ctx):
  svds = peers.whitened_svds(ctx.base, ctx.grams())
  for rank in ctx.grid["svd_ranks"]:
    yield Point(f"rank={rank}", peers.svd_truncate(ctx.base, svds, rank), values={"rank": rank})


THIN_MAPS = "two thin maps x A B, each an XLA dot"
register(Method(
    "svd", "Whitened weight SVD: each W at rank r, no gate.", (SVD_RANKS,), _points,
    lambda point: lambda sc: mbytes.svd_bytes(point.params, point.values["rank"]),
    dict.fromkeys(("cpu", "cuda", "rocm", "tpu"), THIN_MAPS)))
