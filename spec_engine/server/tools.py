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
        # each tool's parameters nest inside the array's schema, so their "#/$defs/..." references go to its root:
        # the definitions move there (vLLM's), one name defined two ways refused
        defs: dict = {}
        for schema in params.values():
            for key, value in (schema.get("$defs") or {}).items():
                if defs.setdefault(key, value) != value:
                    raise ValueError(f"tools define '$defs/{key}' in two ways (the tools' schemas share one $defs)")
        calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [name]},
                  "parameters": {k: v for k, v in schema.items() if k != "$defs"}},
                  "required": ["name", "parameters"], "additionalProperties": False}
                 for name, schema in params.items()]  # fmt: skip
        array = {"type": "array", "minItems": 1, "items": {"anyOf": calls}, **({"$defs": defs} if defs else {})}
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


class ChatAnswers:
    """How a chat request's choices read, by its ``tool_choice``: text ("none"); a named function's call, whose
    arguments stream as they come (and stay a call when cut short, vLLM's); or "required"'s calls, held until the
    choice ends (with its logprobs) and sent whole, or as text where the answer is not a whole array of calls."""

    def __init__(self, choice, num_choices: int):
        self.choice = choice
        self.named = choice if isinstance(choice, dict) else None
        self._held = [""] * num_choices  # "required": each choice's text so far
        self._held_logprobs: list[list] = [[] for _ in range(num_choices)]  # and its logprobs' entries

    def opening(self) -> dict:
        """A streamed choice's first delta (a named function's call opens it: its id and name)."""
        if self.named is None:
            return {"role": "assistant", "content": None if self.choice == "required" else ""}
        call = {"index": 0, "id": call_id(), "type": "function",
                "function": {"name": self.named["function"]["name"], "arguments": ""}}  # fmt: skip
        return {"role": "assistant", "content": None, "tool_calls": [call]}

    def streamed(self, i: int, text: str, finish_reason: str | None, logprobs: dict | None,
                 asks_logprobs: bool) -> dict | None:  # fmt: skip
        """Choice ``i``'s chunk for a step's new ``text`` (``finish_reason`` None while it runs; ``logprobs``: the
        step's, OpenAI's chat shape): its delta, logprobs and finish reason; None while "required" holds it."""
        if self.named is not None:
            delta = {"tool_calls": [{"index": 0, "function": {"arguments": text}}]} if text else {}
        elif self.choice == "required":
            self._held[i] += text
            self._held_logprobs[i] += (logprobs or {}).get("content", [])
            if finish_reason is None:
                return None
            calls = tool_calls(self.choice, self._held[i]) if finish_reason == "stop" else None
            delta = {"tool_calls": [{"index": k, **c} for k, c in enumerate(calls)]} if calls else (
                {"content": self._held[i]})  # fmt: skip
            finish_reason = "tool_calls" if calls else finish_reason
            logprobs = {"content": self._held_logprobs[i]} if asks_logprobs else None  # (a last delta may have none)
        else:
            delta = {"content": text} if text else {}
        return {"delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}

    def whole(self, text: str, finish_reason: str) -> tuple[dict, str]:
        """A finished choice's message and finish reason, not streamed."""
        calls = tool_calls(self.choice, text) if self.named is not None or finish_reason == "stop" else None
        if not calls:
            return {"role": "assistant", "content": text}, finish_reason
        return {"role": "assistant", "content": None, "tool_calls": calls}, (
            finish_reason if self.named is not None else "tool_calls"
        )
