#!/usr/bin/env bash
# What .ci/run costs on a fresh clone: each of its three make targets timed in turn, in a
# clone of this checkout's HEAD with an empty HOME (so pip's download cache, the compiled
# C++ kernels and the bases cache all start empty, as on a CI runner), on an otherwise idle
# machine.  Writes ${OUT:-results/benchmarks/ci_time.json}: each target's wall seconds and
# exit status, their sum, the commit and the machine.
#     bash benchmarks/ci_time.sh                 # about 40-60 minutes on 2 cores
# PY312: a Python 3.12 for make test-jax011 (default: the one on PATH).
set -uo pipefail
ROOT=$PWD
OUT=${OUT:-$ROOT/results/benchmarks/ci_time.json}
WORK=$(mktemp -d /tmp/gsi_jax-ci.XXXXXX)
# The one the Makefile would pick under the real HOME, which this script replaces (pyenv's
# shims need it): pyenv's 3.12, else python3.12 on PATH.
PY312=${PY312:-$(ls "$HOME"/.pyenv/versions/3.12*/bin/python3.12 2> /dev/null | head -n 1)}
PY312=${PY312:-$(command -v python3.12)}
if ! mkdir -p "$(dirname "$OUT")" 2> /dev/null || [ ! -w "$(dirname "$OUT")" ]; then
  echo "error: ci_time cannot write $OUT; set OUT to a writable path" >&2
  exit 2
fi
[ -x "$PY312" ] || { echo "error: ci_time needs Python 3.12 for make test-jax011; set PY312" >&2; exit 2; }
git clone -q "$ROOT" "$WORK/clone" || exit 1
mkdir -p "$WORK/home"
cd "$WORK/clone" || exit 1
: > "$WORK/times.txt"
for target in test test-multiprocess test-jax011; do
  start=$(date +%s.%N)
  HOME=$WORK/home make "$target" PY312="$PY312" > "$WORK/$target.log" 2>&1
  rc=$?
  echo "$target $rc $(echo "$(date +%s.%N) - $start" | bc)" | tee -a "$WORK/times.txt"
  tail -n 3 "$WORK/$target.log"
done
python3 - "$WORK/times.txt" "$OUT" "$(git rev-parse HEAD)" "$WORK" <<'EOF'
import json, os, platform, sys
times, out, commit, work = sys.argv[1:]
targets = [dict(zip(("target", "exit_status", "wall_s"), line.split())) for line in open(times)]
for t in targets:
  t["exit_status"], t["wall_s"] = int(t["exit_status"]), float(t["wall_s"])
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo")
            if l.startswith("model name")), platform.processor())
with open(out + ".tmp", "w") as f:  # then renamed: an earlier record is never half-replaced
  json.dump({"commit": commit, "targets": targets,
             "wall_s": sum(t["wall_s"] for t in targets),
             "wall_min": sum(t["wall_s"] for t in targets) / 60,
             "logs": work, "run": {"cpu": cpu, "cpus": os.cpu_count()}}, f, indent=2)
os.replace(out + ".tmp", out)
print(f"wrote {out}")
EOF
