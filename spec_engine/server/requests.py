"""The request side of the server: a body read whole within its limits (``read_body_bytes``), parsed
(``parse_json``: JSON depth, lone surrogates) and validated as its OpenAI request (``validate``), then turned into the
engine's ``SamplingParams`` (``sampling_params``). Every refusal is an ``APIError``. The routes are in ``app``; the
response side is ``responses``."""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING

from fastapi import Request
from pydantic import ValidationError
from starlette.requests import ClientDisconnect

from spec_engine.sampling import SamplingParams
from spec_engine.server.protocol import SamplingRequest, error_param
from spec_engine.server.responses import APIError

if TYPE_CHECKING:
    from spec_engine.llm import LLM

MAX_JSON_DEPTH = 64  # an OpenAI body nests 4 deep (messages[i].content[j].text); 200,000 '[' hit RecursionError


async def read_body_bytes(request: Request, max_body_bytes: int, timeout: float) -> bytes:
    """The body, whole: 413 past ``max_body_bytes`` (its Content-Length, or while reading), 408 when it has not
    arrived ``timeout`` seconds after the head, 499 when the client left."""
    length = request.headers.get("content-length")
    if length is not None and (not length.isdigit() or int(length) > max_body_bytes):
        raise APIError(413, f"request body over {max_body_bytes} bytes", code="request_too_large")
    body = bytearray()
    try:
        async with asyncio.timeout(timeout):
            async for chunk in request.stream():
                body += chunk
                if len(body) > max_body_bytes:
                    raise APIError(413, f"request body over {max_body_bytes} bytes", code="request_too_large")
    except TimeoutError:
        msg = f"the request body did not arrive within {timeout:g} s"
        raise APIError(408, msg, code="request_timeout") from None
    except ClientDisconnect:
        raise APIError(499, "client closed the request", code="client_closed_request") from None
    return bytes(body)


def parse_json(body: bytes):
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


def validate(body: bytes, model_cls, served_model_name: str):
    """``body`` as a ``model_cls`` request: 400 for bad JSON or a field the model rejects or this server does not
    support, 404 for another model than ``served_model_name``."""
    data = parse_json(body)
    try:
        req = model_cls.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        param = error_param(err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        raise APIError(400, f"{param}: {msg}" if param else msg, param=param, code=err["type"]) from None
    if isinstance(req, SamplingRequest):
        unsupported = req.unsupported_field()
        if unsupported is not None:
            raise APIError(400, f"'{unsupported}' is not supported by this server", param=unsupported)
        if req.stream_options is not None and not req.stream:  # (as OpenAI answers it)
            raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options")
    if req.model is not None and req.model != served_model_name:
        raise APIError(404, f"the model '{req.model}' does not exist; this server serves '{served_model_name}'",
                       param="model", code="model_not_found")  # fmt: skip
    return req


def sampling_params(llm: LLM, req, prompt_len: int, max_tokens: int | None, default_max_tokens: int) -> SamplingParams:
    """The engine's ``SamplingParams`` for a completions or chat request ``req`` whose prompt has ``prompt_len``
    tokens; 400 where it does not fit ``llm``'s context or a parameter is out of range."""
    room = llm.max_model_len - prompt_len
    if room < 1:
        msg = f"the prompt has {prompt_len} tokens: no room for output in the context of {llm.max_model_len}"
        raise APIError(400, msg, param="prompt", code="context_length_exceeded")
    if max_tokens is not None and max_tokens > room:
        msg = f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) is past the context ({llm.max_model_len})"
        raise APIError(400, msg, param="max_tokens", code="context_length_exceeded")
    bias = None
    if req.logit_bias is not None:
        if not all(k.isascii() and k.isdigit() and len(k) <= 19 and str(int(k)) == k for k in req.logit_bias):
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
        llm.inputs.require_tokenizer(params)
        return llm.inputs.word_ids(params)
    except ValueError as e:  # "top_p must be ...": the message starts with the field's name
        field = str(e).split(" ", 1)[0].removeprefix("SamplingParams.")
        named = req.guide_field(field)  # (the field the client named a guide by, in the message too)
        message = str(e) if named == field else f"{named}: {str(e).replace(field, 'its guide', 1)}"
        raise APIError(400, message, param=named if named in type(req).model_fields else None) from None
