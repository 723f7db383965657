#!/bin/bash
# Session 43: the evaluations runs/s43/rule.txt reads, for a candidate default M; two one-thread streams at once.
set -x
cd "$(dirname "$0")/../.."
M=${1:-runs/qat43-default/export}; L=runs/s43; N=$(basename $(dirname $M))
( OMP_NUM_THREADS=1 quicksilver eval --model $M --n 100 --json $L/$N-suite.json > $L/$N-suite.log 2>&1
  OMP_NUM_THREADS=1 quicksilver eval --model $M --tasks tool_call,json,json_varied --n 300 --outputs --json $L/$N-300.json > $L/$N-300.log 2>&1 ) &
( OMP_NUM_THREADS=1 quicksilver eval --model $M --precision int8 --n 100 --json $L/$N-int8-suite.json > $L/$N-int8-suite.log 2>&1
  OMP_NUM_THREADS=1 python benchmarks/int8_sensitivity.py --model $M --seed 20251203 --n 30 --variants bf16,int8 > $L/$N-sensitivity.log 2>&1 ) &
wait
echo evals-done
