#!/bin/bash
# One training round of the shipped pair, then the evaluations its shipping rule reads (the twin first: the
# default's recipe distils from the round's twin). Logs and JSON go to LOGDIR; models to runs/NAME-{ar-twin,default}.
# usage: scripts/pair_round.sh NAME DATASTART LOGDIR [TWIN_INIT DEFAULT_INIT]
set -x
cd "$(dirname "$0")/.."
N=$1; D=$2; L=$3; TI=${4:-quicksilver/models/ar-twin}; DI=${5:-quicksilver/models/default}
mkdir -p "$L"
torchrun --nproc-per-node 2 -m quicksilver.cli train quicksilver/recipes/experiments/$N-ar-twin.yaml --init-from $TI --new-schedule --data-start $D --threads 1 --no-progress > $L/$N-twin.log 2>&1 || exit 1
torchrun --nproc-per-node 2 -m quicksilver.cli train quicksilver/recipes/experiments/$N-default.yaml --init-from $DI --new-schedule --data-start $D --threads 1 --no-progress > $L/$N-default.log 2>&1 || exit 1
for M in default ar-twin; do
  OMP_NUM_THREADS=2 quicksilver eval --model runs/$N-$M/export --n 100 --json $L/$N-$M-suite.json > $L/$N-$M-suite.log 2>&1
done
OMP_NUM_THREADS=2 quicksilver eval --model runs/$N-default/export --tasks tool_call,json,json_varied --n 300 --outputs --json $L/$N-default-300.json > $L/$N-default-300.log 2>&1
echo evals-done
for M in default ar-twin; do
  OMP_NUM_THREADS=2 quicksilver eval --model runs/$N-$M/export --tasks agent_open --n 100 --json $L/$N-$M-agent-open.json > $L/$N-$M-agent-open.log 2>&1
done
OMP_NUM_THREADS=1 python examples/run_agent_tasks.py --model runs/$N-default/export > $L/$N-agent.log 2>&1
echo done2
