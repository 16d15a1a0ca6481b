#!/usr/bin/env bash
# What .ci/run costs on a fresh clone: .ci/run itself (the jax 0.11 install in the
# background included), in a clone of this checkout's HEAD with an empty HOME (so pip's
# download cache, the compiled C++ kernels, the bases and compilation caches all start
# empty, as on a CI runner), on an otherwise idle machine.  Writes
# ${OUT:-results/benchmarks/ci_time.json}: the whole run's wall seconds and exit status,
# each make target's seconds from .ci/run's "ci: ... took" lines, the commit and the machine.
#     bash tools/ci_time.sh     # 27.6 minutes on 2 cores at 2ccae1b (ci_time.json)
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
start=$(date +%s.%N)
HOME=$WORK/home PY312="$PY312" .ci/run > "$WORK/ci.log" 2>&1
rc=$?
wall=$(echo "$(date +%s.%N) - $start" | bc)
grep "^ci: " "$WORK/ci.log"
tail -n 3 "$WORK/ci.log"
python3 - "$WORK/ci.log" "$OUT" "$(git rev-parse HEAD)" "$WORK" "$rc" "$wall" <<'EOF'
import json, os, platform, re, sys
log, out, commit, work, rc, wall = sys.argv[1:]
line = re.compile(r"^ci: make (\S+) took (\d+) s \(exit status (\d+)\)$")
targets = [{"target": m[1], "wall_s": int(m[2]), "exit_status": int(m[3])}
           for m in map(line.match, open(log)) if m]
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo")
            if l.startswith("model name")), platform.processor())
with open(out + ".tmp", "w") as f:  # then renamed: an earlier record is never half-replaced
  json.dump({"commit": commit, "exit_status": int(rc), "wall_s": float(wall),
             "wall_min": float(wall) / 60, "targets": targets, "logs": work,
             "run": {"cpu": cpu, "cpus": os.cpu_count()}}, f, indent=2)
os.replace(out + ".tmp", out)
print(f"wrote {out}")
EOF
