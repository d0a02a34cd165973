"""OpenAI tool calls in the chat API, through structured outputs (vLLM's way): ``tool_choice`` naming a function makes
the answer JSON following that function's ``parameters`` schema (the call's arguments); ``"required"`` makes it a
JSON array of ``{"name": ..., "parameters": {...}}`` objects, one of the tools each (one at most without
``parallel_tool_calls``). The response carries them as ``tool_calls``. ``"none"`` (the default without tools) answers
in text; ``"auto"`` would need a parser of the model's own tool-call format, which this server does not have, so it is
refused. ``tools`` reach the chat template as its ``tools`` variable either way.
"""

from __future__ import annotations

import json
import uuid


def tool_schema(tools: list[dict], choice, parallel: bool) -> dict | None:
    """``guided_json``'s schema for ``tool_choice`` ("none" or None: no guide; "required"; {"type": "function",
    "function": {"name": ...}}) over ``tools`` (OpenAI's, as dicts). ValueError for a name no tool has."""
    if choice in (None, "none"):
        return None
    params = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in tools}
    if choice == "required":
        calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [name]}, "parameters": schema},
                  "required": ["name", "parameters"], "additionalProperties": False}
                 for name, schema in params.items()]  # fmt: skip
        array = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        return array if parallel else {**array, "maxItems": 1}
    name = choice["function"]["name"]
    if name not in params:
        raise ValueError(f"tool_choice names {name!r}, which is not one of the tools")
    return params[name]


def call_id() -> str:
    """A new tool call's id."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def tool_calls(choice, text: str) -> list[dict] | None:
    """The answer ``text`` of a request with ``tool_choice`` as OpenAI's ``tool_calls`` (each with a new id): a named
    function's call whatever the text (its arguments, cut short where the answer was: vLLM's); "required"'s calls
    where the text is a whole array of them, else None (an answer cut at max_tokens or a stop string)."""
    if choice in (None, "none"):
        return None
    if choice == "required":
        try:
            calls = [(c["name"], json.dumps(c["parameters"], ensure_ascii=False, allow_nan=False))
                     for c in json.loads(text)]  # fmt: skip
        except (ValueError, KeyError, TypeError, RecursionError):  # (RecursionError: nesting past Python's stack)
            return None
    else:
        calls = [(choice["function"]["name"], text)]
    return [{"id": call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}
            for name, arguments in calls]  # fmt: skip
