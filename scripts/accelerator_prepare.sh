#!/usr/bin/env bash
# Pack into .carry/ (kept out of git through .git/info/exclude) what scripts/accelerator_train.py needs on a bare
# accelerator machine that has torch, tokenizers, safetensors, numpy, yaml and jinja2 but none of the rest and no
# network: wheels of the missing Python packages (CPython 3.12, x86-64) and the offline corpus.
# Then, on that machine, from the repository root:
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/whl/*.whl
#   mkdir -p runs && tar xzf .carry/corpus.tar.gz -C runs
#   PYTHONPATH=/tmp/site:. python3 scripts/accelerator_train.py --out OUT_DIR
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.carry/' .git/info/exclude 2>/dev/null || echo '/.carry/' >> .git/info/exclude
rm -rf .carry && mkdir -p .carry/whl
platforms=()
for n in 17 24 27 28 31 34; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" --platform manylinux2014_x86_64 -d .carry/whl \
  pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2 \
  typing-extensions==4.16.0 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 \
  rpds-py==0.30.0 attrs==25.4.0
[ -f runs/corpus/manifest.json ] || quicksilver data prepare
tar czf .carry/corpus.tar.gz -C runs corpus
du -sh .carry/whl .carry/corpus.tar.gz
