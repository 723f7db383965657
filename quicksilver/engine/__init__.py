"""Async serving engine with continuous batching (no HTTP inside; see :mod:`quicksilver.api`)."""

from quicksilver.engine.core import (
    Engine,
    EngineClosed,
    EngineError,
    EngineOverloaded,
    RequestHandle,
    StepUpdate,
    model_thread,
    streamable_len,
)
from quicksilver.engine.metrics import EngineMetrics
from quicksilver.engine.streaming import TextStreamer, stop_holdback_start

__all__ = [
    "Engine", "EngineClosed", "EngineError", "EngineMetrics", "EngineOverloaded", "RequestHandle", "StepUpdate",
    "TextStreamer", "model_thread", "stop_holdback_start", "streamable_len",
]
