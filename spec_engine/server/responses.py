"""Engine deltas as OpenAI responses: the errors (``APIError``, OpenAI's body), a request's choices streamed as
server-sent events (``sse_response``) or collected whole (``collect_choices``), and its usage. The routes are in
``app``."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
from collections.abc import AsyncIterator, Callable

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from spec_engine.server.async_engine import Delta, EngineDeadError, RequestStream

log = logging.getLogger("spec_engine.server")


class APIError(Exception):
    """An error answered with OpenAI's JSON body."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param=None, code=None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        headers = {"Retry-After": "1"} if self.status == 429 else {}
        if self.status >= 500 or self.status in (408, 413):  # the connection's state is unknown, or a body unread
            headers["Connection"] = "close"
        return JSONResponse(body, status_code=self.status, headers=headers)


def usage_body(lasts: list[Delta]) -> dict:  # (each choice's last delta)
    """A request's usage from its choices' last deltas: the prompt counted once (the first choice's: the others
    share its prefix), the completions summed, as OpenAI bills n > 1."""
    prompt = lasts[0].usage
    completion = sum(d.usage.completion_tokens for d in lasts)
    return {
        "prompt_tokens": prompt.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt.prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": prompt.cached_tokens},  # OpenAI's: the prefix cache's share
    }


def wants_usage(req) -> bool:
    """The final usage chunk is sent where the client sets ``stream_options.include_usage`` (OpenAI's and vLLM's
    rule: clients that read ``chunk.choices[0]`` on every chunk would fail on its empty choices)."""
    return req.stream_options is not None and req.stream_options.include_usage is True


def wants_continuous_usage(req) -> bool:
    """vLLM's ``stream_options.continuous_usage_stats``: usage on every chunk too (only beside the final one)."""
    return wants_usage(req) and bool(req.stream_options.continuous_usage_stats)


def _event(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _error_event(message: str, code: str | None = None) -> str:
    return _event({"error": {"message": message, "type": "internal_error", "param": None, "code": code}})


async def _deltas(streams: list[RequestStream]) -> AsyncIterator[tuple[int, Delta]]:
    """A request's choices' deltas as each arrives, with its choice's index; closing it (or an error) aborts every
    choice still running."""
    pending = {asyncio.ensure_future(anext(s)): i for i, s in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=pending.get):  # (choices in index order within a step)
                i = pending.pop(task)
                delta = task.result()
                yield i, delta
                if not delta.finished:
                    pending[asyncio.ensure_future(anext(streams[i]))] = i
    finally:
        for task in pending:
            task.cancel()
            if task.done() and not task.cancelled():
                task.exception()  # (retrieved: an error already raised by another choice's task)
        for stream in streams:
            await stream.aclose()


def sse_response(streams: list[RequestStream], head: dict, choice: Callable[[int, Delta], dict | None],
                 first: list | None, include_usage: bool, count: Callable[[int], None],
                 continuous_usage: bool = False) -> StreamingResponse:  # fmt: skip
    """One ``data:`` event per choice and engine step with new text (and each choice's last one), the usage chunk,
    then [DONE]. A choice the engine failed gets an error event instead of its last chunk (the other choices are
    aborted), then [DONE]. ``count(status)`` once at the end. ``continuous_usage``: each chunk also carries its
    choice's usage so far (vLLM's; ``first``, the opening chunk, with no completion tokens).

    When the client disconnects, Starlette stops iterating; closing the streams aborts the request's choices."""

    def usage_so_far(prompt_tokens: int, completion_tokens: int) -> dict:  # (a chunk's fields)
        if not continuous_usage:
            return {}
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens}
        return {"usage": {**usage, "total_tokens": prompt_tokens + completion_tokens}}

    async def events() -> AsyncIterator[str]:
        lasts: dict[int, Delta] = {}  # choice -> its latest delta
        failed, status = None, 499  # until the end is reached, the client left
        try:
            if first is not None:
                yield _event({**head, "choices": first, **usage_so_far(streams[0].num_prompt_tokens, 0)})
            async with contextlib.aclosing(_deltas(streams)) as deltas:
                async for i, delta in deltas:
                    lasts[i] = delta
                    if delta.finish_reason == "error":
                        failed = delta
                        break
                    # (logprobs, the prompt's too, are sent while the text is held back)
                    if delta.text or delta.finished or delta.logprobs or delta.prompt_logprobs:
                        out = choice(i, delta)  # (None: nothing to send yet)
                        if out is not None:
                            usage = usage_so_far(delta.usage.prompt_tokens, delta.usage.completion_tokens)
                            yield _event({**head, "choices": [out], **usage})
            if failed is not None:
                status = 500
                yield _error_event(_engine_error_message(failed), "engine_error")
            else:
                if include_usage and len(lasts) == len(streams):
                    yield _event({**head, "choices": [], "usage": usage_body([lasts[i] for i in range(len(streams))])})
                status = 200
        except EngineDeadError as e:
            status = 503
            yield _error_event(str(e))
        except Exception as e:  # a bug while streaming: end this stream cleanly, keep serving
            log.exception("streaming failed")
            status = 500
            yield _error_event(f"internal error: {e!r}")
        finally:
            for stream in streams:
                await stream.aclose()
            count(status)
        yield "data: [DONE]\n\n"

    return _ClosingStreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


class _ClosingStreamingResponse(StreamingResponse):
    """A ``StreamingResponse`` that closes its body iterator however the response ends. On a disconnect Starlette
    cancels the write in progress; where that write was blocked (a client that stopped reading, then left), the
    iterator sits at a ``yield`` and nothing closes it: its cleanup, which aborts the request, would wait for the
    garbage collector while the request decodes to its end."""

    async def stream_response(self, send) -> None:
        try:
            await super().stream_response(send)
        finally:
            with anyio.CancelScope(shield=True):  # (in a cancelled scope: the cleanup must still run)
                await self.body_iterator.aclose()


def _engine_error_message(d: Delta) -> str:
    return f"the engine failed this request: {d.error or 'unknown error'}"


async def collect_choices(request: Request, streams: list[RequestStream]) -> list[Delta]:
    """Each choice whole, as one delta (its last, with every delta's text, token ids and logprobs); aborts the
    request when the client disconnects before the end."""

    async def collect():
        choices: list[list[Delta]] = [[] for _ in streams]
        async with contextlib.aclosing(_deltas(streams)) as deltas:
            async for i, delta in deltas:
                choices[i].append(delta)
                if delta.finish_reason == "error":
                    raise APIError(500, _engine_error_message(delta), "internal_error", code="engine_error")
        return [_joined(ds) for ds in choices]

    async def disconnected():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work, watch = asyncio.ensure_future(collect()), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()
            for stream in streams:
                await stream.aclose()
    if not work.done():
        raise APIError(499, "client closed the request", code="client_closed_request")
    try:
        return work.result()
    except EngineDeadError as e:
        raise APIError(503, str(e), "internal_error") from None


def _joined(deltas: list[Delta]) -> Delta:
    """One choice's deltas as one: the last's fields, every delta's text, token ids and logprobs."""
    last = deltas[-1]
    return dataclasses.replace(
        last,
        text="".join(d.text for d in deltas),
        token_ids=[t for d in deltas for t in d.token_ids],
        logprobs=None if last.logprobs is None else [e for d in deltas for e in d.logprobs],
        prompt_logprobs=deltas[0].prompt_logprobs,
    )
