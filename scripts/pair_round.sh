#!/bin/bash
# One training round of the shipped pair (the twin first: the default's recipe distils from the round's twin), then
# the evaluations its shipping rule reads (scripts/pair_evals.sh) and the agent ones. Logs and JSON go to LOGDIR;
# models to runs/NAME-{ar-twin,default}.
# usage: scripts/pair_round.sh NAME DATASTART LOGDIR [TWIN_INIT DEFAULT_INIT]
set -x
cd "$(dirname "$0")/.."
N=$1; D=$2; L=$3; TI=${4:-quicksilver/models/ar-twin}; DI=${5:-quicksilver/models/default}
mkdir -p "$L"
torchrun --nproc-per-node 2 -m quicksilver.cli train quicksilver/recipes/experiments/$N-ar-twin.yaml --init-from $TI --new-schedule --data-start $D --threads 1 --no-progress > $L/$N-twin.log 2>&1 || exit 1
torchrun --nproc-per-node 2 -m quicksilver.cli train quicksilver/recipes/experiments/$N-default.yaml --init-from $DI --new-schedule --data-start $D --threads 1 --no-progress > $L/$N-default.log 2>&1 || exit 1
scripts/pair_evals.sh $N $L
for M in default ar-twin; do
  OMP_NUM_THREADS=2 quicksilver eval --model runs/$N-$M/export --tasks agent_open --n 100 --json $L/$N-$M-agent-open.json > $L/$N-$M-agent-open.log 2>&1
done
OMP_NUM_THREADS=1 python examples/run_agent_tasks.py --model runs/$N-default/export > $L/$N-agent.log 2>&1
echo done2
