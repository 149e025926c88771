#!/usr/bin/env bash
# The Python observer example (examples/rl/python_observer.py) against its C++ agent under tandem-run: the agent
# writes its address, the observer plays `episodes` episodes through the Python client and stops the agent; both must
# exit 0, and the observer must have reported every episode.
#   python_observer.sh <tandem-run> <rl_python_agent> <python3> <build>/python <source>/examples/rl/python_observer.py <episodes>
set -euo pipefail
run=$1 agent=$2 python=$3 pythonpath=$4 observer=$5 episodes=$6
dir=$(mktemp -d)
trap 'kill $agent_pid 2>/dev/null || true; rm -rf "$dir"' EXIT
TANDEM_SECRET=$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n')
export TANDEM_SECRET
"$run" --nproc-per-node 1 "$agent" --address-file "$dir/addr" --max-seconds 120 > "$dir/agent.log" 2>&1 &
agent_pid=$!
if ! PYTHONPATH="$pythonpath" timeout 120 "$python" "$observer" --address-file "$dir/addr" --episodes "$episodes" \
    > "$dir/observer.log" 2>&1; then
  echo "the observer failed:"; cat "$dir/observer.log"; echo "agent:"; cat "$dir/agent.log"; exit 1
fi
if ! wait $agent_pid; then echo "the agent failed:"; cat "$dir/agent.log"; exit 1; fi
cat "$dir/observer.log"
grep -q "^episode $episodes " "$dir/observer.log"
