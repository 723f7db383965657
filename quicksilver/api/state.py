"""What every route shares: the engine, the served model names, the API key and the RAG index."""

from __future__ import annotations

import hashlib
import time

from quicksilver import __version__
from quicksilver.api.errors import APIError
from quicksilver.engine import Engine


class ServerState:
    def __init__(self, engine: Engine, api_key: str | None, model_names: list[str], index_path: str | None):
        self.engine = engine
        self.api_key = api_key
        self.model_names = model_names
        self.index_path = index_path
        self.created = int(time.time())
        digest = hashlib.sha256(f"{engine.loaded.path}|{__version__}".encode()).hexdigest()[:10]
        self.fingerprint = f"qs-{digest}"

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def lexicon(self):
        """Each token's bytes (logprobs report them), shared with the structured-output constraints."""
        from quicksilver.structured.lexicon import lexicon_for

        return lexicon_for(self.engine.tokenizer)

    def check_model(self, name: str) -> str:
        if name not in self.model_names:
            raise APIError(404, f"The model {name!r} does not exist (served: {', '.join(self.model_names)})",
                           "invalid_request_error", "model", "model_not_found")
        return name
