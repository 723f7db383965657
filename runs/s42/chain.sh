#!/bin/bash
# usage: chain.sh NAME DATASTART [TWIN_INIT DEFAULT_INIT] (session 42's rounds; the steps are in scripts/pair_round.sh)
cd "$(dirname "$0")/../.." && exec scripts/pair_round.sh "$1" "$2" runs/s42 "${@:3}"
