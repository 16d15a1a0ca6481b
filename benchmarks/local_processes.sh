#!/usr/bin/env bash
# Run a script as N processes of one run on this machine (127.0.0.1, gloo), as N hosts would:
#
#   benchmarks/local_processes.sh 4 benchmarks/scale.py --shape gptj-6b --checkpoint DIR ...
#
# Each process gets --coordinator_address, --num_processes and its --process_id; the exit
# status is the first non-zero one of the processes (0 when all succeed).  SIGINT (Ctrl-C)
# and SIGTERM (timeout, a scheduler) are passed on to every process, each of which ends
# with its `interrupted:` line and writes nothing; this script then waits for all of them
# and exits 130 or 143.
set -euo pipefail
if [[ $# -lt 2 || ! $1 =~ ^[1-9][0-9]*$ ]]; then
  echo "error: usage: $0 N SCRIPT [FLAGS...]  (N >= 1 processes)" >&2
  exit 2
fi
n=$1; shift
python=${PYTHON:-.venv/bin/python}
# A free port below the ephemeral range, which no outgoing connection can take first.
port=$("$python" -c 'from gsi_jax.runtime.distributed import coordinator_port; print(coordinator_port())')
pids=()

interrupt() {  # interrupt SIGNAL STATUS: pass the signal on, wait for every process, exit
  trap '' INT TERM
  kill -s "$1" "${pids[@]}" 2> /dev/null || true
  for pid in "${pids[@]}"; do wait "$pid" || true; done
  exit "$2"
}
trap 'interrupt INT 130' INT
trap 'interrupt TERM 143' TERM

for ((i = 0; i < n; i++)); do
  "$python" "$@" --coordinator_address="127.0.0.1:$port" --num_processes="$n" --process_id="$i" &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do
  wait "$pid" || { s=$?; [[ $status -eq 0 ]] && status=$s; }
done
exit "$status"
