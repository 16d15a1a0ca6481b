#!/usr/bin/env bash
# Everything worth measuring on a lent GPU, in one run of at most 360 s, 6.0 minutes (the
# device line 5 s, the nine steps' limits 345 s, and the summary 10 s), so that a rerun
# still fits in 15 minutes with the machine's start; the steps in the order of what they
# decide, on the machine's own image with nothing installed:
#     PYTHONPATH=. python3 ...   is how each step runs; from the repository root:
#     bash benchmarks/gpu_check.sh
#     GPU_CHECK_DRY=1 bash benchmarks/gpu_check.sh    # small shapes on the CPU
#   The dry run's steps took 105 s on an idle 2-core AMD EPYC (its summary, committed as
#   results/benchmarks/gpu_check_dry.json: the steps' seconds summed); in the dry run each
#   step's limit is 4x the GPU's.
# Each step's limit comes with its basis (limits.txt, then gpu_summary.json): the previous
# H200 run's measured times (results/benchmarks/gpu: a step's process started in 6-7 s, its
# steps.txt less its logged span) or the deviceless compile's (gpu_launches.json).
# Not run, for time: the compiled kernel's test file (tests/test_kernels.py -k
# TestCompiledOnGPU) and the decode-tile sweep (gpu_kernel.py --parts tiles).
# Each step runs on its own under its limit, so one that fails hides none of the others;
# each leaves a log, and every step's script rewrites its JSON after each row, method or
# layer, so a step cut short keeps what it measured.  Writes to ${OUT:-results/benchmarks/gpu}
# (dry: ${OUT:-/tmp/gpu_check_dry}), first removing what an earlier run's steps left there,
# and ends with gpu_summary.json there, made from this run's files alone, whose bandwidth
# shares are of the read ceiling that the smoke step measures.  Exit status 0 only when
# every step and the summary passed; else 1, with one `error:` line naming the failed
# steps (2: the output folder cannot be written).
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
  DECODE=(--layers 4)  # identical blocks: per-layer time, extrapolated to 28 in the summary
  SCALE=(--shape gptj-6b --layers 4 --calib_tokens 2048 --seq_len 256 --k 256 --decode_layers 0)
fi
# Command buffers (CUDA graphs) off for one process: an empty list of command types.
NO_COMMAND_BUFFERS="--xla_gpu_enable_command_buffer= ${XLA_FLAGS:-}"
if ! mkdir -p "$OUT_DIR" 2> /dev/null || [ ! -w "$OUT_DIR" ]; then
  echo "error: gpu_check cannot write to its output folder $OUT_DIR; set OUT to a writable folder" >&2
  exit 2
fi
echo "gpu_check: python $PY ($PY_WHY)"
# An earlier run's files would read as this run's: remove each step's JSON and log first.
STEP_NAMES=(smoke launch_floor launch_floor_off decode_off decode kernel_timing kernel_kept
            kernel_check scale)
for name in "${STEP_NAMES[@]}"; do rm -f "$OUT_DIR/$name.log"; done
rm -f "$OUT_DIR"/{smoke,launch_floor,launch_floor_off,gpu_decode_off,gpu_decode,kernel_check}.json \
  "$OUT_DIR"/{kernel_timing,kernel_tiles,kernel_kept,scale_gptj_6b,gpu_summary}.json "$OUT_DIR/gpu.txt"
: > "$OUT_DIR/steps.txt"
: > "$OUT_DIR/limits.txt"
FAILED=()
{ command -v nvidia-smi > /dev/null && timeout 5 nvidia-smi --query-gpu=name,memory.total --format=csv
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

step() {  # step NAME LIMIT_S BASIS COMMAND...: run, log, record `name exit_status seconds`
  local name=$1 limit=$2 basis=$3 start rc
  shift 3
  echo "$name $limit $basis" >> "$OUT_DIR/limits.txt"
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

# 1. Smoke: devices and versions, whether one tiny profiler trace parses, and the read
#    ceiling (a sum over 2 GiB and a copy, by wall clock and by device events).  A trace
#    that does not parse (or a failed step) sends every later step to the wall clock.
step smoke 20 "a 6-7 s start and the 2 GiB ceiling (not timed apart on the H200); 20 s is the bound asked" \
    $PY benchmarks/gpu_kernel.py "${KERNEL[@]}" --parts smoke --out "$OUT_DIR/smoke.json"
if ! grep -q '"trace_parses": true' "$OUT_DIR/smoke.json" 2> /dev/null; then
  KERNEL+=(--notraces)
  echo "traces: the smoke step's trace did not parse; every later step times by wall clock"
fi
# 2. What a kernel costs inside a decode's command buffer, and outside one: the launch floor
#    (64 dependent one-block calls, a Pallas kernel and an XLA fusion, unrolled in one jit)
#    with command buffers on, then off in a second process; dense and GSI static decoded at
#    4 layers with them off (step 4 decodes them on).  gpu_summary fits t = bytes/bandwidth
#    + kernels x c to both, the kernels from the deviceless compile at 4 layers.
step launch_floor 15 "a 6-7 s start and 2 programs of 64 one-block calls" \
    $PY benchmarks/gpu_kernel.py "${KERNEL[@]}" --parts floor --out "$OUT_DIR/launch_floor.json"
step launch_floor_off 15 "as launch_floor" env XLA_FLAGS="$NO_COMMAND_BUFFERS" \
    $PY benchmarks/gpu_kernel.py "${KERNEL[@]}" --parts floor \
    --out "$OUT_DIR/launch_floor_off.json"
step decode_off 30 "a 6-7 s start, the 4-layer model, 2 programs compiled (deviceless: gpu_launches.json fit)" \
    env XLA_FLAGS="$NO_COMMAND_BUFFERS" $PY benchmarks/gpu_decode.py "${DECODE[@]}" --batch 1 \
    --methods gsi_static --out "$OUT_DIR/gpu_decode_off.json"
# 3. A whole decode at GPT-J-6B's shape cut to 4 identical layers (bf16 weights made on the
#    device): 1 sequence first, then 4 and 16, GSI static, fast with probability 0.9 and
#    0.5, at eps = 0, and sparsity at half, each beside dense in paired rounds, the JSON
#    written after each method with its compile time.
step decode 90 "batch 1 first: a 6-7 s start, 6 programs compiled (deviceless: gpu_launches.json fit); 4 and 16 as time remains" \
    $PY benchmarks/gpu_decode.py "${DECODE[@]}" --out "$OUT_DIR/gpu_decode.json"
# 4. A gated site's calls (g = x V_k and the kernel) beside dense x @ W at GPT-J's three map
#    shapes, bf16, cache-cold, one token all slow and all fast (the all-fast call again as a
#    chain of dependent sites), with device times; then the kept-rows and kept-dots kernels
#    beside dense at fc_in, 1 and 16 tokens, kept shares 0, 0.5 and 1, with their errors.
step kernel_timing 25 "the H200 run timed 27 calls in 28 s after its start; these are 9" \
    $PY benchmarks/gpu_kernel.py "${KERNEL[@]}" --parts timing \
    $([ "$DRY" = 1 ] || echo --tokens 1 --fast_share 0,1) --out "$OUT_DIR/kernel_timing.json"
step kernel_kept 25 "the H200 run timed 18 kept calls in 21 s after its start; these are 12" \
    $PY benchmarks/gpu_kernel.py "${KERNEL[@]}" --parts kept \
    $([ "$DRY" = 1 ] || echo --maps 4096x16384 --tokens 1,16) --out "$OUT_DIR/kernel_kept.json"
# 5. Correctness of a representative subset: the kernel against its HIGHEST reference at
#    each of GPT-J's maps and each regime (1 token slow and fast, 16 and 256 mixed), bf16.
step kernel_check 25 "the H200 run checked the ceiling and 39 cases in 60 s, start included; these are 12" \
    $PY benchmarks/gpu_kernel.py "${KERNEL[@]}" --parts correct --correct_cases representative \
    --out "$OUT_DIR/kernel_check.json"
# 6. Streaming calibration (cascade) of GPT-J-6B's shape cut to 4 layers, bf16 random weights
#    generated on the device, with where its time went (phases, compiling apart) and the
#    programs it compiled, the JSON written after each layer.
step scale 100 "the H200 run: a 5 s load, its first layer 76.9 s (compiling in it), 2.3 s a layer after: 96 s with the start" \
    $PY benchmarks/scale.py --in_memory "${SCALE[@]}" --dtype bfloat16 \
    --method cascade --eigh_layers 0 --out "$OUT_DIR/scale_gptj_6b.json"
timeout 10 $PY benchmarks/gpu_summary.py --dir "$OUT_DIR" || FAILED+=(summary)
if [ ${#FAILED[@]} -gt 0 ]; then
  echo "error: gpu_check: ${#FAILED[@]} failed (${FAILED[*]}); their logs: $OUT_DIR/NAME.log," \
    "their status: $OUT_DIR/steps.txt" >&2
  exit 1
fi
echo "gpu_check done, every step passed: $OUT_DIR/gpu_summary.json"
