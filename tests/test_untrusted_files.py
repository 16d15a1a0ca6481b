"""Loading runs no one's code and allocates nothing unbounded: counts a file declares are
checked against its size before anything is made for them, and a model folder's code never
runs."""

import json
import os
import struct
import subprocess
import sys

import numpy as np
import pytest

import gsi_jax
from gsi_jax import GSIError
from tests.test_load_errors import tiny_with

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _string(text: str) -> bytes:
  return struct.pack("<Q", len(text)) + text.encode()


def crafted_gguf(path, n_tensors=0, fields=b"", n_fields=0, tensors=b""):
  """A GGUF header written byte by byte: whatever counts the test declares."""
  path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_fields) + fields + tensors
                   + bytes(150_000))  # padding, as a real file's tensor data would be
  return path


U32, STRING, ARRAY = 4, 8, 9
CRAFTED = {
    "an array of 10^12 numbers": dict(
        n_fields=1, fields=_string("x") + struct.pack("<IIQ", ARRAY, U32, 10**12)),
    "an array of 10^9 strings": dict(
        n_fields=1, fields=_string("tokenizer.ggml.tokens")
        + struct.pack("<IIQ", ARRAY, STRING, 10**9) + _string("a") * 3),
    "a string of 2^60 bytes": dict(n_fields=1, fields=_string("x")
                                   + struct.pack("<IQ", STRING, 2**60)),
    "10^15 metadata fields": dict(n_fields=10**15),
    "10^12 tensors": dict(n_tensors=10**12),
    "a tensor of 10^6 dimensions": dict(n_tensors=1, tensors=_string("t")
                                        + struct.pack("<I", 10**6)),
}
@pytest.mark.parametrize("name", sorted(CRAFTED))
def test_a_crafted_gguf_is_refused_before_llama_cpps_reader_sees_it(tmp_path, monkeypatch,
                                                                    name):
  """llama.cpp's reader, given such a header, allocates for what it declares (past 2 GB from
  155 KB): the header walk refuses first, reading no more than the file holds."""
  import gguf

  def never(*args, **kwargs):
    raise AssertionError("gguf.GGUFReader was handed a header the walk should refuse")
  monkeypatch.setattr(gguf, "GGUFReader", never)
  path = crafted_gguf(tmp_path / "crafted.gguf", **CRAFTED[name])
  with pytest.raises(GSIError, match="GGUF header declares .* truncated, damaged or crafted"):
    gsi_jax.load_model(str(path))


def _tiny_llama_gguf(path, **metadata):
  import gguf
  fields = {"llama.embedding_length": 32, "llama.attention.head_count": 4,
            "llama.block_count": 2, "llama.feed_forward_length": 48,
            "llama.vocab_size": 101, **metadata}
  writer = gguf.GGUFWriter(str(path), "llama")
  for key, value in fields.items():
    writer.add_uint32(key, value)
  writer.add_tensor("token_embd.weight", np.zeros((101, 32), np.float32))
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return str(path)


@pytest.mark.parametrize("key, value", [("llama.block_count", 10**6),
                                        ("llama.embedding_length", 2**20),
                                        ("llama.vocab_size", 10**9)])
def test_gguf_counts_the_file_cannot_hold_are_refused_before_any_table(tmp_path, key, value):
  path = _tiny_llama_gguf(tmp_path / "big.gguf", **{key: value})
  with pytest.raises(GSIError, match=r"its config declares [\d,]+ weights .* more than its "
                                     r"[\d,]+ bytes of weights hold at 1 bits a weight"):
    gsi_jax.load_model(path)


@pytest.mark.parametrize("key, value", [("n_layer", 10**6), ("n_embd", 2**16),
                                        ("vocab_size", 10**8)])
def test_config_counts_the_checkpoint_cannot_hold_are_refused(tiny_folder, tmp_path, key,
                                                              value):
  overrides = {key: value, "n_head": 4} if key == "n_embd" else {key: value}
  folder = tiny_with(tiny_folder, tmp_path, "gpt2", **overrides)
  with pytest.raises(GSIError, match=r"its config declares [\d,]+ weights"):
    gsi_jax.load_model(folder)


def test_code_in_a_model_folder_never_runs(tiny_folder, tmp_path):
  """A tokenizer whose config points at the folder's own module: it is never imported,
  and nothing asks whether it may be (stdin is a terminal-less pipe here, and the call
  passes trust_remote_code=False, which transformers never prompts over)."""
  folder = tiny_with(tiny_folder, tmp_path, "gpt2")
  marker = tmp_path / "ran"
  (tmp_path / "model" / "custom_tokenizer.py").write_text(
      f"open({str(marker)!r}, 'w').close()\n"
      "from transformers import PreTrainedTokenizerFast\n"
      "class Custom(PreTrainedTokenizerFast):\n  pass\n")
  (tmp_path / "model" / "tokenizer_config.json").write_text(json.dumps(
      {"auto_map": {"AutoTokenizer": [None, "custom_tokenizer.Custom"]},
       "tokenizer_class": "Custom"}))
  proc = subprocess.run(
      [sys.executable, "-c", "import sys, gsi_jax\ntry:\n  gsi_jax.load_model(sys.argv[1])\n"
       "except gsi_jax.GSIError as e:\n  print('refused:', e)", folder],
      stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300, cwd=ROOT,
      env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT})
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert not marker.exists()
  assert "[y/N]" not in proc.stdout + proc.stderr
