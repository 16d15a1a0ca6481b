#!/usr/bin/env bash
# Run a script as N processes of one run on this machine (127.0.0.1, gloo), as N hosts would:
#
#   benchmarks/local_processes.sh 4 benchmarks/scale.py --shape gptj-6b --checkpoint DIR ...
#
# Each process gets --coordinator_address, --num_processes and its --process_id; the exit
# status is the first non-zero one of the processes (0 when all succeed).
set -euo pipefail
if [[ $# -lt 2 || ! $1 =~ ^[1-9][0-9]*$ ]]; then
  echo "error: usage: $0 N SCRIPT [FLAGS...]  (N >= 1 processes)" >&2
  exit 2
fi
n=$1; shift
python=${PYTHON:-.venv/bin/python}
port=$("$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
pids=()
for ((i = 0; i < n; i++)); do
  "$python" "$@" --coordinator_address="127.0.0.1:$port" --num_processes="$n" --process_id="$i" &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do
  wait "$pid" || { s=$?; [[ $status -eq 0 ]] && status=$s; }
done
exit "$status"
