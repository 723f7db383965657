"""Copy a model folder, its tokenizer splitting digit runs from what precedes them (session 41).
    python runs/s41/split_digits.py SRC DST"""
import json
import shutil
import sys

src, dst = sys.argv[1], sys.argv[2]
shutil.copytree(src, dst)
path = f"{dst}/tokenizer.json"
tok = json.load(open(path))
tok["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": False},
                                                              tok["pre_tokenizer"]]}
json.dump(tok, open(path, "w"), ensure_ascii=False)
