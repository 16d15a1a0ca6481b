"""Nothing wrong runs: bad configs, tensors and tokenizers are refused by name; the bases
cache identifies exactly what was calibrated; the API checks its arguments."""

import json
import logging
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import gsi_jax
from gsi_jax import GSIError, peers
from gsi_jax.gsi import checkpoint, fingerprint
from gsi_jax.gsi.cache import cached_bases
from gsi_jax.text import TokenWindows
from tests.multiprocess import ABSL_INFO
from tests.test_load_errors import tiny_with

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CALIB = np.arange(96, dtype=np.int32) % 97 + 1


def _copy(tiny_folder, tmp_path, name, **overrides):
  return Path(tiny_with(tiny_folder, tmp_path, name, **overrides))


@pytest.mark.parametrize("name, overrides, message", [
    ("gpt2", {"n_head": 0}, "n_head=0 must be a positive integer"),
    ("gpt2", {"n_head": 3}, "n_heads=3 is invalid"),
    ("gpt2", {"vocab_size": "101"}, "vocab_size='101' must be a positive integer"),
    ("gpt2", {"n_layer": None}, "lacks 'n_layer'"),
    ("llama_mha", {"rope_parameters": {"rope_theta": -1.0, "rope_type": "default"}},
     "rope_theta=-1.0 is invalid"),
    ("llama_mha", {"rope_theta": 500.0}, "rope_theta=500.0 and rope_parameters.rope_theta"),
    ("llama_mha", {"rms_norm_eps": float("nan")}, "norm_eps=nan is invalid"),
    ("llama_mha", {"num_key_value_heads": 3}, "n_kv_heads=3 is invalid"),
    ("gptj", {"rotary_dim": 7}, "rotary_dim=7 is invalid"),
    ("opt", {"quantization_config": {"quant_method": "gptq", "bits": 4}},
     "quantization_config \\(gptq\\)"),
    ("gpt2", {"eos_token_id": 500}, "end-of-sequence id 500 is outside the vocabulary"),
    ("gpt2", {"eos_token_id": "</s>"}, "eos_token_id='</s>' is not a token id"),
    ("gpt2", {"vocab_size": 50}, "tokenizer has 99 tokens but the model's vocabulary only 50"),
])
def test_configs_that_cannot_be_right_are_refused(tiny_folder, tmp_path, name, overrides,
                                                  message):
  folder = _copy(tiny_folder, tmp_path, name, **overrides)
  with pytest.raises(GSIError, match=message):
    gsi_jax.load_model(str(folder))


def _edit_tensor(folder, key, edit):
  from safetensors.torch import load_file, save_file
  state = load_file(f"{folder}/model.safetensors")
  state[key] = edit(state[key])
  save_file(state, f"{folder}/model.safetensors")


def test_non_finite_weights_are_refused(tiny_folder, tmp_path):
  folder = _copy(tiny_folder, tmp_path, "gpt2")

  def poison(w):
    w = w.clone()
    w[0] = math.nan
    return w
  _edit_tensor(folder, "transformer.h.1.ln_2.weight", poison)
  with pytest.raises(GSIError, match="h.1.ln_2.weight holds 1 NaN or infinite values"):
    gsi_jax.load_model(str(folder))


def test_values_that_overflow_the_dtype_are_refused(tiny_folder, tmp_path):
  folder = _copy(tiny_folder, tmp_path, "gpt2")
  _edit_tensor(folder, "transformer.wte.weight", lambda w: w * 1e6)
  gsi_jax.load_model(str(folder))  # float32 holds them
  with pytest.raises(GSIError, match="wte.weight overflows float16"):
    gsi_jax.load_model(str(folder), dtype="float16")


def test_integer_tensors_are_refused_by_name(tiny_folder, tmp_path):
  import torch
  folder = _copy(tiny_folder, tmp_path, "llama_mha")
  _edit_tensor(folder, "model.layers.0.mlp.up_proj.weight", lambda w: (w * 100).to(torch.int8))
  with pytest.raises(GSIError, match="up_proj.weight is stored as int8"):
    gsi_jax.load_model(str(folder))


@pytest.mark.parametrize("name, edit, message", [
    # A config that says fewer layers than the checkpoint holds would run a cut model.
    ("gpt2", lambda s: s.update({"transformer.h.2.mlp.c_fc.weight": s["transformer.wte.weight"].clone()}),
     "holds 1 tensor\\(s\\) that a gpt2 model with this config never reads "
     "\\(h.2.mlp.c_fc.weight\\)"),
    # A tied config beside a head that differs from the embedding.
    ("gpt2", lambda s: s.update({"lm_head.weight": s["transformer.wte.weight"] + 1}),
     "the config ties the LM head .* lm_head.weight differs from wte.weight"),
])
def test_weights_the_config_does_not_describe_are_refused(tiny_folder, tmp_path, name, edit,
                                                          message):
  folder = _copy(tiny_folder, tmp_path, name)
  from safetensors.torch import load_file, save_file
  state = load_file(f"{folder}/model.safetensors")
  edit(state)
  save_file({k: v.contiguous() for k, v in state.items()}, f"{folder}/model.safetensors")
  with pytest.raises(GSIError, match=message):
    gsi_jax.load_model(str(folder))


def test_harmless_extras_load(tiny_folder, tmp_path):
  """A tied head saved twice and old causal-mask buffers are read by no model, and are fine."""
  folder = _copy(tiny_folder, tmp_path, "gpt2")
  from safetensors.torch import load_file, save_file
  state = load_file(f"{folder}/model.safetensors")
  state["lm_head.weight"] = state["transformer.wte.weight"].clone()
  state["transformer.h.0.attn.masked_bias"] = state["transformer.wte.weight"][0].clone()
  save_file(state, f"{folder}/model.safetensors")
  model = gsi_jax.load_model(str(folder))
  reference = gsi_jax.load_model(tiny_folder("gpt2")[0])
  np.testing.assert_array_equal(model.logits(model.params, [[1, 2, 3]]),
                                reference.logits(reference.params, [[1, 2, 3]]))


def test_the_weight_files_are_those_transformers_reads(tiny_folder, tmp_path):
  """model.safetensors, else its index, else pytorch_model.bin, else its index: the first
  that exists is read, nothing else in the folder (a leftover or another format)."""
  from safetensors import safe_open
  folder = _copy(tiny_folder, tmp_path, "gpt2")
  weights = folder / "model.safetensors"
  reference = gsi_jax.load_model(str(folder))
  expect = reference.logits(reference.params, [[1, 2, 3]])
  # A leftover shard, an index and a .bin beside model.safetensors: none is read.
  shard = folder / "model-00001-of-00001.safetensors"
  shard.write_bytes(b"stale, never read")
  (folder / "model.safetensors.index.json").write_text("{not json")
  (folder / "pytorch_model.bin").write_bytes(b"never unpickled")
  model = gsi_jax.load_model(str(folder))
  np.testing.assert_array_equal(model.logits(model.params, [[1, 2, 3]]), expect)
  # Without model.safetensors the index decides, and only its files are read.
  shard.write_bytes(weights.read_bytes())
  weights.unlink()
  with safe_open(str(shard), framework="numpy") as h:
    names = list(h.keys())
  index = folder / "model.safetensors.index.json"
  index.write_text(json.dumps({"metadata": {}, "weight_map": {n: shard.name for n in names}}))
  (folder / "model-00002-of-00002.safetensors").write_bytes(b"not in the index, never read")
  model = gsi_jax.load_model(str(folder))
  np.testing.assert_array_equal(model.logits(model.params, [[1, 2, 3]]), expect)
  index.write_text(json.dumps({"weight_map": {names[0]: "model-00003-of-00003.safetensors"}}))
  with pytest.raises(GSIError, match="names model-00003-of-00003.safetensors, which is missing"):
    gsi_jax.load_model(str(folder))
  index.write_text(json.dumps({"weight_map": {n: shard.name for n in names} | {"x.w": shard.name}}))
  with pytest.raises(GSIError, match="places x.w .* in a file that does not hold it"):
    gsi_jax.load_model(str(folder))
  index.write_text("{not json")
  with pytest.raises(GSIError, match="is not a checkpoint index"):
    gsi_jax.load_model(str(folder))


@pytest.mark.parametrize("name", ["../outside.safetensors", "/etc/passwd",
                                  "sub/model.safetensors", "model.bin"])
def test_an_index_never_reads_a_file_outside_the_model_folder(tiny_folder, tmp_path, name):
  folder = _copy(tiny_folder, tmp_path, "gpt2")
  (tmp_path / "outside.safetensors").write_bytes((folder / "model.safetensors").read_bytes())
  (folder / "model.safetensors").unlink()
  (folder / "model.safetensors.index.json").write_text(
      json.dumps({"weight_map": {"wte.weight": name}}))
  with pytest.raises(GSIError, match=r"is not a \.safetensors file in the model folder"):
    gsi_jax.load_model(str(folder))


def test_a_pytorch_index_reads_only_the_files_it_names(tiny_folder, tmp_path):
  import torch
  from safetensors.torch import load_file
  folder = _copy(tiny_folder, tmp_path, "gpt2")
  reference = gsi_jax.load_model(str(folder))
  state = load_file(str(folder / "model.safetensors"))
  (folder / "model.safetensors").unlink()
  keys = sorted(state)
  halves = {"pytorch_model-00001-of-00002.bin": keys[:len(keys) // 2],
            "pytorch_model-00002-of-00002.bin": keys[len(keys) // 2:]}
  for file, part in halves.items():
    torch.save({k: state[k] for k in part}, folder / file)
  (folder / "pytorch_model-old.bin").write_bytes(b"a leftover, never unpickled")
  (folder / "pytorch_model.bin.index.json").write_text(json.dumps(
      {"weight_map": {k: file for file, part in halves.items() for k in part}}))
  model = gsi_jax.load_model(str(folder))
  np.testing.assert_array_equal(model.logits(model.params, [[1, 2, 3]]),
                                reference.logits(reference.params, [[1, 2, 3]]))


def test_a_folder_without_a_checkpoint_transformers_reads_is_refused(tiny_folder, tmp_path):
  folder = _copy(tiny_folder, tmp_path, "gpt2")
  (folder / "model.safetensors").rename(folder / "consolidated.safetensors")
  with pytest.raises(GSIError, match=r"none of model.safetensors, .* \(it holds "
                                     "consolidated.safetensors"):
    gsi_jax.load_model(str(folder))


def test_a_broken_tokenizer_is_named(tiny_folder, tmp_path):
  folder = _copy(tiny_folder, tmp_path, "gpt2")
  (folder / "tokenizer.json").write_text("{ this is not a tokenizer")
  with pytest.raises(GSIError, match="the tokenizer cannot be built"):
    gsi_jax.load_model(str(folder))


@pytest.mark.parametrize("drop, set_, message", [
    ("llama.embedding_length", {}, "lacks llama.embedding_length"),
    (None, {"llama.attention.head_count": 0}, "head_count=0 must be positive"),
    (None, {"llama.rope.freq_base": -5.0}, "rope_theta=-5.0 is invalid"),
    (None, {"llama.block_count": 0}, "n_layers=0 is invalid"),
])
def test_gguf_metadata_that_cannot_be_right_is_refused(tmp_path, drop, set_, message):
  import gguf
  fields = {"llama.embedding_length": 32, "llama.attention.head_count": 4,
            "llama.block_count": 2, "llama.feed_forward_length": 48,
            "llama.rope.freq_base": 10000.0, "llama.vocab_size": 101, **set_}
  path = str(tmp_path / "bad.gguf")
  writer = gguf.GGUFWriter(path, "llama")
  for key, value in fields.items():
    if key == drop:
      continue
    if isinstance(value, float):
      writer.add_float32(key, value)
    else:
      writer.add_int32(key, value) if value <= 0 else writer.add_uint32(key, value)
  writer.add_tensor("token_embd.weight", np.zeros((101, 32), np.float32))
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  with pytest.raises(GSIError, match=message):
    gsi_jax.load_model(path)


# The weights' identity: every byte, not a sample.

def test_fingerprint_covers_every_byte_of_every_tensor(tiny_folder):
  model = gsi_jax.load_model(tiny_folder("gpt2")[0])
  params = model.params
  base = fingerprint(params)
  assert fingerprint(params) == base
  norm = params["layer_1"]["mlp_norm"]["norm"]["scale"]
  changed = {**params, "layer_1": {**params["layer_1"], "mlp_norm": {"norm": {
      **params["layer_1"]["mlp_norm"]["norm"], "scale": norm.at[0].add(1e-3)}}}}
  assert fingerprint(changed) != base  # a norm, which a kernel sample never saw
  W = params["layer_0"]["mlp_out"]["kernel"]["fc_out"]
  last = {**params, "layer_0": {**params["layer_0"], "mlp_out": {
      **params["layer_0"]["mlp_out"], "kernel": {"fc_out": W.at[-1, -1].add(1e-3)}}}}
  assert fingerprint(last) != base  # the last value of a kernel
  bases = gsi_jax.calibrate(model, params, CALIB, k_max=8, seq_len=16, progress=False)
  assert fingerprint(gsi_jax.apply_gsi(params, bases, 4)) == base  # GSI keys left out
  with pytest.raises(GSIError, match="calibrated for another model"):
    gsi_jax.apply_gsi(changed, bases, 4)


def _run_cached(model, params, ids, tmp_path, caplog, seq_len=16, k_max=8):
  windows = TokenWindows(ids.reshape(-1, seq_len), "test text")
  caplog.clear()
  with caplog.at_level(logging.INFO):
    bases = cached_bases(model, params, windows, k_max, bases_dir=str(tmp_path / "bases"))
  restored = any("bases restored" in r.getMessage() for r in caplog.records)
  return bases, restored


def test_an_interrupted_calibration_blocks_no_run_with_other_settings(tiny_folder, tmp_path,
                                                                     caplog, monkeypatch):
  """Ctrl-C in the cache's calibration at k_max=8 leaves its progress: a run at another k_max
  calibrates beside it, and a run at k_max=8 resumes it."""
  from gsi_jax.gsi import calibration
  model = gsi_jax.load_model(tiny_folder("gpt2")[0])
  real, solved = calibration.solve_layer, []

  def interrupt_second_layer(*args, **kwargs):
    if solved:
      raise KeyboardInterrupt
    solved.append(1)
    return real(*args, **kwargs)
  monkeypatch.setattr(calibration, "solve_layer", interrupt_second_layer)
  with pytest.raises(KeyboardInterrupt):
    _run_cached(model, model.params, CALIB, tmp_path, caplog, k_max=8)
  monkeypatch.undo()
  bases, _ = _run_cached(model, model.params, CALIB, tmp_path, caplog, k_max=16)
  assert bases.k_max == 16
  assert not any("resumes" in r.getMessage() for r in caplog.records)
  # The k_max=16 bases serve k_max=8 too, so a fresh cache shows the resume.
  for entry in (tmp_path / "bases").iterdir():
    if entry.is_dir() and not entry.name.endswith("-layers-k8"):
      shutil.rmtree(entry)
  bases, _ = _run_cached(model, model.params, CALIB, tmp_path, caplog, k_max=8)
  assert bases.k_max == 8
  assert any("calibration resumes after 1 of 2 layers" in r.getMessage() for r in caplog.records)


def test_the_cache_restores_only_what_this_run_would_calibrate(tiny_folder, tmp_path, caplog):
  model = gsi_jax.load_model(tiny_folder("llama_gqa")[0])
  first, restored = _run_cached(model, model.params, CALIB, tmp_path, caplog)
  assert not restored
  again, restored = _run_cached(model, model.params, CALIB, tmp_path, caplog)
  assert restored and again.meta == {**first.meta, **{k: again.meta[k] for k in
                                                      ("checksums", "meta_sha256")}}
  # The same tokens cut into other windows, and the same shapes with another norm.
  _, restored = _run_cached(model, model.params, CALIB, tmp_path, caplog, seq_len=32)
  assert not restored
  norm = model.params["final_norm"]["norm"]["scale"]
  other = {**model.params, "final_norm": {"norm": {"scale": norm * 0 + 2}}}
  _, restored = _run_cached(model, other, CALIB, tmp_path, caplog)
  assert not restored
  entries = sorted(p for p in os.listdir(tmp_path / "bases") if not p.endswith(".lock"))
  assert len(entries) == 3


def test_the_cache_serves_every_k_it_reaches_and_says_why_it_calibrates(tiny_folder, tmp_path,
                                                                         caplog):
  """Cached at k_max 8: a run asking 4 restores them; one asking 12 says why it calibrates
  again (not "no cached bases"), and its bases then serve 8 as well."""
  model = gsi_jax.load_model(tiny_folder("llama_gqa")[0])
  _run_cached(model, model.params, CALIB, tmp_path, caplog)
  _, restored = _run_cached(model, model.params, CALIB, tmp_path, caplog, k_max=4)
  assert restored
  wider, restored = _run_cached(model, model.params, CALIB, tmp_path, caplog, k_max=12)
  said = [r.getMessage() for r in caplog.records]
  assert not restored and wider.k_max == 12
  assert any("reach k_max=8, and this run asks for k up to 12: calibrating again to 12" in m
             for m in said), said
  assert not any(m.startswith("no cached bases") for m in said)
  _, restored = _run_cached(model, model.params, CALIB, tmp_path, caplog)
  assert restored


def test_a_read_only_cache_is_read_and_refused_only_when_calibration_must_write(
    tiny_folder, tmp_path, caplog, monkeypatch):
  """A shared cache this run cannot write (read-only: root's permissions say yes, so the
  write probe is made to fail) serves the bases it holds; a run that would have to
  calibrate into it is refused before calibrating."""
  model = gsi_jax.load_model(tiny_folder("llama_gqa")[0])
  first, _ = _run_cached(model, model.params, CALIB, tmp_path, caplog)
  monkeypatch.setattr(checkpoint, "can_create_in", lambda folder: False)
  again, restored = _run_cached(model, model.params, CALIB, tmp_path, caplog)
  assert restored and "read-only bases cache: restored" in caplog.text
  for layer, sites in first.vectors.items():
    for site, V in sites.items():
      np.testing.assert_array_equal(again.vectors[layer][site], V)
  with pytest.raises(GSIError, match=re.escape("is not writable; pass a writable --bases_dir "
                                               "(or '' to skip the cache); it holds no bases "
                                               "for this run to read instead")):
    _run_cached(model, model.params, CALIB, tmp_path, caplog, seq_len=32)
  assert len([p for p in os.listdir(tmp_path / "bases") if not p.endswith(".lock")]) == 1


def test_edited_metadata_is_caught_and_recalibrated(tiny_folder, tmp_path, caplog):
  model = gsi_jax.load_model(tiny_folder("gpt2")[0])
  _run_cached(model, model.params, CALIB, tmp_path, caplog)
  (entry,) = [p for p in (tmp_path / "bases").iterdir() if not p.name.endswith(".lock")]
  (meta_file,) = [f for f in (entry / "gsi_bases_1" / "meta").rglob("*") if f.is_file()
                  and '"k_max"' in f.read_text(errors="ignore")]
  meta = json.loads(meta_file.read_text())
  meta["k_max"] = 10_000  # a poisoned k_max would claim bases it does not hold
  meta_file.write_text(json.dumps(meta))
  with pytest.raises(GSIError, match="checksums"):
    gsi_jax.load_bases(str(entry))
  bases, restored = _run_cached(model, model.params, CALIB, tmp_path, caplog)
  assert not restored and bases.k_max == 8
  assert any("ignoring cached bases" in r.getMessage() for r in caplog.records)
  assert gsi_jax.load_bases(str(entry)).k_max == 8  # the new step supersedes the edit


CONCURRENT = """
import logging, sys
import numpy as np
import gsi_jax
from gsi_jax.gsi.cache import cached_bases
from gsi_jax.text import TokenWindows
from tests.test_load_errors import tiny_with
logging.basicConfig(level=logging.INFO, format="%(message)s")
model = gsi_jax.load_model(sys.argv[1])
ids = (np.arange(96, dtype=np.int32) % 97 + 1).reshape(-1, 16)
cached_bases(model, model.params, TokenWindows(ids, "text"), 8, bases_dir=sys.argv[2])
print("done")
"""


def test_two_runs_on_one_cache_entry_take_turns(tiny_folder, tmp_path):
  """Both finish; one calibrates and the other restores its bases (no Orbax collision)."""
  folder = tiny_folder("gpt2")[0]
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  procs = [subprocess.Popen([sys.executable, "-c", CONCURRENT, folder, str(tmp_path / "b")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            cwd=ROOT) for _ in range(2)]
  outs = [p.communicate(timeout=300) for p in procs]
  assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
  logs = "".join(err for _, err in outs)
  assert logs.count("calibration took") == 1 and logs.count("bases restored") == 1, logs


CONCURRENT_WRITERS = """
import logging, sys
import numpy as np
import gsi_jax
logging.basicConfig(level=logging.INFO, format="%(message)s")
model = gsi_jax.load_model(sys.argv[1])
ids = (np.arange(96, dtype=np.int32) % 97 + 1).reshape(-1, 16)
bases = gsi_jax.calibrate(model, model.params, ids, 8, seq_len=16, resume_dir=sys.argv[2] + "-layers")
print("step", gsi_jax.save_bases(sys.argv[2], bases))
"""


def test_two_writers_of_one_folder_take_turns_outside_the_cache(tiny_folder, tmp_path):
  """calibrate(resume_dir=...) and save_bases from two processes: no Orbax collision; the
  second calibration resumes after every layer of the first, and the saves get steps 1, 2."""
  folder = tiny_folder("gpt2")[0]
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  procs = [subprocess.Popen([sys.executable, "-c", CONCURRENT_WRITERS, folder,
                             str(tmp_path / "b")], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
           for _ in range(2)]
  outs = [p.communicate(timeout=300) for p in procs]
  assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
  assert sorted(out.strip() for out, _ in outs) == ["step 1", "step 2"]
  logs = "".join(err for _, err in outs)
  assert logs.count("calibration resumes after 2 of 2 layers") == 1, logs
  first, second = (gsi_jax.load_bases(str(tmp_path / "b")) for _ in range(2))
  assert first.meta == second.meta


# The Python API checks its arguments.

@pytest.fixture(scope="module")
def llama(tiny_folder):
  return gsi_jax.load_model(tiny_folder("llama_mha")[0])


@pytest.mark.parametrize("ids, message", [
    ([[1, 2, 101]], "outside the vocabulary 0..100"),
    ([[1, -1]], "outside the vocabulary"),
    (np.array([[1.0, 2.0]]), "must hold integer token ids, got float64"),
    ([1, 2, 3], "must have rank 2"),
    ([[1, 2], [3]], "ragged"),
])
def test_bad_ids_are_refused_everywhere(llama, ids, message):
  with pytest.raises(GSIError, match=message):
    llama.logits(llama.params, ids)
  if message == "ragged":  # generate takes rows of different lengths, padded on the left
    assert np.asarray(llama.generate(llama.params, ids, 2)).shape[0] == 2
  else:
    with pytest.raises(GSIError, match=message):
      llama.generate(llama.params, ids, 2)
  with pytest.raises(GSIError, match=message):
    gsi_jax.metrics.score(llama, llama.params, ids)


def test_bad_calibration_ids_are_refused(llama):
  with pytest.raises(GSIError, match="outside the vocabulary"):
    gsi_jax.calibrate(llama, llama.params, CALIB + 100, 8, seq_len=16, progress=False)
  with pytest.raises(GSIError, match="integer token ids"):
    gsi_jax.calibrate(llama, llama.params, CALIB.astype(np.float32), 8, seq_len=16,
                      progress=False)


@pytest.mark.parametrize("kwargs, message", [
    ({"max_new_tokens": 2.5}, "max_new_tokens must be a whole number, got 2.5"),
    ({"max_new_tokens": 0}, "max_new_tokens must be >= 1, got 0"),
    ({"max_new_tokens": 2, "gate": 0.5}, "gate must be a gsi_jax.ops.Gate"),
    ({"max_new_tokens": 10**12}, "a KV cache for 1 x .* tokens needs .* GiB"),
])
def test_bad_generate_arguments_are_refused(llama, kwargs, message):
  with pytest.raises(GSIError, match=message):
    llama.generate(llama.params, [[1, 2]], **kwargs)


@pytest.mark.parametrize("bad", [4.5, 4.0, True, "4", None])
def test_whole_number_arguments_refuse_floats_bools_and_strings(llama, bad):
  """int() would take k=4.5 as 4 and k=True as 1: every rank, count and layer argument of
  the public API refuses what is not a whole number, and names the argument."""
  bases = gsi_jax.calibrate(llama, llama.params, CALIB, 8, seq_len=16, progress=False)
  gsi = gsi_jax.apply_gsi(llama.params, bases, 4)
  layer, site = next((l, s) for l, sites in bases.vectors.items() for s in sites)
  calls = {
      "k": lambda: gsi_jax.apply_gsi(llama.params, bases, bad),
      "output_sketch": lambda: gsi_jax.apply_gsi(llama.params, bases, 4, output_sketch=bad),
      "ladder rank": lambda: gsi_jax.apply_gsi(llama.params, bases, 4, ladder=(bad,)),
      f"{layer}/{site}: rank": lambda: gsi_jax.truncate_ranks(gsi, {layer: {site: bad}}),
      "k_max": lambda: gsi_jax.calibrate(llama, llama.params, CALIB, bad, seq_len=16),
      "seq_len": lambda: gsi_jax.calibrate(llama, llama.params, CALIB, 8, seq_len=bad),
      "batch_size": lambda: gsi_jax.calibrate(llama, llama.params, CALIB, 8, seq_len=16,
                                              batch_size=bad),
      "head k": lambda: gsi_jax.head_basis(llama, llama.params, CALIB.reshape(-1, 16), bad),
      "max_new_tokens": lambda: llama.generate(llama.params, [[1, 2]], bad),
      "n_layers": lambda: gsi_jax.load_model(llama.source, n_layers=bad),
      "SVD rank": lambda: peers.svd_truncate(llama.params, {}, bad),
      "R-Sparse rank": lambda: peers.weight_factors(llama.params, bad, svds={}),
  }
  for name, call in calls.items():
    if bad is None and name == "n_layers":  # None: every layer
      continue
    with pytest.raises(GSIError, match=re.escape(f"{name} must be a whole number, got {bad!r}")):
      call()


# Experiment settings fail before any compute.

def _config(tmp_path, **kw):
  from gsi_jax.experiment import ExperimentConfig
  return ExperimentConfig(**{"bases_dir": "", "out": str(tmp_path / "out.json"), **kw})


def test_text_sources_are_read_and_checked_up_front(tmp_path):
  fifo = tmp_path / "fifo"
  os.mkfifo(fifo)
  empty, latin = tmp_path / "empty.txt", tmp_path / "latin.txt"
  empty.write_text("  \n")
  latin.write_bytes("caf\xe9".encode("latin-1"))
  for source, message in ((str(fifo), "not a regular file"), ("/dev/null", "not a regular file"),
                          (str(empty), "is empty"), (str(latin), "not UTF-8"),
                          ("hf:wikitext/only-two", "hf:dataset/config/split"),
                          (str(tmp_path / "absent.txt"), "text file not found")):
    with pytest.raises(GSIError, match=f"--calib_text_file: .*{message}|{message}"):
      _config(tmp_path, calib_text_file=source)


@pytest.mark.parametrize("kw, message", [
    ({"out": "results/table.md"}, "must end in .json"),
    ({"out": "x" * 250 + ".json"}, "too long"),
    ({"k": (8, 8)}, "--k repeats a value"),
    ({"eps": (0.1, 0.1)}, "--eps repeats a value"),
    ({"mode": ()}, "--mode is empty"),
    ({"k": (64,), "calib_tokens": 64, "seq_len": 32}, "--k=64 needs more than 64 calibration"),
])
def test_bad_experiment_settings_are_refused(tmp_path, kw, message):
  if "out" in kw:
    kw = {**kw, "out": str(tmp_path / kw["out"])}
  with pytest.raises(GSIError, match=message):
    _config(tmp_path, **kw)


def test_outputs_and_caches_behind_broken_links_or_folders_are_refused(tmp_path):
  (tmp_path / "table.md").mkdir()
  with pytest.raises(GSIError, match="table.md, where the table or figure goes, is a folder"):
    _config(tmp_path, out=str(tmp_path / "table.json"))
  link = tmp_path / "link"
  link.symlink_to(tmp_path / "nowhere")
  for kw in ({"bases_dir": str(link / "bases")}, {"out": str(link / "x.json")},
             {"calib_text_file": str(link)}):
    with pytest.raises(GSIError, match="is a broken symbolic link"):
      _config(tmp_path, **kw)


INTERRUPTED = """
import os
from gsi_jax import cli
from gsi_jax.gsi import calibration
cli.define_experiment_flags()
def main(argv):
  if os.environ["CALIBRATING"]:  # interrupted while a calibration wrote its layers there
    calibration.RESUMABLE.add(os.environ["CALIBRATING"])
  raise KeyboardInterrupt
cli.run(main)
"""


@pytest.mark.parametrize("calibrating, message", [
    ("/tmp/some/cache/m-layers-k8", "interrupted: the calibrated layers are kept in "
                                    "/tmp/some/cache/m-layers-k8 and the same command "
                                    "resumes after them"),
    ("", "interrupted: nothing partial was written (outputs are written whole)"),
])
def test_ctrl_c_ends_with_one_line(calibrating, message):
  """Layers are said to be kept only where a calibration was running (the bases cache
  alone is no calibration)."""
  proc = subprocess.run([sys.executable, "-c", INTERRUPTED, "--bases_dir=/tmp/some/cache"],
                        capture_output=True, text=True, cwd=ROOT, timeout=120,
                        env={**os.environ, "JAX_PLATFORMS": "cpu", "CALIBRATING": calibrating})
  assert proc.returncode == 130
  # Beside absl's INFO lines (the device the run is on), that one line and nothing else.
  assert [l for l in proc.stderr.strip().splitlines() if not ABSL_INFO.match(l)] == [message]


INTERRUPTED_IN_A_GC_CALLBACK = """
import gc, os, signal, sys, time
from gsi_jax import cli
cli.define_experiment_flags()
def signalled_in_a_callback(phase, info):
  if phase == "start" and not getattr(signalled_in_a_callback, "done", False):
    signalled_in_a_callback.done = True
    signal.raise_signal(signal.SIG{name})  # its handler runs here, inside gc
def main(argv):
  gc.callbacks.append(signalled_in_a_callback)
  gc.collect()
  time.sleep(30)
  print("not interrupted", file=sys.stderr)
cli.run(main)
"""


INTERRUPT_DROPPED = """
import signal, sys, time
from gsi_jax import cli
cli.define_experiment_flags()
def main(argv):
  try:
    signal.raise_signal(signal.SIG{name})
  except BaseException:  # as native code that drops a Python error does
    pass
  time.sleep(30)
  print("not interrupted", file=sys.stderr)
cli.run(main)
"""


@pytest.mark.parametrize("script", [INTERRUPTED_IN_A_GC_CALLBACK, INTERRUPT_DROPPED],
                         ids=["in a gc callback", "dropped"])
@pytest.mark.parametrize("name, status", [("INT", 130), ("TERM", 143)])
def test_a_signal_whose_interrupt_is_lost_still_interrupts(script, name, status):
  """Python only reports an exception raised in a gc callback (jax runs one at every
  collection), and native code may drop one: the interrupt is raised again until the run
  takes it, and the run ends as for any signal."""
  proc = subprocess.run([sys.executable, "-c", script.replace("{name}", name),
                         "--bases_dir="], capture_output=True, text=True, cwd=ROOT,
                        timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert proc.returncode == status, proc.stderr[-2000:]
  assert [l for l in proc.stderr.strip().splitlines() if not ABSL_INFO.match(l)] == [
      "interrupted: nothing partial was written (outputs are written whole)"]


# One bad value a flag of each kind must refuse: a size of inf, a count below zero, a list
# with a digit that str.isdigit takes and int() refuses.
BAD_VALUE = {"float": "inf", "integer": "-1", "list": "1,\u00b2"}
# What a script needs beside the bad flag to get as far as checking it.
BENCHMARK_ARGS = {"scale.py": ["--in_memory"], "make_checkpoint.py": ["--out={tmp}/ckpt"]}
SEED_FLAGS = {("make_checkpoint.py", "seed")}  # any integer seeds a generator


def _benchmark_number_flags():
  for script in sorted(os.listdir(os.path.join(ROOT, "benchmarks"))):
    if script.endswith(".py"):
      source = Path(ROOT, "benchmarks", script).read_text()
      for kind, name in re.findall(r'DEFINE_(integer|float|list)\(\s*"(\w+)"', source):
        if (script, name) not in SEED_FLAGS:
          yield script, name, kind


@pytest.mark.parametrize("script, name, kind", list(_benchmark_number_flags()))
def test_every_benchmark_flag_is_refused_in_one_line_before_compute(tmp_path, script, name,
                                                                    kind):
  """Benchmarks check their flags as experiments do: each number, count and list flag with
  a bad value ends the run with exit 2 and one error line naming it, before any compute."""
  extra = [a.format(tmp=tmp_path) for a in BENCHMARK_ARGS.get(script, [])]
  if not any(a.startswith("--out=") for a in extra):
    extra.append(f"--out={tmp_path / 'out.json'}")
  proc = subprocess.run(
      [sys.executable, os.path.join("benchmarks", script), f"--{name}={BAD_VALUE[kind]}",
       *extra], capture_output=True, text=True, cwd=ROOT, timeout=120,
      env={**os.environ, "JAX_PLATFORMS": "cpu"})
  said = [l for l in proc.stderr.splitlines() if l.startswith("error:")]
  assert proc.returncode == 2 and len(said) == 1 and f"--{name}" in said[0], proc.stderr[-2000:]
  assert "Traceback" not in proc.stderr
  assert not os.listdir(tmp_path)


def test_the_tests_never_write_the_users_bases_cache():
  """conftest points every test, and every script a test starts, at a cache of its own."""
  from gsi_jax.gsi import cache
  own = os.path.join(ROOT, ".cache", "test-bases")
  assert cache.DEFAULT_BASES_DIR == own == os.environ["GSI_JAX_BASES_DIR"]
