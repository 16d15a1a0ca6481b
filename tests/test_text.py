"""The default calibration and evaluation texts share no text."""

import pytest

import gsi_jax
from gsi_jax import GSIError, text


def test_pydoc_halves_share_no_60_character_run():
  calibration, evaluation = text.pydoc_halves()
  runs = text.shared_runs(evaluation, 60)
  assert len(calibration) > 100_000 and len(evaluation) > 100_000
  assert not any(calibration[i:i + 60] in runs for i in range(len(calibration) - 59))


@pytest.fixture(scope="module")
def model():
  return gsi_jax.load_model("smollm2-135m")


@pytest.mark.parametrize("calib_tokens", [4096, 30_000, 10**7])
def test_calibration_windows_hold_no_evaluation_text(model, calib_tokens):
  """At any --calib_tokens, the text the windows decode to shares no 60-character run."""
  runs = text.shared_runs(text.load_text(text.PYDOC_EVAL), 60)
  ids = text.windows(model, text.PYDOC_CALIB, 256, calib_tokens).ids
  decoded = model.decode(ids.reshape(-1))
  assert not any(decoded[i:i + 60] in runs for i in range(len(decoded) - 59))


def test_bad_sources(tmp_path):
  with pytest.raises(GSIError, match="--calib_text_file: .* is a folder"):
    text.load_text(str(tmp_path), "--calib_text_file")
  binary = tmp_path / "b.txt"
  binary.write_bytes(b"\xff\xfe\x00")
  with pytest.raises(GSIError, match="not UTF-8"):
    text.load_text(str(binary))
  with pytest.raises(GSIError, match="hf:dataset/config/split"):
    text.load_text("hf:wikitext")
