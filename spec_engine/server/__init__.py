"""Serving: ``AsyncEngine`` (the backend API other servers embed) and ``app`` (``specdec serve``, FastAPI)."""

from spec_engine.server.async_engine import AsyncEngine, Delta, EngineDeadError, RequestStream, Usage

__all__ = ["AsyncEngine", "Delta", "EngineDeadError", "RequestStream", "Usage"]
