#!/usr/bin/env bash
# Everything worth measuring on a GPU, in one run of at most 10 minutes (the step limits sum
# to 570 s).  From the repository root, on a machine with a CUDA GPU and JAX's CUDA plugin:
#     bash benchmarks/gpu_check.sh
# Each step runs on its own, so one that fails hides none of the others; each leaves a log.
# Writes to ${OUT:-results/benchmarks/gpu} and ends with gpu_summary.json there.
# PEAK_GB_S is the GPU's HBM bandwidth (default 4800: an H200); SCALE_CKPT the folder of the
# random GPT-J-6B-shaped checkpoint (written there first when missing: 12 GB).
set -uo pipefail
OUT_DIR=${OUT:-results/benchmarks/gpu}
PEAK=${PEAK_GB_S:-4800}
PY=${PYTHON:-python3}
mkdir -p "$OUT_DIR"
: > "$OUT_DIR/steps.txt"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,memory.total,clocks.max.memory --format=csv
  $PY -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, jax.devices())"
} 2>&1 | tee "$OUT_DIR/gpu.txt"

step() {  # step NAME LIMIT_S COMMAND...: run, log, record `name exit_status seconds`
  local name=$1 limit=$2 start rc
  shift 2
  start=$(date +%s)
  timeout "$limit" "$@" > "$OUT_DIR/$name.log" 2>&1
  rc=$?
  echo "$name $rc $(( $(date +%s) - start ))" >> "$OUT_DIR/steps.txt"
  echo "== $name: exit $rc"; tail -n 3 "$OUT_DIR/$name.log"
}

# 1. Lowering: every paper shape and the model paths for cuda, rocm and tpu, and the compiled
#    binaries' resources (these pass on a CPU too; here they check this machine's JAX).
step lowering 120 $PY -m pytest -q -n 8 tests/test_gpu_lowering.py tests/test_gpu_binaries.py
# 2. The compiled kernel on this GPU against its reference: every interpret-mode case, the
#    tied head, and GPT-J's maps at 1, 16 and 256 tokens in bf16.
step kernel 90 $PY -m pytest -q tests/test_kernels.py -k TestCompiledOnGPU
# 3. One batch-1 map at GPT-J's shapes, bf16, cache-cold (8 distinct copies, 2 GB of W for
#    fc_in): the kernel's GB/s at fast shares 0, 0.5 and 1 beside dense XLA.
step linear 80 $PY benchmarks/linear.py --impl pallas --dtype bfloat16 --d 4096 \
    --d_out 4096,16384 --k 256 --fast_share 0,0.5,1 --tokens 256 --copies 8 \
    --out "$OUT_DIR/linear_pallas_bf16.json"
# 4. Paper scale: GPT-J-6B's shape at full depth in bf16 (random weights): streaming
#    calibration (cascade) against the paper's ~30 s, then decode through the kernel, dense
#    XLA in the same process, with each one's share of the HBM peak.
step scale 270 $PY benchmarks/scale.py --shape gptj-6b \
    --checkpoint "${SCALE_CKPT:-/tmp/gptj-6b-random}" --impl pallas --dtype bfloat16 \
    --decode_dtype bfloat16 --decode_layers 28 --k 256 --decode_k 256 --method cascade \
    --eigh_layers 0 --calib_tokens 2048 --new_tokens 32 --peak_bandwidth_gb_s "$PEAK" \
    --out "$OUT_DIR/scale_gptj_6b.json"
timeout 10 $PY benchmarks/gpu_summary.py --dir "$OUT_DIR" --peak_bandwidth_gb_s "$PEAK"
echo "gpu_check done: $OUT_DIR/gpu_summary.json"
