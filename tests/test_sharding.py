"""Sharded (V_k, M, W) inference equals the unsharded run, on 4 forced host devices."""

import os
import subprocess
import sys
import textwrap

from tests.conftest import with_xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = textwrap.dedent("""
    import sys
    import jax, numpy as np
    assert len(jax.devices()) == 4, jax.devices()
    import gsi_jax
    from gsi_jax.runtime.sharding import make_mesh, shard_params
    from tests import hf_models
    folder = sys.argv[1]
    hf_models.save("llama_gqa", folder)
    model = gsi_jax.load_model(folder)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 101, (8, 16)).astype(np.int32)
    bases = gsi_jax.calibrate(model, model.params, ids, 16, seq_len=16, progress=False)
    params = gsi_jax.apply_gsi(model.params, bases, 12)
    gate = gsi_jax.make_gate(0.6)
    mesh = make_mesh(4)
    sharded = shard_params(params, mesh)
    W = sharded["layer_0"]["mlp_in"]["kernel"]["gate"]
    assert len(W.sharding.device_set) == 4 and W.addressable_shards[0].data.shape == (48, 16)
    assert sharded["layer_0"]["mlp_in"]["V"].sharding.is_fully_replicated
    assert len(sharded["layer_0"]["mlp_in"]["M"]["gate"].sharding.device_set) == 4
    want = np.asarray(model.logits(params, ids[:2], gate))
    got = np.asarray(model.logits(sharded, ids[:2], gate))
    np.testing.assert_allclose(got, want, atol=1e-5)
    a = np.asarray(model.generate(params, ids[:2, :4], 8, gate))
    b = np.asarray(model.generate(sharded, ids[:2, :4], 8, gate))
    np.testing.assert_array_equal(a, b)
    print("SHARDED_OK")
""")


def test_sharded_equals_unsharded(tmp_path):
  env = {**with_xla_flags("--xla_force_host_platform_device_count=4"), "JAX_PLATFORMS": "cpu",
         "PYTHONPATH": ROOT}
  proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True,
                        text=True, env=env, cwd=ROOT)
  assert "SHARDED_OK" in proc.stdout, proc.stderr[-3000:]
