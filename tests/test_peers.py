"""GSI's peers: weight SVD and magnitude sparsity rewrite the tree as documented."""

import numpy as np
import pytest

import gsi_jax
from gsi_jax import GSIError, metrics, peers
from gsi_jax.gsi import calibration
from gsi_jax.models.params import site_kernels

IDS = np.random.default_rng(0).integers(0, 101, (8, 16)).astype(np.int32)


@pytest.fixture(scope="module")
def llama(tiny_folder):
  return gsi_jax.load_model(tiny_folder("llama_gqa")[0])


def test_full_rank_svd_is_dense(llama):
  grams = calibration.gram_matrices(llama, llama.params, IDS, progress=False)
  full = peers.svd_truncate(llama.params, peers.whitened_svds(llama.params, grams), 10_000)
  np.testing.assert_allclose(np.asarray(llama.logits(full, IDS[:2])),
                             np.asarray(llama.logits(llama.params, IDS[:2])), atol=1e-4)


def test_svd_rank_is_respected_and_activation_aware(llama):
  grams = calibration.gram_matrices(llama, llama.params, IDS, progress=False)
  svds = peers.whitened_svds(llama.params, grams)
  low = peers.svd_truncate(llama.params, svds, 4)
  node = low["layer_0"]["mlp_in"]  # run as two thin maps: x A B
  W = np.asarray(node["factor_in"]["up"] @ node["factor_out"]["up"])
  assert np.linalg.matrix_rank(W, tol=1e-4 * np.abs(W).max()) == 4
  # Whitened truncation beats plain truncation on the calibration inputs' outputs.
  _, state = llama.forward(llama.params, IDS, collections=("site_inputs",))
  X = np.asarray(state["site_inputs"]["layer_0"]["mlp_in"]["x"][0]).reshape(-1, 48)
  W0 = np.asarray(llama.params["layer_0"]["mlp_in"]["kernel"]["up"])
  U, S, Vt = np.linalg.svd(W0, full_matrices=False)
  plain = (U[:, :4] * S[:4]) @ Vt[:4]
  assert np.linalg.norm(X @ (W0 - W)) < np.linalg.norm(X @ (W0 - plain))
  with pytest.raises(GSIError, match="rank must be positive"):
    peers.svd_truncate(llama.params, svds, 0)


def test_sparsity_thresholds_hit_their_target(llama):
  thresholds = peers.sparsity_thresholds(llama, llama.params, IDS, 0.5)
  sparse = peers.apply_sparsity(llama.params, thresholds)
  scores = metrics.score(llama, sparse, IDS)
  kept = [v for s in scores["kept_share_by_layer"].values() for v in s.values()]
  assert len(kept) == len([1 for s in site_kernels(llama.params).values() for _ in s])
  assert abs(np.mean(kept) - 0.5) < 0.05  # calibrated on the same windows
  zero = peers.apply_sparsity(llama.params, peers.sparsity_thresholds(llama, llama.params, IDS, 0.0))
  np.testing.assert_allclose(np.asarray(llama.logits(zero, IDS[:2])),
                             np.asarray(llama.logits(llama.params, IDS[:2])), atol=1e-6)
  with pytest.raises(GSIError, match="sparsity must be in"):
    peers.sparsity_thresholds(llama, llama.params, IDS, 1.0)
