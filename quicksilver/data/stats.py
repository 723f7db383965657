"""What went into the training data, for the model card: corpus sources (bytes, documents, tokens), the
mixture weights, and the measured composition of the stream."""

from __future__ import annotations

import platform
import shutil
import subprocess
from collections import Counter
from typing import Any

from quicksilver.tokenizer import Tokenizer

DEBIAN_PACKAGES = ("python3.11-doc", "fortunes", "dict-gcide")


def package_versions() -> dict[str, str | None]:
    """Installed versions of the Debian packages the corpus reads (None when not installed)."""
    versions: dict[str, str | None] = {}
    for pkg in DEBIAN_PACKAGES:
        version = None
        if shutil.which("dpkg-query"):
            done = subprocess.run(["dpkg-query", "-W", "-f", "${Version}", pkg], capture_output=True, text=True)
            version = done.stdout.strip() or None if done.returncode == 0 else None
        versions[pkg] = version
    return versions


def corpus_stats(tokenizer: Tokenizer | None = None) -> dict[str, Any]:
    """Per source: availability, kind, documents, bytes and (with a tokenizer) tokens."""
    from quicksilver.data.corpus import CORPUS_DIR, load_corpus, prepare_corpus

    manifest = prepare_corpus()
    sources = {name: dict(info) for name, info in manifest["sources"].items()}
    if tokenizer is not None:
        for name, docs in load_corpus().items():
            total = 0
            for i in range(0, len(docs), 256):
                batch = tokenizer.backend.encode_batch(docs[i : i + 256], add_special_tokens=False)
                total += sum(len(e.ids) for e in batch)
            sources[name]["tokens"] = total
    return {"folder": str(CORPUS_DIR), "sources": sources, "debian_packages": package_versions(),
            "python": platform.python_version()}


def stream_stats(tokenizer: Tokenizer, seed: int = 0, n: int = 2000, mix: dict[str, float] | None = None) -> dict:
    """Composition of the first ``n`` samples of the stream: samples and tokens per source."""
    from quicksilver.data.mixture import resolve_mix, sample_at

    weights = resolve_mix(mix)
    samples: Counter[str] = Counter()
    prompt_tokens: Counter[str] = Counter()
    response_tokens: Counter[str] = Counter()
    for i in range(n):
        s = sample_at(tokenizer, seed, i, weights)
        samples[s.source] += 1
        prompt_tokens[s.source] += len(s.prompt_ids)
        response_tokens[s.source] += len(s.response_ids)
    total = sum(prompt_tokens.values()) + sum(response_tokens.values())
    learned = sum(response_tokens.values())  # the loss is on response tokens only
    return {
        "seed": seed, "samples": n, "mixture": weights,
        "per_source": {
            k: {"samples": samples[k], "prompt_tokens": prompt_tokens[k], "response_tokens": response_tokens[k],
                "token_share": round((prompt_tokens[k] + response_tokens[k]) / total, 4),
                "response_token_share": round(response_tokens[k] / learned, 4)}
            for k in sorted(samples)
        },
        "mean_tokens_per_sample": round(total / n, 1),
    }


def data_card(
    tokenizer: Tokenizer, seed: int = 0, n: int = 2000, mix: dict[str, float] | None = None
) -> dict[str, Any]:
    """Everything the model card needs about the data, in one JSON-able dict."""
    from quicksilver.tasks import TASKS

    return {
        "corpus": corpus_stats(tokenizer),
        "stream": stream_stats(tokenizer, seed, n, mix),
        "tasks": {name: task.description for name, task in TASKS.items()},
        "tokenizer_vocab_size": tokenizer.vocab_size,
    }
