"""Serving: a continuous-batching `Engine` that many requests share (docs/serving.md); the
OpenAI-compatible HTTP server over it is `jaxformer-serve` (`jaxformer.commands.serve`)."""

from jaxformer.serving.engine import Engine, EngineClosed, Event, Handle, QueueFull

__all__ = ["Engine", "EngineClosed", "Event", "Handle", "QueueFull"]
