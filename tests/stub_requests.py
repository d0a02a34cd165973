"""A request as the adaptive controller reads it, for tests that drive the controller without an engine: the fields
a test gives, and ``spec_engine.request.Request``'s own ``tokens_left``."""

from __future__ import annotations

from types import SimpleNamespace

from spec_engine.request import Request


class StubRequest(SimpleNamespace):
    tokens_left = Request.tokens_left  # (the property itself: max_tokens less the output's tokens)
