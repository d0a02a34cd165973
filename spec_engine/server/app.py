"""``specdec serve``: an OpenAI-compatible HTTP server (FastAPI + uvicorn) on one ``AsyncEngine``.

Endpoints: POST /v1/completions, POST /v1/chat/completions (``stream: true`` -> server-sent events in OpenAI's
chunk format, a final usage chunk where ``stream_options.include_usage`` asks, then ``data: [DONE]``), GET
/v1/models, GET /health, GET /metrics (Prometheus), and vLLM's POST /tokenize (a prompt's or a chat's token ids, as
the completions or chat API makes them), POST /detokenize and GET /version.

Limits: bodies over ``max_body_bytes`` get 413 (checked on Content-Length and while reading); a body not received in
full within ``request_timeout`` seconds of its head gets 408; JSON nested deeper than ``MAX_JSON_DEPTH`` (in
``requests``) or holding invalid Unicode (a lone surrogate) gets 400; more than ``max_pending`` requests in flight
get 429 with ``Retry-After: 1`` (below that bound, requests beyond the engine's ``max_num_seqs`` wait in its FIFO
queue). Every error is 4xx/5xx with OpenAI's body ``{"error": {"message", "type", "param", "code"}}``, and the
server keeps serving; 408, 413 and every 5xx also close the connection (``Connection: close``), and every one is
counted in ``specdec_http_requests_total``. The HTTP layer under the app (``http_guard``) adds its own limits on
request heads.

Isolation: a request whose engine row fails (the engine finishes it with reason "error") gets 500, or an SSE error
event then ``[DONE]`` when streaming; the requests decoding beside it are not touched. Parsing, the chat template and
tokenising long prompts run off the event loop, so one huge prompt never stalls /health or other streams.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import gc
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from spec_engine.inputs import tokenize
from spec_engine.sampling import SamplingParams, truncate_prompt
from spec_engine.server.async_engine import AsyncEngine, Delta, EngineDeadError, RequestStream
from spec_engine.server.http_guard import DEFAULT_MAX_HEADER_BYTES, DEFAULT_REQUEST_TIMEOUT, guarded_protocol
from spec_engine.server.logprobs import (
    chat_content_logprobs,
    completion_logprobs,
    logprob_token_text,
    vllm_prompt_logprobs,
)
from spec_engine.server.metrics import EngineCollector
from spec_engine.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    template_inputs,
)
from spec_engine.server.requests import read_body_bytes, sampling_params, validate
from spec_engine.server.responses import (
    APIError,
    collect_choices,
    sse_response,
    usage_body,
    wants_continuous_usage,
    wants_usage,
)
from spec_engine.server.tools import ChatAnswers

if TYPE_CHECKING:
    from spec_engine.llm import LLM

log = logging.getLogger("spec_engine.server")

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the rest of the context
ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat_completions", "/tokenize": "tokenize",
             "/detokenize": "detokenize"}  # metric labels  # fmt: skip


def create_app(
    llm,
    served_model_name: str,
    max_pending: int = 64,
    max_body_bytes: int = 1 << 20,
    request_timeout: float = DEFAULT_REQUEST_TIMEOUT,
    chat_template: str | None = None,
) -> FastAPI:
    """The server for ``llm`` (a ``spec_engine.LLM``). Starts the engine loop thread now; stops it at shutdown.

    ``chat_template``: the chat API's Jinja source (default: the model's own template, else ``DEFAULT_CHAT_TEMPLATE``).
    ``app.state.engine`` is the ``AsyncEngine``; ``app.state.registry`` the app's own Prometheus registry. Run it
    with ``uvicorn_config`` (the guarded HTTP layer), e.g. ``uvicorn.Server(uvicorn_config(app, port=0)).run()``.
    """
    if llm.engine.grammars is not None:  # structured outputs' view of the tokenizer, built before any request waits
        llm.engine.grammars.warm()
    # (before the engine's thread starts: a bad template leaves no thread)
    chat_template = llm.get_chat_template(chat_template)
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
        body = await read_body_bytes(request, max_body_bytes, request_timeout)
        # a 1 MB body takes milliseconds to parse and check: not on the event loop
        return await asyncio.to_thread(validate, body, model_cls, served_model_name)

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

    async def encode_chat(req, messages: list[dict], tools: list[dict] | None) -> list[int]:
        """A conversation's token ids, as the chat API prompts the model: rendered by the chat template (with the
        request's ``add_generation_prompt`` and ``chat_template_kwargs``), encoded with special tokens where the
        template does not write them itself (unless ``add_special_tokens`` says)."""
        try:
            prompt = await asyncio.to_thread(chat_template.render, messages, req.add_generation_prompt,
                                             **(req.chat_template_kwargs or {}), tools=tools)  # fmt: skip
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from None
        special = req.add_special_tokens
        return await encode(prompt, add_special_tokens=not chat_template.from_model if special is None else special)

    admitting = [0]  # choices promised to requests still adding them (not yet in engine.num_in_flight)

    async def start(ids: list[int], params: SamplingParams, req) -> list[RequestStream]:
        """One engine request per choice (``params.n``: ``InputProcessor.sequences``, as ``LLM.generate``), all
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
            for sequence in llm.inputs.sequences(params):
                promised -= 1  # add_request counts it in flight before its first await: no window between
                admitting[0] -= 1
                streams.append(await engine.add_request(ids, sequence))
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
            special = req.add_special_tokens is not False
            encoded = await encode(req.prompt, special) if isinstance(req.prompt, str) else req.prompt
            ids = truncate_prompt(encoded, req.truncate_prompt_tokens)
            params = sampling_params(llm, req, len(ids), req.max_tokens, DEFAULT_COMPLETION_MAX_TOKENS)
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
                    if req.logprobs is not None:  # (the prompt's asked for alone go in prompt_logprobs, vLLM's)
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
                return sse_response(streams, head, choice, None, wants_usage(req), count, wants_continuous_usage(req))
            done = await collect_choices(request, streams)
            # (n choices' logprobs, the prompt's too, can be megabytes of JSON: built off the event loop)
            return await asyncio.to_thread(lambda: JSONResponse(
                {**head, "choices": [choice(i, d) for i, d in enumerate(done)], "usage": usage_body(done)}
            ))  # fmt: skip

        return await respond("completions", request, handle)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        async def handle(count):
            req = await read_body(request, ChatCompletionRequest)
            try:
                tool_choice = req.tool_choice_asked()
            except ValueError as e:
                raise APIError(400, str(e), param="tool_choice") from None
            ids = await encode_chat(req, *req.template_inputs())
            ids = truncate_prompt(ids, req.truncate_prompt_tokens)
            max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
            params = sampling_params(llm, req, len(ids), max_tokens, llm.max_model_len)
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
            answers = ChatAnswers(tool_choice, len(streams))
            if req.stream:
                first = [{"index": i, "delta": answers.opening(), "finish_reason": None} for i in range(len(streams))]

                def choice(i: int, d: Delta) -> dict | None:
                    out = answers.streamed(i, d.text, d.finish_reason, chat_logprobs(d), bool(req.logprobs))
                    return None if out is None else {"index": i, **out}

                return sse_response(streams, head, choice, first, wants_usage(req), count, wants_continuous_usage(req))
            done = await collect_choices(request, streams)

            def response() -> JSONResponse:  # (logprobs can be megabytes of JSON: built off the event loop)
                choices = []
                for i, d in enumerate(done):
                    message, finish = answers.whole(d.text, d.finish_reason)
                    choices.append({"index": i, "message": message, "logprobs": chat_logprobs(d),
                                    "finish_reason": finish})  # fmt: skip
                body = {**head, "object": "chat.completion", "choices": choices, "usage": usage_body(done)}
                if req.prompt_logprobs is not None:  # (vLLM's: the response's, not a choice's)
                    body["prompt_logprobs"] = vllm_prompt_logprobs(ids, done[0].prompt_logprobs, token_text,
                                                                   params.prompt_logprobs)  # fmt: skip
                return JSONResponse(body)

            return await asyncio.to_thread(response)

        return await respond("chat_completions", request, handle)

    @app.post("/tokenize")
    async def tokenize_text(request: Request) -> Response:
        async def handle(count):
            req = await read_body(request, TokenizeRequest)
            if req.messages is None:
                ids = await encode(req.prompt, add_special_tokens=req.add_special_tokens is not False)
            else:
                ids = await encode_chat(req, *template_inputs(req.messages, req.tools))
            strs = [llm.tokenizer.id_to_token(i) for i in ids] if req.return_token_strs else None
            return JSONResponse({"count": len(ids), "max_model_len": llm.max_model_len, "tokens": ids,
                                 "token_strs": strs})  # fmt: skip

        return await respond("tokenize", request, handle)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        async def handle(count):
            req = await read_body(request, DetokenizeRequest)
            if llm.tokenizer is None:
                raise APIError(400, "this model has no tokenizer.json", param="tokens")
            vocab = llm.engine.vocab_size
            if not all(0 <= t < vocab for t in req.tokens):
                raise APIError(400, f"tokens must be token ids in [0, {vocab})", param="tokens")
            return JSONResponse({"prompt": await asyncio.to_thread(llm.decode, req.tokens, False)})

        return await respond("detokenize", request, handle)

    @app.get("/version")
    async def version() -> dict:
        return {"version": _version()}

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


@functools.cache
def _version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as package_version

    try:
        return package_version("specdec")
    except PackageNotFoundError:  # (run from a source tree that was never installed)
        return "unknown"


# --- the CLI entry point -----------------------------------------------------------------------------------------


def uvicorn_config(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, *,
                   max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES, **kwargs):  # fmt: skip
    """A ``uvicorn.Config`` for ``app`` on the guarded h11 layer (``http_guard``), with the app's request timeout.

    ``kwargs`` go to ``uvicorn.Config`` (``log_level``, ``lifespan``, ...)."""
    import uvicorn

    protocol = guarded_protocol(max_header_bytes, app.state.request_timeout, app.state.count_http_reject)
    return uvicorn.Config(app, host=host, port=port, http=protocol, h11_max_incomplete_event_size=max_header_bytes,
                          **kwargs)  # fmt: skip


def serve(args: argparse.Namespace, build_llm: Callable[[argparse.Namespace], LLM]) -> int:
    """``specdec serve``: build the LLM from the model arguments with ``build_llm`` (the CLI's builder, which owns
    the model options) and run uvicorn until interrupted."""
    import uvicorn

    template = args.chat_template
    if template is not None and (Path(template).is_file() or "{" not in template):  # a file, else Jinja text
        try:
            template = Path(template).read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise SystemExit(f"specdec serve: --chat-template: cannot read {template}: {e}") from None
    llm = build_llm(args)
    name = args.served_model_name or (Path(args.model).resolve().name if args.model else "specdec-default")
    try:
        app = create_app(llm, name, max_pending=args.max_pending, max_body_bytes=args.max_body_bytes,
                         request_timeout=args.request_timeout, chat_template=template)  # fmt: skip
    except ValueError as e:  # (a template that does not parse)
        raise SystemExit(f"specdec serve: --chat-template: {e}") from None
    # What exists now lives as long as the server (the model, the imports): frozen out of the collector's reach, a full
    # collection walks only the requests' objects, not ~300,000 more (a ~0.1 s pause of every step in flight).
    gc.collect()
    gc.freeze()
    host = f"[{args.host}]" if ":" in args.host else args.host
    print(f"[specdec] serving '{name}' at http://{host}:{args.port}/v1 (OpenAI API; /health, /metrics)", flush=True)
    config = uvicorn_config(app, args.host, args.port, max_header_bytes=args.max_header_bytes,
                            log_level=getattr(args, "log_level", "info"))  # fmt: skip
    uvicorn.Server(config).run()
    gc.unfreeze()  # collectable again at exit (frozen objects left alive then make extension modules report leaks)
    return 0
