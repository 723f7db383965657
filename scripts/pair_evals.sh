#!/bin/bash
# The evaluations a round's shipping rule reads: both models on the suite (1,100 prompts), the default's tool calls
# and JSON on 300. Models in runs/NAME-{default,ar-twin}/export; logs and JSON to LOGDIR.
# usage: scripts/pair_evals.sh NAME LOGDIR
set -x
cd "$(dirname "$0")/.." || exit 1
N=$1; L=$2
for M in default ar-twin; do
  OMP_NUM_THREADS=2 quicksilver eval --model runs/$N-$M/export --n 100 --json $L/$N-$M-suite.json > $L/$N-$M-suite.log 2>&1
done
OMP_NUM_THREADS=2 quicksilver eval --model runs/$N-default/export --tasks tool_call,json,json_varied --n 300 --outputs --json $L/$N-default-300.json > $L/$N-default-300.log 2>&1
echo evals-done
