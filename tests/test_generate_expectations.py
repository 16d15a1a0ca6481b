"""What users expect of generate: a GSI gate needs bases to gate, and the gate statistics
count only the rows still decoding."""

import numpy as np
import pytest

import gsi_jax
from gsi_jax import GSIError, metrics

CALIB = (np.arange(96, dtype=np.int32) % 97 + 1).reshape(-1, 16)


@pytest.fixture(scope="module")
def gsi_model(tiny_folder):
  model = gsi_jax.load_model(tiny_folder("gpt2")[0])
  bases = gsi_jax.calibrate(model, model.params, CALIB, 8, seq_len=16)
  return model, gsi_jax.apply_gsi(model.params, bases, 4)


@pytest.mark.parametrize("gate", [gsi_jax.make_gate(0.1), gsi_jax.make_gate(0.0, "static"),
                                  gsi_jax.make_gate(0.0, head_eps=0.2)])
def test_a_gsi_gate_over_parameters_without_bases_is_refused(gsi_model, gate):
  model, _ = gsi_model
  for call in (lambda: model.generate(model.params, [[1, 2, 3]], 2, gate),
               lambda: model.logits(model.params, [[1, 2, 3]], gate),
               lambda: metrics.score(model, model.params, CALIB[:1], gate)):
    with pytest.raises(GSIError, match="GSI gate over parameters that hold no bases would "
                                       "run as dense"):
      call()


def test_a_gate_that_never_takes_a_gsi_path_runs_over_dense_parameters(gsi_model):
  model, _ = gsi_model
  for gate in (gsi_jax.make_gate(0.0), gsi_jax.make_gate(0.3, "dense")):
    np.testing.assert_array_equal(model.generate(model.params, [[1, 2, 3]], 3, gate),
                                  model.generate(model.params, [[1, 2, 3]], 3))


def test_finished_rows_are_not_counted_in_the_gate_statistics(gsi_model):
  """Row 0 ends at its first token (until_differs); the decode steps' statistics are then
  row 1's alone, as a decode of row 1 by itself counts them."""
  model, params = gsi_model
  gate = gsi_jax.make_gate(0.5)
  prompts = np.array([[5, 17, 3, 99], [9, 2, 77, 31]], np.int32)
  alone = model.generate(params, prompts[1:], 8, gate, stop_at_eos=False)
  _, want = model.generate(params, prompts[1:], 8, gate, return_stats=True,
                           stop_at_eos=False, until_differs=alone[:, 4:])
  first = int(np.asarray(model.generate(params, prompts[:1], 1, gate))[0, -1])
  reference = np.stack([np.full(8, (first + 1) % 101), np.asarray(alone)[0, 4:]])
  out, got = model.generate(params, prompts, 8, gate, return_stats=True, stop_at_eos=False,
                            until_differs=reference)
  assert np.asarray(out).shape[1] == 12
  shares = [s for sites in want["fast_share_by_layer"].values() for s in sites.values()]
  assert 0 < np.mean(shares) < 1  # the gate is neither always slow nor always fast here
  for layer, sites in want["fast_share_by_layer"].items():
    for site, share in sites.items():
      assert got["fast_share_by_layer"][layer][site] == pytest.approx(share, abs=1e-6)
      assert got["rows_by_layer"][layer][site] == pytest.approx(
          want["rows_by_layer"][layer][site], abs=1e-5)
