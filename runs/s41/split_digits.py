"""Copy a model folder, its tokenizer splitting digit runs from what precedes them (session 41).
    python runs/s41/split_digits.py SRC DST"""
import shutil
import sys

from quicksilver.tokenizer import Tokenizer, split_digit_runs

src, dst = sys.argv[1], sys.argv[2]
shutil.copytree(src, dst)
tok = Tokenizer.load(dst)
tok.backend.pre_tokenizer = split_digit_runs(tok.backend.pre_tokenizer)
tok.save(dst)
