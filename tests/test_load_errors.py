"""Bad sources raise GSIError with a message that names the problem."""

import json
import os
import shutil

import pytest

import gsi_jax
from gsi_jax import GSIError
from gsi_jax.loading.load import PRESETS, _package_file


def test_unknown_preset():
  with pytest.raises(GSIError, match="unknown model 'no-such-model'"):
    gsi_jax.load_model("no-such-model")


def test_missing_path(tmp_path):
  with pytest.raises(GSIError, match="no such file or folder"):
    gsi_jax.load_model(str(tmp_path / "absent.gguf"))


def test_not_gguf(tmp_path):
  path = tmp_path / "model.gguf"
  path.write_bytes(b"not a gguf file at all")
  with pytest.raises(GSIError, match="not a GGUF file"):
    gsi_jax.load_model(str(path))


@pytest.mark.parametrize("keep", [100_000, 50_000_000])
def test_truncated_gguf(tmp_path, keep):
  """Cut in the metadata, and cut in the tensor data."""
  path = tmp_path / "cut.gguf"
  with open(_package_file(PRESETS["smollm2-135m"]), "rb") as f:
    path.write_bytes(f.read(keep))
  with pytest.raises(GSIError, match="truncated"):
    gsi_jax.load_model(str(path))


def tiny_with(tiny_folder, tmp_path, name, **overrides):
  """A copy of a tiny model whose config.json has `overrides`."""
  folder, _ = tiny_folder(name)
  dst = tmp_path / "model"
  shutil.copytree(folder, dst)
  config = json.loads((dst / "config.json").read_text())
  config.update(overrides)
  (dst / "config.json").write_text(json.dumps(config))
  return str(dst)


def test_unsupported_architecture(tiny_folder, tmp_path):
  with pytest.raises(GSIError, match="model_type 'bert' is not supported"):
    gsi_jax.load_model(tiny_with(tiny_folder, tmp_path, "gpt2", model_type="bert"))


def test_unsupported_config_value(tiny_folder, tmp_path):
  with pytest.raises(GSIError, match="scale_attn_by_inverse_layer_idx=True"):
    gsi_jax.load_model(tiny_with(tiny_folder, tmp_path, "gpt2",
                                  scale_attn_by_inverse_layer_idx=True))


def test_unsupported_rope_type(tiny_folder, tmp_path):
  with pytest.raises(GSIError, match="rope type 'yarn'"):
    gsi_jax.load_model(tiny_with(tiny_folder, tmp_path, "llama_mha",
                                  rope_parameters={"rope_type": "yarn", "rope_theta": 1e4}))


def test_unknown_config_attribute(tiny_folder, tmp_path):
  with pytest.raises(GSIError, match="does not know: \\['qk_layernorm'\\]"):
    gsi_jax.load_model(tiny_with(tiny_folder, tmp_path, "llama_gqa", qk_layernorm=True))


def test_missing_tensor(tiny_folder, tmp_path):
  from safetensors.torch import load_file, save_file
  folder = tiny_with(tiny_folder, tmp_path, "opt")
  state = load_file(f"{folder}/model.safetensors")
  del state["model.decoder.layers.1.fc2.weight"]
  save_file(state, f"{folder}/model.safetensors")
  with pytest.raises(GSIError, match="no tensor 'decoder.layers.1.fc2.weight'"):
    gsi_jax.load_model(folder)


def test_wrong_shape(tiny_folder, tmp_path):
  folder = tiny_with(tiny_folder, tmp_path, "gptj", n_inner=64)
  with pytest.raises(GSIError, match="mlp.fc_in.weight has shape"):
    gsi_jax.load_model(folder)


def test_hub_id_offline_fails_clearly(monkeypatch):
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")
  with pytest.raises(GSIError, match="not in the local cache"):
    gsi_jax.load_model("someone/not-cached-model")


@pytest.mark.parametrize("dtype", ["int8", "bogus", None])
def test_bad_dtype(dtype):
  with pytest.raises(GSIError, match=f"dtype {dtype!r} is not supported"):
    gsi_jax.load_model("smollm2-135m", dtype=dtype)


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", "\xff\xfe"])
def test_malformed_config_json(tiny_folder, tmp_path, content):
  folder = tiny_with(tiny_folder, tmp_path, "gpt2")
  with open(f"{folder}/config.json", "w", encoding="latin-1") as f:
    f.write(content)
  with pytest.raises(GSIError, match="config.json"):
    gsi_jax.load_model(folder)


@pytest.mark.parametrize("damage", ["truncate_header", "truncate_data", "garbage"])
def test_damaged_safetensors(tiny_folder, tmp_path, damage):
  folder = tiny_with(tiny_folder, tmp_path, "opt")
  path = f"{folder}/model.safetensors"
  data = open(path, "rb").read()
  data = {"truncate_header": data[:20], "truncate_data": data[:len(data) // 2],
          "garbage": b"\x00" * 1000}[damage]
  open(path, "wb").write(data)
  with pytest.raises(GSIError, match="truncated or damaged"):
    gsi_jax.load_model(folder)


def test_malicious_pickle_is_refused_and_never_run(tiny_folder, tmp_path):
  """A .bin whose unpickling would run code: one clear error, no weights_only=False advice."""
  import pickle
  import torch
  folder = tiny_with(tiny_folder, tmp_path, "gpt2")
  marker = tmp_path / "payload_ran"

  class Payload:
    def __reduce__(self):
      return (open, (str(marker), "w"))
  from safetensors.torch import load_file
  state = load_file(f"{folder}/model.safetensors")  # real weights, the payload among them
  os.remove(f"{folder}/model.safetensors")
  torch.save({**state, "wte.weight": Payload()}, f"{folder}/pytorch_model.bin",
             pickle_module=pickle)
  with pytest.raises(GSIError, match="never run") as info:
    gsi_jax.load_model(folder)
  assert "weights_only" not in str(info.value)
  assert not marker.exists()


def test_not_a_folder_or_file(tmp_path):
  with pytest.raises(GSIError, match="no such file or folder"):
    gsi_jax.load_model(str(tmp_path / "nothing" / "here"))


def test_without_gguf_only_the_gguf_loader_fails(tmp_path):
  """gsi_jax imports and builds models with the gguf package absent (a GPU image may lack
  it); reading a .gguf then says which package to install, in one line."""
  import subprocess
  import sys
  path = tmp_path / "model.gguf"
  path.write_bytes(b"GGUF" + bytes(64))
  script = (
      "import sys; sys.modules['gguf'] = None\n"  # `import gguf` now raises ImportError
      "import gsi_jax\n"
      "from gsi_jax.models import ModelConfig\n"
      "assert ModelConfig.gpt2_124m().d_model == 768\n"
      "try:\n"
      f"  gsi_jax.load_model({str(path)!r})\n"
      "except gsi_jax.GSIError as e:\n"
      "  print('refused:', e)\n")
  proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                        env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=120)
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout.startswith("refused: reading a .gguf file needs the gguf package")
  assert proc.stdout.count("\n") == 1
