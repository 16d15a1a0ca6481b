#!/usr/bin/env bash
# Everything worth measuring on a lent GPU, in one run of at most 540 s, 9.0 minutes (the
# device line 30 s, the seven steps' limits 490 s, and the summary 20 s), the kernel and
# whole-decode steps first, on the machine's own image with nothing installed:
#     PYTHONPATH=. python3 ...   is how each step runs; from the repository root:
#     bash benchmarks/gpu_check.sh
#     GPU_CHECK_DRY=1 bash benchmarks/gpu_check.sh    # small shapes on the CPU
#   The dry run's steps took 121 s on an idle 2-core AMD EPYC (its summary, committed as
#   results/benchmarks/gpu_check_dry.json: the steps' seconds summed); a loaded machine
#   takes longer, and each step's limit is 4x the GPU's there.
# Each step runs on its own under a time limit, so one that fails hides none of the others;
# each leaves a log.  Writes to ${OUT:-results/benchmarks/gpu} (dry: ${OUT:-/tmp/gpu_check_dry}),
# first removing what an earlier run's steps left there, and ends with gpu_summary.json
# there, made from this run's files alone, whose bandwidth shares are of the read ceiling
# that step 1 measures.  Exit status 0 only when every step and the summary passed; else 1,
# with one `error:` line naming the failed steps (2: the output folder cannot be written).
# PYTHON: the interpreter; else the checkout's .venv/bin/python where `make` built one, else
# python3 (the lent image, which has jax and installs nothing).  The first line says which.
set -uo pipefail
DRY=${GPU_CHECK_DRY:-0}
if [ -n "${PYTHON:-}" ]; then
  PY=$PYTHON; PY_WHY="PYTHON"
elif [ -x .venv/bin/python ]; then
  PY=.venv/bin/python; PY_WHY="this checkout's .venv"
else
  PY=python3; PY_WHY="no .venv here"
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# Several processes may touch the GPU (pytest, each step): none takes 75% of it up front.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
if [ "$DRY" = 1 ]; then
  OUT_DIR=${OUT:-/tmp/gpu_check_dry}
  export JAX_PLATFORMS=cpu
  KERNEL=(--dry)
  DECODE=(--dry)
  SCALE=(--shape gptj-tiny --calib_tokens 256 --seq_len 64 --k 16 --decode_layers 0)
else
  OUT_DIR=${OUT:-results/benchmarks/gpu}
  KERNEL=()
  DECODE=()
  SCALE=(--shape gptj-6b --calib_tokens 2048 --seq_len 256 --k 256 --decode_layers 0)
fi
if ! mkdir -p "$OUT_DIR" 2> /dev/null || [ ! -w "$OUT_DIR" ]; then
  echo "error: gpu_check cannot write to its output folder $OUT_DIR; set OUT to a writable folder" >&2
  exit 2
fi
echo "gpu_check: python $PY ($PY_WHY)"
# An earlier run's files would read as this run's: remove each step's JSON and log first.
STEP_NAMES=(kernel_check kernel_timing kernel_kept decode kernel_tests kernel_tiles scale)
for name in "${STEP_NAMES[@]}"; do rm -f "$OUT_DIR/$name.log"; done
rm -f "$OUT_DIR"/{kernel_check,kernel_timing,kernel_tiles,kernel_kept,gpu_decode,scale_gptj_6b,gpu_summary}.json \
  "$OUT_DIR/gpu.txt"
: > "$OUT_DIR/steps.txt"
FAILED=()
{ command -v nvidia-smi > /dev/null && timeout 10 nvidia-smi --query-gpu=name,memory.total --format=csv
  timeout 20 $PY -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, jax.devices())"
} 2>&1 | tee "$OUT_DIR/gpu.txt"

# Ctrl-C or SIGTERM: end the running step's whole process group (timeout leads its own),
# write no summary, and exit 130 or 143.  Each step runs in the background and is waited
# for, so that the trap runs at once rather than after the step.
STEP_PID=
interrupted() {
  local status=$1
  trap - INT TERM
  if [ -n "$STEP_PID" ]; then
    kill -TERM -- "-$STEP_PID" 2> /dev/null || kill -TERM "$STEP_PID" 2> /dev/null
    wait "$STEP_PID" 2> /dev/null
  fi
  echo "interrupted: gpu_check ended during a step; the steps that finished kept their JSON and" \
    "log in $OUT_DIR (steps.txt lists them), and no summary was written" >&2
  exit "$status"
}
trap 'interrupted 130' INT
trap 'interrupted 143' TERM

step() {  # step NAME LIMIT_S COMMAND...: run, log, record `name exit_status seconds`
  local name=$1 limit=$2 start rc
  shift 2
  [ "$DRY" = 1 ] && limit=$((limit * 4))  # a CPU interprets the kernels: the limits are a GPU's
  start=$(date +%s)
  timeout "$limit" "$@" > "$OUT_DIR/$name.log" 2>&1 &
  STEP_PID=$!
  wait "$STEP_PID"
  rc=$?
  STEP_PID=
  echo "$name $rc $(( $(date +%s) - start ))" >> "$OUT_DIR/steps.txt"
  echo "== $name: exit $rc"; tail -n 3 "$OUT_DIR/$name.log"
  [ "$rc" = 0 ] || FAILED+=("$name")
}

# 1. The read ceiling (a sum over 2 GiB and a copy, by wall clock and by device events) and
#    the launch floor, then the kernel against its HIGHEST reference at GPT-J's maps,
#    float32 and bfloat16, 1/16/256 tokens, slow/mixed/fast.
step kernel_check 60 $PY benchmarks/gpu_kernel.py "${KERNEL[@]}" --parts ceiling,correct \
    --out "$OUT_DIR/kernel_check.json"
# 2. A gated site's calls (g = x V_k and the kernel) beside dense x @ W at GPT-J's three map
#    shapes (fc_in first), bf16, cache-cold (copies of W, and of V_k and M, each exceed 4x
#    L2), 1, 4 and 16 tokens, all slow, half and all fast: paired rounds, device times.
#    Every step's JSON is rewritten after each row: a step cut short keeps its rows.
step kernel_timing 60 $PY benchmarks/gpu_kernel.py "${KERNEL[@]}" --parts timing \
    $([ "$DRY" = 1 ] || echo --tokens 1,4,16) \
    --out "$OUT_DIR/kernel_timing.json"
# 3. The kept-rows kernel (sparsity's product), then the kept-dots kernel (CATS' up
#    projection), each beside dense x @ W at GPT-J's fc_in, bf16, cache-cold, 1, 4 and 16
#    tokens, kept shares 0, 0.5 and 1: paired rounds, and each one's error.
step kernel_kept 40 $PY benchmarks/gpu_kernel.py "${KERNEL[@]}" --parts kept \
    $([ "$DRY" = 1 ] || echo --maps 4096x16384 --tokens 1,4,16) \
    --out "$OUT_DIR/kernel_kept.json"
# 4. A whole decode at GPT-J-6B's shape, full depth, bf16 weights made on the device, 1, 4
#    and 16 sequences: GSI static, fast with probability 0.9 and 0.5, at eps = 0, and
#    sparsity at half, each beside dense in paired rounds (batch 1 first).
step decode 150 $PY benchmarks/gpu_decode.py "${DECODE[@]}" --out "$OUT_DIR/gpu_decode.json"
# 5. The compiled kernel's own tests: interpret-mode cases, the tied head, GPT-J's maps.
step kernel_tests 50 $PY -m pytest -q -p no:cacheprovider tests/test_kernels.py -k TestCompiledOnGPU
# 6. Decode tiles (block_o x block_d x warps) at 1 token, all slow and all fast.
step kernel_tiles 25 $PY benchmarks/gpu_kernel.py "${KERNEL[@]}" --parts tiles \
    $([ "$DRY" = 1 ] || echo --maps 4096x16384) --out "$OUT_DIR/kernel_tiles.json"
# 7. GPT-J-6B's shape at full depth, bf16 random weights generated on the device (nothing on
#    disk): streaming calibration (cascade) against the paper's ~30 s, with where its time
#    went (calibration_phase_s, compiling apart) and the programs it compiled.  Step 4 is
#    the decode.
step scale 105 $PY benchmarks/scale.py --in_memory "${SCALE[@]}" --dtype bfloat16 \
    --method cascade --eigh_layers 0 --out "$OUT_DIR/scale_gptj_6b.json"
timeout 20 $PY benchmarks/gpu_summary.py --dir "$OUT_DIR" || FAILED+=(summary)
if [ ${#FAILED[@]} -gt 0 ]; then
  echo "error: gpu_check: ${#FAILED[@]} failed (${FAILED[*]}); their logs: $OUT_DIR/NAME.log," \
    "their status: $OUT_DIR/steps.txt" >&2
  exit 1
fi
echo "gpu_check done, every step passed: $OUT_DIR/gpu_summary.json"
