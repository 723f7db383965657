"""Training data: the offline corpus, the task/text mixture, and the tokenizer builder.

Interface used by training::

    tok = build_tokenizer(4096)
    for sample in training_stream(tok, seed=0, start=0):   # infinite, deterministic, O(1) resume
        sample.prompt_ids, sample.response_ids
"""

from quicksilver.data.mixture import (
    DEFAULT_MIX,
    MAX_LEN,
    Sample,
    parallel_training_stream,
    sample_at,
    training_stream,
)
from quicksilver.data.tokenizer_builder import build_tokenizer

__all__ = ["DEFAULT_MIX", "MAX_LEN", "Sample", "build_tokenizer", "parallel_training_stream", "sample_at",
           "training_stream"]
