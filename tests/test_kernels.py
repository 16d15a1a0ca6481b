"""The Pallas gated matmul against its pure-JAX reference, and the gated-linear op's gate."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gsi_jax import GSIError, make_gate
from gsi_jax.ops import GatedWeights, gate_mask, gated_linear, gated_matmul, gated_matmul_reference

TOLERANCE = {jnp.float32: 1e-4, jnp.bfloat16: 3e-2}  # relative to the output's scale
# (tokens, d, k, O): non-multiples of the tiles, the default model's d = 576, GPT-J-like tiles.
SHAPES = [(16, 128, 32, 128), (5, 96, 24, 200), (33, 64, 16, 48), (1, 576, 256, 192),
          (3, 1024, 256, 512)]
GATES = {"all_slow": 0.0, "mixed": 0.1, "all_fast": float("inf")}


def problem(T, D, K, O, dtype, seed=0):
  """x, V, M, W with half the tokens in span(V) plus a little noise: a mixed gate at 0.1."""
  rng = np.random.default_rng(seed)
  V, _ = np.linalg.qr(rng.normal(size=(D, K)))
  x = rng.normal(size=(T, D))
  x[::2] = (rng.normal(size=(len(x[::2]), K)) @ V.T) + 0.01 * rng.normal(size=(len(x[::2]), D))
  W = rng.normal(size=(D, O)) / np.sqrt(D)
  cast = lambda a: jnp.asarray(a, dtype)
  return cast(x), cast(V), cast(V.T @ W), cast(W)


def check_labels(label, fast, T):
  """The case is what its name says."""
  n = int(np.sum(fast))
  if label == "all_fast":
    assert n == T
  elif label == "all_slow":
    assert n == 0
  elif T > 1:
    assert 0 < n < T


class KernelCases:
  """The same cases, compiled (GPU) or interpreted (CPU), at the GPU's block sizes."""
  interpret: bool

  @pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
  @pytest.mark.parametrize("shape", SHAPES)
  @pytest.mark.parametrize("label", list(GATES))
  def test_matches_reference(self, shape, dtype, label):
    x, V, M, W = problem(*shape, dtype)
    g = x @ V
    fast = gate_mask(x, g, GATES[label])
    check_labels(label, np.asarray(fast), shape[0])
    y = gated_matmul(x, g, fast, M, W, interpret=self.interpret)
    y_ref = gated_matmul_reference(x, g, fast, M, W)
    scale = float(jnp.abs(y_ref.astype(jnp.float32)).max())
    err = float(jnp.abs(y.astype(jnp.float32) - y_ref.astype(jnp.float32)).max())
    assert err <= TOLERANCE[dtype] * scale

  def test_transposed_weights(self):
    """A tied LM head passes its (vocab, d) table as it is stored."""
    x, V, M, W = problem(9, 96, 32, 300, jnp.float32, seed=2)
    g = x @ V
    fast = gate_mask(x, g, 0.1)
    y = gated_matmul(x, g, fast, M, W.T, w_transposed=True, interpret=self.interpret)
    np.testing.assert_allclose(np.asarray(y), np.asarray(gated_matmul_reference(x, g, fast, M, W)),
                               rtol=1e-4, atol=1e-4)

  def test_block_sizes_do_not_change_results(self):
    x, V, M, W = problem(40, 96, 24, 300, jnp.float32, seed=3)
    g = x @ V
    fast = gate_mask(x, g, 0.1)
    a = gated_matmul(x, g, fast, M, W, block_o=32, block_d=16, interpret=self.interpret)
    b = gated_matmul(x, g, fast, M, W, block_o=256, block_d=512, interpret=self.interpret)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


class TestInterpreted(KernelCases):
  interpret = True


def _has_gpu():
  try:
    return bool(jax.devices("gpu"))
  except RuntimeError:
    return False


@pytest.mark.skipif(not _has_gpu(), reason="needs a GPU (Pallas Triton backend)")
class TestCompiledOnGPU(KernelCases):
  interpret = False

  @pytest.mark.parametrize("d_out", [4096, 16384])
  def test_gptj_shapes(self, d_out):
    """GPT-J's site shapes at k = 256, bf16: tiles, not whole matrices, per program."""
    x, V, M, W = problem(1, 4096, 256, d_out, jnp.bfloat16)
    g = x @ V
    for eps in GATES.values():
      fast = gate_mask(x, g, eps)
      y = gated_matmul(x, g, fast, M, W)
      y_ref = gated_matmul_reference(x, g, fast, M, W)
      scale = float(jnp.abs(y_ref.astype(jnp.float32)).max())
      assert float(jnp.abs(y.astype(jnp.float32) - y_ref.astype(jnp.float32)).max()) \
          <= TOLERANCE[jnp.bfloat16] * scale


def test_gate_mask_equals_numpy_residual_ratio():
  """fast ⇔ ‖x − V Vᵀ x‖ / ‖x‖ < ε, computed independently in float64."""
  x, V, M, W = problem(64, 96, 24, 40, jnp.float32, seed=5)
  x64, V64 = np.asarray(x, np.float64), np.asarray(V, np.float64)
  rho = np.linalg.norm(x64 - x64 @ V64 @ V64.T, axis=1) / np.linalg.norm(x64, axis=1)
  for eps in (0.0, 0.005, 0.01, 0.02, 0.5, 1.5, float("inf")):
    want = rho < eps
    got = np.asarray(gate_mask(x, x @ V, eps))
    close = np.abs(rho - eps) < 1e-4  # float32 ties at the boundary
    assert np.array_equal(got[~close], want[~close]), eps
  assert 0 < np.mean(rho < 0.02) < 1  # the thresholds above split the tokens


@pytest.mark.parametrize("label", list(GATES))
def test_op_impls_agree(label):
  """gated_linear through the kernel equals the XLA masked select and the batch-1 switch."""
  x, V, M, W = problem(12, 96, 24, 72, jnp.float32, seed=7)
  weights = GatedWeights([W, 2 * W[:, :40]], V, [M, 2 * M[:, :40]])
  eps = GATES[label]
  outs = {}
  for impl, switch in (("xla", False), ("xla", True), ("pallas", False)):
    gate = make_gate(eps, impl=impl, batch1_switch=switch)
    ys, fast, _ = gated_linear(x[None], weights, gate.eps, gate)
    check_labels(label, np.asarray(fast[0]), 12)
    outs[impl, switch] = [np.asarray(y) for y in ys]
  for got in outs.values():
    for a, b in zip(got, outs["xla", False]):
      np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def test_pallas_refuses_ladder_and_sketch():
  x, V, M, W = problem(4, 32, 8, 16, jnp.float32)
  gate = make_gate(0.1, impl="pallas")
  with pytest.raises(GSIError, match="impl='xla' only"):
    gated_linear(x[None], GatedWeights([W], V, [M], rungs=jnp.asarray([4, 8])), gate.eps, gate)


def test_bad_impl():
  with pytest.raises(GSIError, match="impl 'cuda' is not one of"):
    make_gate(0.1, impl="cuda")
