"""OpenAI-compatible HTTP API. ``create_app`` is imported lazily so ``import quicksilver.api`` stays light."""

from __future__ import annotations

from typing import Any


def create_app(*args: Any, **kwargs: Any):
    from quicksilver.api.server import create_app as _create_app

    return _create_app(*args, **kwargs)


__all__ = ["create_app"]
