"""``specdec serve``: an OpenAI-compatible HTTP server (FastAPI + uvicorn) on one ``AsyncEngine``.

Endpoints: POST /v1/completions, POST /v1/chat/completions (``stream: true`` -> server-sent events in OpenAI's
chunk format, a final usage chunk, then ``data: [DONE]``), GET /v1/models, GET /health, GET /metrics (Prometheus).

Limits: bodies over ``max_body_bytes`` get 413 (checked on Content-Length and while reading); a body not received
in full within ``request_timeout`` seconds of its head gets 408; JSON nested deeper than ``MAX_JSON_DEPTH`` or holding
invalid Unicode (a lone surrogate) gets 400; more than ``max_pending`` requests in flight get 429 with
``Retry-After: 1`` (below that bound, requests beyond the engine's ``max_num_seqs`` wait in its FIFO queue). Every
error is 4xx/5xx with OpenAI's body ``{"error": {"message", "type", "param", "code"}}``, and the server keeps serving;
408, 413 and every 5xx also close the connection (``Connection: close``), and every one is counted in
``specdec_http_requests_total``. The HTTP layer under the app (``http_guard``) adds its own limits on request heads.

Isolation: a request whose engine row fails (the engine finishes it with reason "error") gets 500, or an SSE error
event then ``[DONE]`` when streaming; the requests decoding beside it are not touched. Parsing, the chat template and
tokenising long prompts run off the event loop, so one huge prompt never stalls /health or other streams.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from spec_engine.sampling import SamplingParams, sequence_params, truncate_prompt, with_token_ids
from spec_engine.server.async_engine import AsyncEngine, Delta, EngineDeadError, RequestStream, tokenize
from spec_engine.server.http_guard import DEFAULT_MAX_HEADER_BYTES, DEFAULT_REQUEST_TIMEOUT, guarded_protocol
from spec_engine.server.logprobs import (
    chat_content_logprobs,
    completion_logprobs,
    logprob_token_text,
    vllm_prompt_logprobs,
)
from spec_engine.server.metrics import EngineCollector
from spec_engine.server.protocol import ChatCompletionRequest, CompletionRequest, error_param
from spec_engine.server.tools import call_id, tool_calls

log = logging.getLogger("spec_engine.server")

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the rest of the context
MAX_JSON_DEPTH = 64  # an OpenAI body nests 4 deep (messages[i].content[j].text); 200,000 '[' hit RecursionError
ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat_completions"}  # metric labels


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


def create_app(
    llm,
    served_model_name: str,
    max_pending: int = 64,
    max_body_bytes: int = 1 << 20,
    request_timeout: float = DEFAULT_REQUEST_TIMEOUT,
) -> FastAPI:
    """The server for ``llm`` (a ``spec_engine.LLM``). Starts the engine loop thread now; stops it at shutdown.

    ``app.state.engine`` is the ``AsyncEngine``; ``app.state.registry`` the app's own Prometheus registry. Run it
    with ``uvicorn_config`` (the guarded HTTP layer), e.g. ``uvicorn.Server(uvicorn_config(app, port=0)).run()``.
    """
    if llm.engine.grammars is not None:  # structured outputs' view of the tokenizer, built before any request waits
        llm.engine.grammars.warm()
    chat_template = llm.get_chat_template()  # (before the engine's thread starts: a bad template leaves no thread)
    engine = AsyncEngine(llm)
    registry = CollectorRegistry()
    registry.register(EngineCollector(engine, max_pending))
    http_requests = Counter("specdec_http_requests", "API requests by endpoint and HTTP status", ["endpoint", "status"],
                            registry=registry)  # fmt: skip

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await asyncio.to_thread(engine.close)

    app = FastAPI(title="specdec", lifespan=lifespan)
    app.state.engine, app.state.registry, app.state.request_timeout = engine, registry, request_timeout
    # requests refused by the HTTP layer (http_guard: 400 ambiguous framing, 408 stalled head, 431 huge head)
    app.state.count_http_reject = lambda status: http_requests.labels("http", str(status)).inc()

    # --- errors: every one gets OpenAI's body --------------------------------------------------------------------

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return e.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):  # no such path (404), or method (405)
        http_requests.labels(ENDPOINTS.get(request.url.path, "other"), str(e.status_code)).inc()
        code = "not_found" if e.status_code == 404 else None
        return APIError(e.status_code, str(e.detail), param=None, code=code).response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        return APIError(400, str(e)).response()

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, e: Exception):  # outside the endpoints' own guard (``respond``)
        http_requests.labels(ENDPOINTS.get(request.url.path, "other"), "500").inc()
        return APIError(500, f"internal error: {e!r}", "internal_error").response()

    # --- helpers -------------------------------------------------------------------------------------------------

    async def read_body(request: Request, model_cls):
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > max_body_bytes):
            raise APIError(413, f"request body over {max_body_bytes} bytes", code="request_too_large")
        body = bytearray()
        try:
            async with asyncio.timeout(request_timeout):
                async for chunk in request.stream():
                    body += chunk
                    if len(body) > max_body_bytes:
                        raise APIError(413, f"request body over {max_body_bytes} bytes", code="request_too_large")
        except TimeoutError:
            msg = f"the request body did not arrive within {request_timeout:g} s"
            raise APIError(408, msg, code="request_timeout") from None
        except ClientDisconnect:
            raise APIError(499, "client closed the request", code="client_closed_request") from None
        # a 1 MB body takes milliseconds to parse and check: not on the event loop
        return await asyncio.to_thread(validate, bytes(body), model_cls)

    def validate(body: bytes, model_cls):
        data = _parse_json(body)
        try:
            req = model_cls.model_validate(data)
        except ValidationError as e:
            err = e.errors()[0]
            param = error_param(err["loc"])
            msg = err["msg"].removeprefix("Value error, ")
            raise APIError(400, f"{param}: {msg}" if param else msg, param=param, code=err["type"]) from None
        unsupported = req.unsupported_field()
        if unsupported is not None:
            raise APIError(400, f"'{unsupported}' is not supported by this server", param=unsupported)
        if req.stream_options is not None and not req.stream:  # (as OpenAI answers it)
            raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options")
        if req.model is not None and req.model != served_model_name:
            raise APIError(404, f"the model '{req.model}' does not exist; this server serves '{served_model_name}'",
                           param="model", code="model_not_found")  # fmt: skip
        return req

    def sampling_params(req, prompt_len: int, max_tokens: int | None, default_max_tokens: int) -> SamplingParams:
        room = llm.max_model_len - prompt_len
        if room < 1:
            msg = f"the prompt has {prompt_len} tokens: no room for output in the context of {llm.max_model_len}"
            raise APIError(400, msg, param="prompt", code="context_length_exceeded")
        if max_tokens is not None and max_tokens > room:
            msg = f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) is past the context ({llm.max_model_len})"
            raise APIError(400, msg, param="max_tokens", code="context_length_exceeded")
        bias = None
        if req.logit_bias is not None:
            if not all(k.isascii() and k.isdigit() and str(int(k)) == k for k in req.logit_bias):
                raise APIError(400, "logit_bias keys must be token ids as decimal strings ('42')", param="logit_bias")
            bias = {int(k): v for k, v in req.logit_bias.items()}
        try:
            params = SamplingParams(
                max_tokens=max_tokens if max_tokens is not None else min(default_max_tokens, room),
                temperature=1.0 if req.temperature is None else req.temperature,
                top_k=max(req.top_k or 0, 0),
                top_p=1.0 if req.top_p is None else req.top_p,
                min_p=req.min_p or 0.0,
                seed=req.seed,
                stop_token_ids=req.stop_token_ids,
                ignore_eos=req.ignore_eos,
                stop=req.stop,
                n=1 if req.n is None else req.n,
                logprobs=req.logprobs_asked(),
                prompt_logprobs=req.prompt_logprobs_asked(),
                presence_penalty=req.presence_penalty or 0.0,
                frequency_penalty=req.frequency_penalty or 0.0,
                repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
                logit_bias=bias,
                min_tokens=req.min_tokens or 0,
                allowed_token_ids=req.allowed_token_ids,
                include_stop_str_in_output=bool(req.include_stop_str_in_output),
                skip_special_tokens=req.skip_special_tokens,
                truncate_prompt_tokens=req.truncate_prompt_tokens,
                bad_words=req.bad_words or None,
                **req.guides_asked(),
            )
            for name in ("bad_words", "guided_choice", "guided_json", "guided_regex", "guided_grammar"):
                if getattr(params, name) and llm.tokenizer is None:
                    raise ValueError(f"{name} needs a tokenizer; this model has none")
            return with_token_ids(params, llm.encode_words)
        except ValueError as e:  # "top_p must be ...": the message starts with the field's name
            field = str(e).split(" ", 1)[0].removeprefix("SamplingParams.")
            named = req.guide_field(field)  # (the field the client named a guide by, in the message too)
            message = str(e) if named == field else f"{named}: {str(e).replace(field, 'its guide', 1)}"
            raise APIError(400, message, param=named if named in type(req).model_fields else None) from None

    @functools.lru_cache(maxsize=1 << 16)
    def token_text(token_id: int) -> tuple[str, bytes]:
        return logprob_token_text(llm.tokenizer, token_id)

    async def encode(text: str, add_special_tokens: bool = True) -> list[int]:
        if llm.tokenizer is None:
            raise APIError(400, "this model has no tokenizer.json: send the prompt as a list of token ids",
                           param="prompt")  # fmt: skip
        try:
            return await tokenize(llm.tokenizer, text, add_special_tokens)
        except ValueError as e:
            raise APIError(400, str(e), param="prompt") from None

    admitting = [0]  # choices promised to requests still adding them (not yet in engine.num_in_flight)

    async def start(ids: list[int], params: SamplingParams, req) -> list[RequestStream]:
        """One engine request per choice (``params.n``; each sequence's seed as ``LLM.generate`` derives it), all
        admitted or none: a choice refused aborts those already added. The n slots are taken at once, before the
        first await, so concurrent requests never pass ``max_pending`` together."""
        if params.n > max_pending:  # (no retry would admit it)
            raise APIError(400, f"n ({params.n}) is more than this server runs at once ({max_pending})", param="n")
        taken = engine.num_in_flight + admitting[0]
        if taken + params.n > max_pending:
            raise APIError(429, f"{taken} requests in flight and {params.n} more asked for (the limit is "
                           f"{max_pending}); retry later", "rate_limit_error", code="too_many_requests")  # fmt: skip
        admitting[0] += params.n
        streams, promised = [], params.n
        try:
            for i in range(params.n):
                promised -= 1  # add_request counts it in flight before its first await: no window between
                admitting[0] -= 1
                streams.append(await engine.add_request(ids, sequence_params(params, i)))
        except BaseException as e:
            for stream in streams:
                await stream.aclose()
            if isinstance(e, EngineDeadError):
                raise APIError(503, str(e), "internal_error") from None
            if isinstance(e, ValueError):  # (RequestError names the field; a guide by the client's name of it)
                param = getattr(e, "param", None)
                named = req.guide_field(param)
                message = str(e) if named == param else f"{named}: {str(e).replace(param, 'its guide', 1)}"
                raise APIError(400, message, param=named) from None
            raise
        finally:
            admitting[0] -= promised
        return streams

    async def respond(endpoint: str, request: Request, handler: Callable) -> Response:
        """Run ``handler(count)``, answer any exception with OpenAI's body, and count the status. A stream counts
        its own status when it ends (``count(status)``): 200, or 500/503 after an error event, or 499."""
        counted = False

        def count(status: int) -> None:
            http_requests.labels(endpoint, str(status)).inc()

        try:
            response = await handler(count)
            counted = isinstance(response, StreamingResponse)
        except APIError as e:
            response = e.response()
        except Exception as e:  # a bug, not the client's fault: log it, answer 500, keep serving
            log.exception("%s failed", endpoint)
            response = APIError(500, f"internal error: {e!r}", "internal_error").response()
        if not counted:
            count(response.status_code)
        return response

    # --- endpoints ---------------------------------------------------------------------------------------------

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        async def handle(count):
            req = await read_body(request, CompletionRequest)
            encoded = await encode(req.prompt) if isinstance(req.prompt, str) else req.prompt
            ids = truncate_prompt(encoded, req.truncate_prompt_tokens)
            params = sampling_params(req, len(ids), req.max_tokens, DEFAULT_COMPLETION_MAX_TOKENS)
            streams = await start(ids, params, req)
            head = {"id": f"cmpl-{streams[0].request_id}", "object": "text_completion", "created": int(time.time()),
                    "model": served_model_name}  # fmt: skip

            offsets = [0] * len(streams)  # each choice's text so far, in characters (its tokens' text_offset)
            echoed = [not req.echo] * len(streams)  # (echo: the prompt goes first, in the choice's first chunk)
            whole = isinstance(req.prompt, str) and len(ids) == len(encoded)
            prompt_text = (req.prompt if whole else llm.decode(ids, req.skip_special_tokens)) if req.echo else ""

            def choice(i: int, d: Delta) -> dict:
                text, parts = d.text, []
                if not echoed[i]:
                    echoed[i], text = True, prompt_text + text
                    parts.append((ids, d.prompt_logprobs))
                parts.append((d.token_ids, d.logprobs))
                lps = None
                for tokens, entries in parts:
                    if entries is not None:
                        part, offsets[i] = completion_logprobs(tokens, entries, token_text, offsets[i])
                        lps = part if lps is None else {k: lps[k] + part[k] for k in lps}
                out = {"index": i, "text": text, "logprobs": lps, "finish_reason": d.finish_reason}
                if req.prompt_logprobs is not None and d.prompt_logprobs is not None:  # (a choice's first chunk)
                    out["prompt_logprobs"] = vllm_prompt_logprobs(ids, d.prompt_logprobs, token_text,
                                                                  params.prompt_logprobs)  # fmt: skip
                return out

            if req.stream:
                return _sse(streams, head, choice, None, _include_usage(req), count)
            done = await _collect(request, streams)
            return JSONResponse({**head, "choices": [choice(i, d) for i, d in enumerate(done)], "usage": _usage(done)})

        return await respond("completions", request, handle)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        async def handle(count):
            req = await read_body(request, ChatCompletionRequest)
            try:
                tool_choice = req.tool_choice_asked()
            except ValueError as e:
                raise APIError(400, str(e), param="tool_choice") from None
            messages, tools = req.template_inputs()
            try:
                prompt = await asyncio.to_thread(chat_template.render, messages, tools=tools)
            except ValueError as e:
                raise APIError(400, str(e), param="messages") from None
            ids = await encode(prompt, add_special_tokens=not chat_template.from_model)
            ids = truncate_prompt(ids, req.truncate_prompt_tokens)
            max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
            params = sampling_params(req, len(ids), max_tokens, llm.max_model_len)
            if tool_choice != "none" and llm.engine.grammars is not None:  # the tools' schema, said as theirs
                try:
                    await asyncio.to_thread(llm.engine.grammars.check, params)
                except ValueError as e:
                    raise APIError(400, str(e).replace("guided_json", "the tools' schema"), param="tools") from None
            if req.prompt_logprobs is not None and req.stream:
                raise APIError(400, "prompt_logprobs is not supported with stream in the chat API (the completions "
                               "API streams them)", param="prompt_logprobs")  # fmt: skip

            def chat_logprobs(d: Delta) -> dict | None:
                if d.logprobs is None:
                    return None
                return {"content": chat_content_logprobs(d.token_ids, d.logprobs, token_text, req.top_logprobs or 0)}

            streams = await start(ids, params, req)
            head = {"id": f"chatcmpl-{streams[0].request_id}", "object": "chat.completion.chunk",
                    "created": int(time.time()), "model": served_model_name}  # fmt: skip
            named = tool_choice if isinstance(tool_choice, dict) else None
            if req.stream:

                def opening() -> dict:  # (a named function's call opens each choice: its arguments stream)
                    if named is None:
                        return {"role": "assistant", "content": None if tool_choice == "required" else ""}
                    call = {"index": 0, "id": call_id(), "type": "function",
                            "function": {"name": named["function"]["name"], "arguments": ""}}  # fmt: skip
                    return {"role": "assistant", "content": None, "tool_calls": [call]}

                first = [{"index": i, "delta": opening(), "finish_reason": None} for i in range(len(streams))]
                held = [""] * len(streams)  # "required": each choice's text, parsed into calls at its end
                held_logprobs: list[list] = [[] for _ in streams]  # and its logprobs, sent with them

                def choice(i: int, d: Delta) -> dict | None:
                    lps, finish = chat_logprobs(d), d.finish_reason
                    if named is not None:
                        delta = {"tool_calls": [{"index": 0, "function": {"arguments": d.text}}]} if d.text else {}
                    elif tool_choice == "required":
                        held[i] += d.text
                        held_logprobs[i] += (lps or {}).get("content", [])
                        if not d.finished:
                            return None
                        calls = tool_calls(tool_choice, held[i]) if finish == "stop" else None
                        delta = {"tool_calls": [{"index": k, **c} for k, c in enumerate(calls)]} if calls else (
                            {"content": held[i]})  # fmt: skip
                        finish = "tool_calls" if calls else finish
                        lps = {"content": held_logprobs[i]} if req.logprobs else None  # (a last delta may have none)
                    else:
                        delta = {"content": d.text} if d.text else {}
                    return {"index": i, "delta": delta, "logprobs": lps, "finish_reason": finish}

                return _sse(streams, head, choice, first, _include_usage(req), count)
            done = await _collect(request, streams)
            choices = []
            for i, d in enumerate(done):
                calls = tool_calls(tool_choice, d.text) if named is not None or d.finish_reason == "stop" else None
                message = {"role": "assistant", "content": None, "tool_calls": calls} if calls else (
                    {"role": "assistant", "content": d.text})  # fmt: skip
                finish = "tool_calls" if calls and named is None else d.finish_reason
                choices.append({"index": i, "message": message, "logprobs": chat_logprobs(d), "finish_reason": finish})
            body = {**head, "object": "chat.completion", "choices": choices, "usage": _usage(done)}
            if req.prompt_logprobs is not None:  # (vLLM's: the response's, not a choice's)
                body["prompt_logprobs"] = vllm_prompt_logprobs(ids, done[0].prompt_logprobs, token_text,
                                                               params.prompt_logprobs)  # fmt: skip
            return JSONResponse(body)

        return await respond("chat_completions", request, handle)

    @app.get("/v1/models")
    async def models() -> dict:
        card = {"id": served_model_name, "object": "model", "created": 0, "owned_by": "specdec",
                "root": str(llm.model_dir), "max_model_len": llm.max_model_len}  # fmt: skip
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health() -> Response:
        s = engine.stats()
        body = {"status": "ok" if engine.alive else "dead", "model": served_model_name,
                "num_requests_in_flight": engine.num_in_flight, "max_pending": max_pending, **s}  # fmt: skip
        return JSONResponse(body, status_code=200 if engine.alive else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app


# --- responses ---------------------------------------------------------------------------------------------------


def _usage(lasts: list[Delta]) -> dict:  # (each choice's last delta)
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


def _include_usage(req) -> bool:
    """The final usage chunk is on unless the client sets ``stream_options.include_usage`` to false."""
    return req.stream_options is None or req.stream_options.include_usage is not False


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


def _sse(streams: list[RequestStream], head: dict, choice: Callable[[int, Delta], dict | None], first: list | None,
         include_usage: bool, count: Callable[[int], None]) -> StreamingResponse:  # fmt: skip
    """One ``data:`` event per choice and engine step with new text (and each choice's last one), the usage chunk,
    then [DONE]. A choice the engine failed gets an error event instead of its last chunk (the other choices are
    aborted), then [DONE]. ``count(status)`` once at the end.

    When the client disconnects, Starlette stops iterating; closing the streams aborts the request's choices."""

    async def events() -> AsyncIterator[str]:
        lasts: dict[int, Delta] = {}  # choice -> its latest delta
        failed, status = None, 499  # until the end is reached, the client left
        try:
            if first is not None:
                yield _event({**head, "choices": first})
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
                            yield _event({**head, "choices": [out]})
            if failed is not None:
                status = 500
                yield _error_event(_engine_error_message(failed), "engine_error")
            else:
                if include_usage and len(lasts) == len(streams):
                    yield _event({**head, "choices": [], "usage": _usage([lasts[i] for i in range(len(streams))])})
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

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def _engine_error_message(d: Delta) -> str:
    return f"the engine failed this request: {d.error or 'unknown error'}"


async def _collect(request: Request, streams: list[RequestStream]) -> list[Delta]:
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


def _parse_json(body: bytes):
    """The body as a JSON object; 400 for bad JSON, nesting past ``MAX_JSON_DEPTH``, or a lone surrogate (which
    json accepts, as a \\ud800 escape or as raw bytes, and which no tokenizer or UTF-8 encoder takes)."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"invalid JSON body: {e}", code="invalid_json") from None
    except RecursionError:
        raise APIError(400, f"JSON nested deeper than {MAX_JSON_DEPTH} levels", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "the JSON body must be an object", code="invalid_json")
    todo = [(data, 1)]
    while todo:
        value, depth = todo.pop()
        if depth > MAX_JSON_DEPTH:
            raise APIError(400, f"JSON nested deeper than {MAX_JSON_DEPTH} levels", code="invalid_json")
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            for s in (key, item):
                if isinstance(s, str) and not s.isascii():
                    try:
                        s.encode()
                    except UnicodeEncodeError:
                        msg = "invalid Unicode in a string: a lone surrogate"
                        raise APIError(400, msg, code="invalid_json") from None
            if isinstance(item, (dict, list)):
                todo.append((item, depth + 1))
    return data


# --- the CLI entry point -----------------------------------------------------------------------------------------


def uvicorn_config(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, *,
                   max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES, **kwargs):  # fmt: skip
    """A ``uvicorn.Config`` for ``app`` on the guarded h11 layer (``http_guard``), with the app's request timeout.

    ``kwargs`` go to ``uvicorn.Config`` (``log_level``, ``lifespan``, ...)."""
    import uvicorn

    protocol = guarded_protocol(max_header_bytes, app.state.request_timeout, app.state.count_http_reject)
    return uvicorn.Config(app, host=host, port=port, http=protocol, h11_max_incomplete_event_size=max_header_bytes,
                          **kwargs)  # fmt: skip


def serve(args) -> int:
    """``specdec serve``: build the LLM from the model arguments and run uvicorn until interrupted."""
    import uvicorn

    from spec_engine.llm import build_llm

    llm = build_llm(args)
    name = args.served_model_name or (Path(args.model).name if args.model else "specdec-default")
    app = create_app(llm, name, max_pending=args.max_pending, max_body_bytes=args.max_body_bytes,
                     request_timeout=args.request_timeout)  # fmt: skip
    host = f"[{args.host}]" if ":" in args.host else args.host
    print(f"[specdec] serving '{name}' at http://{host}:{args.port}/v1 (OpenAI API; /health, /metrics)", flush=True)
    config = uvicorn_config(app, args.host, args.port, max_header_bytes=args.max_header_bytes,
                            log_level=getattr(args, "log_level", "info"))  # fmt: skip
    uvicorn.Server(config).run()
    return 0
