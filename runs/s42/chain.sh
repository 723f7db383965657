#!/bin/bash
# usage: chain.sh NAME DATASTART [TWIN_INIT DEFAULT_INIT]
set -x
cd /work/main
N=$1; D=$2; TI=${3:-quicksilver/models/ar-twin}; DI=${4:-quicksilver/models/default}
torchrun --nproc-per-node 2 -m quicksilver.cli train quicksilver/recipes/experiments/$N-ar-twin.yaml --init-from $TI --new-schedule --data-start $D --threads 1 --no-progress > runs/s42/$N-twin.log 2>&1 || exit 1
torchrun --nproc-per-node 2 -m quicksilver.cli train quicksilver/recipes/experiments/$N-default.yaml --init-from $DI --new-schedule --data-start $D --threads 1 --no-progress > runs/s42/$N-default.log 2>&1 || exit 1
for M in default ar-twin; do
  OMP_NUM_THREADS=2 quicksilver eval --model runs/$N-$M/export --n 100 --json runs/s42/$N-$M-suite.json > runs/s42/$N-$M-suite.log 2>&1
done
OMP_NUM_THREADS=2 quicksilver eval --model runs/$N-default/export --tasks tool_call,json,json_varied --n 300 --outputs --json runs/s42/$N-default-300.json > runs/s42/$N-default-300.log 2>&1
echo evals-done
for M in default ar-twin; do
  OMP_NUM_THREADS=2 quicksilver eval --model runs/$N-$M/export --tasks agent_open --n 100 --json runs/s42/$N-$M-agent-open.json > runs/s42/$N-$M-agent-open.log 2>&1
done
OMP_NUM_THREADS=1 python examples/run_agent_tasks.py --model runs/$N-default/export > runs/s42/$N-agent.log 2>&1
echo done2
