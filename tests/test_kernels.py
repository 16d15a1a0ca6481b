"""The Pallas gated-linear kernel against its pure-JAX reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gsi_jax.kernels import gated_linear, gated_linear_reference

TOLERANCE = {jnp.float32: 1e-4, jnp.bfloat16: 3e-2}  # relative to the output's scale
SHAPES = [(16, 128, 32, 128), (5, 96, 24, 200), (33, 64, 16, 48), (1, 576, 256, 192)]


def problem(T, D, K, O, dtype, seed=0):
  rng = np.random.default_rng(seed)
  V, _ = np.linalg.qr(rng.normal(size=(D, K)))
  # Half the tokens live in span(V) plus a little noise: a mixed gate.
  x = rng.normal(size=(T, D))
  x[::2] = (rng.normal(size=(len(x[::2]), K)) @ V.T) + 0.01 * rng.normal(size=(len(x[::2]), D))
  W = rng.normal(size=(D, O)) / np.sqrt(D)
  cast = lambda a: jnp.asarray(a, dtype)
  return cast(x), cast(V), cast(V.T @ W), cast(W)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("eps", [0.0, 0.1, float("inf")], ids=["all_slow", "mixed", "all_fast"])
def test_interpret_matches_reference(shape, dtype, eps):
  x, V, M, W = problem(*shape, dtype)
  y, fast = gated_linear(x, V, M, W, eps, interpret=True)
  y_ref, fast_ref = gated_linear_reference(x, V, M, W, eps)
  np.testing.assert_array_equal(np.asarray(fast), np.asarray(fast_ref))
  if eps == 0.1:
    assert 0 < int(fast.sum()) < shape[0] or shape[0] == 1
  scale = float(jnp.abs(y_ref.astype(jnp.float32)).max())
  err = float(jnp.abs(y.astype(jnp.float32) - y_ref.astype(jnp.float32)).max())
  assert err <= TOLERANCE[dtype] * scale


def test_block_sizes_do_not_change_results():
  x, V, M, W = problem(40, 96, 24, 300, jnp.float32, seed=3)
  a, _ = gated_linear(x, V, M, W, 0.1, block_t=8, block_o=64, interpret=True)
  b, _ = gated_linear(x, V, M, W, 0.1, block_t=32, block_o=256, interpret=True)
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def _has_gpu():
  try:
    return bool(jax.devices("gpu"))
  except RuntimeError:
    return False


@pytest.mark.skipif(not _has_gpu(), reason="needs a GPU (Pallas Triton backend)")
class TestCompiledOnGPU:
  @pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
  @pytest.mark.parametrize("eps", [0.0, 0.1, float("inf")])
  def test_compiled_matches_reference(self, dtype, eps):
    x, V, M, W = problem(64, 4096, 256, 4096, dtype)
    y, fast = gated_linear(x, V, M, W, eps)
    y_ref, fast_ref = gated_linear_reference(x, V, M, W, eps)
    np.testing.assert_array_equal(np.asarray(fast), np.asarray(fast_ref))
    scale = float(jnp.abs(y_ref.astype(jnp.float32)).max())
    assert float(jnp.abs(y.astype(jnp.float32) - y_ref.astype(jnp.float32)).max()) \
        <= 3e-2 * scale
