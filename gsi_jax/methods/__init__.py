"""Every method in one registry, in the order a sweep runs them: GSI and its variants, the
paper's peers, the methods beyond the paper, and their allocations per site.

Adding a method is one module that calls `register` (see `registry.Method`), its import
line below, and its test; `experiments/pareto.py` then runs it with no other change.
"""

from gsi_jax.methods.registry import (PLATFORMS, REGISTRY, TAKEN_FLAGS, Knob, Method, Point,
                                      knobs, names, register, unregister, users)

# Each module registers its methods when imported; the order is the sweep's.
from gsi_jax.methods import gsi  # noqa: E402,F401  gsi, gsi_out, gsi_ladder, static
from gsi_jax.methods import svd  # noqa: E402,F401
from gsi_jax.methods import sparsity  # noqa: E402,F401  sparsity, larosa, sparsity_greedy
from gsi_jax.methods import head  # noqa: E402,F401  head, sparsity+head
from gsi_jax.methods import residual  # noqa: E402,F401
from gsi_jax.methods import rsparse  # noqa: E402,F401  rsparse, rsparse_searched
from gsi_jax.methods import cats  # noqa: E402,F401
from gsi_jax.methods import learned  # noqa: E402,F401  the four learned allocations

__all__ = ["PLATFORMS", "REGISTRY", "TAKEN_FLAGS", "Knob", "Method", "Point", "knobs", "names", "register",
           "unregister", "users"]
