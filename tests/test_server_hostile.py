"""The server under hostile clients (issue 22): one request can never hurt another.

A real uvicorn server on loopback (the guarded h11 layer, ``request_timeout`` of 1 s), driven with raw sockets for
malformed HTTP and with httpx for the rest. Every case is bounded: a socket read gives up after ``HANG_GUARD``
seconds (a hang guard, never the pass/fail criterion: the tests assert what the server answered and that it closed).

The cases, each a finding of the issue: values that overflow or vanish in the engine's float32/int64 tensors; lone
surrogates; deeply nested JSON; 5xx (counted, and with ``Connection: close``); Content-Length with
Transfer-Encoding; oversized heads in one write or many; stalled heads and bodies; tokenising a long prompt off the
event loop; a fault planted in one request's engine row among concurrent requests; and a soak of mixed clients.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import select
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from tiny_models import make_model, make_tokenizer, serve_in_thread

import spec_engine.runner
from bench.load_server import run_soak
from spec_engine import LLM, SamplingParams
from spec_engine.engine import EngineConfig
from spec_engine.server.app import create_app
from spec_engine.server.requests import MAX_JSON_DEPTH

CONTEXT = 512
REQUEST_TIMEOUT = 1.0  # seconds; small so that the stall tests end fast
MAX_HEADER_BYTES = 8192
BODY_LIMIT = 256 << 10
HANG_GUARD = 20.0  # seconds a socket read may wait before the test gives up: far above any expected answer


@contextlib.contextmanager
def running_server(llm: LLM):
    llm.generate(["warm up"], SamplingParams(max_tokens=4), use_tqdm=False)
    app = create_app(llm, "tiny", max_pending=32, max_body_bytes=BODY_LIMIT, request_timeout=REQUEST_TIMEOUT)
    with serve_in_thread(app, max_header_bytes=MAX_HEADER_BYTES, log_level="critical") as port:
        yield port, app, llm


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile_models")
    vocab = make_tokenizer(root / "target").get_vocab_size()
    make_model(root / "target", "llama_gqa", vocab_size=vocab, logit_scale=4.0, max_position_embeddings=CONTEXT)
    make_tokenizer(root / "draft")
    make_model(root / "draft", "llama_gqa", vocab_size=vocab, logit_scale=4.0, max_position_embeddings=CONTEXT)
    spec = {"method": "draft_model", "model": str(root / "draft"), "num_speculative_tokens": 3}
    with running_server(LLM(root / "target", spec, max_num_seqs=8)) as s:
        yield s


def url(server) -> str:
    return f"http://127.0.0.1:{server[0]}"


def health(server) -> dict:
    return httpx.get(url(server) + "/health").json()


def wait_idle(server) -> dict:
    deadline = time.monotonic() + HANG_GUARD
    while True:
        h = health(server)
        if h["num_requests_in_flight"] == 0 and h["num_requests_running"] == 0 or time.monotonic() > deadline:
            return h
        time.sleep(0.05)


def metric(server, name: str, **labels) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in httpx.get(url(server) + "/metrics").text.splitlines():
        if line.startswith(f"{name}{{{want}}} " if labels else f"{name} "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def complete(server, prompt, max_tokens: int = 8) -> str:
    r = httpx.post(url(server) + "/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


# --- raw HTTP --------------------------------------------------------------------------------------------------


def post_head(path: str, length: int | None, extra: str = "") -> bytes:
    cl = f"Content-Length: {length}\r\n" if length is not None else ""
    return f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n{cl}{extra}\r\n".encode()


def raw_post(path: str, body: bytes) -> bytes:
    return post_head(path, len(body)) + body


def talk(server, *chunks: bytes, pause: float = 0.0) -> tuple[list[tuple[int, dict, bytes]], bool]:
    """Send ``chunks`` on one connection (``pause`` seconds apart), then read until the server closes it.

    Returns the responses (status, headers, body) and whether the server closed the connection (a reset counts:
    a server closing on unread input resets the connection, which may also drop its last response)."""
    with socket.create_connection(("127.0.0.1", server[0]), timeout=HANG_GUARD) as sock:
        data, closed = b"", False
        try:
            for i, chunk in enumerate(chunks):
                if i and pause:
                    time.sleep(pause)
                if select.select([sock], [], [], 0)[0]:  # the server answered already: read before a reset drops it
                    break
                sock.sendall(chunk)
            while chunk := sock.recv(65536):
                data += chunk
            closed = True
        except (ConnectionResetError, BrokenPipeError):
            closed = True
        except TimeoutError:
            pass
    return parse_responses(data), closed


def parse_responses(data: bytes) -> list[tuple[int, dict, bytes]]:
    out = []
    while True:
        head, sep, rest = data.partition(b"\r\n\r\n")
        if not sep:
            return out
        lines = head.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
        n = int(headers.get("content-length", 0))
        out.append((int(lines[0].split()[1]), headers, rest[:n]))
        data = rest[n:]


def error_of(body: bytes) -> dict:
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


# --- 1. values that break the engine's tensors: 400 at the edge -------------------------------------------------

FLOAT32_EDGES = {  # field: value that passes as a Python number but not as float32 / int64
    "temperature": 1e300,  # inf in float32
    "top_p": 1e-300,  # 0 in float32
    "top_k": 2**64,  # overflows int64
    "seed": 2**64,  # past torch.Generator's 64 bits
}


@pytest.mark.parametrize("field", list(FLOAT32_EDGES))
def test_values_that_overflow_the_engine_tensors_get_400(field, server):
    good = ["hello world", "def fib(n):", "the quick brown fox", "x"]
    alone = [complete(server, p) for p in good]
    bad = {"prompt": "x", "max_tokens": 4, field: FLOAT32_EDGES[field]}
    with ThreadPoolExecutor(5) as pool:
        futures = [pool.submit(complete, server, p) for p in good]
        r = httpx.post(url(server) + "/v1/completions", json=bad)
        together = [f.result() for f in futures]
    assert r.status_code == 400 and error_of(r.content)["param"] == field, r.text
    assert together == alone  # the requests beside it never noticed
    assert wait_idle(server)["kv_blocks_used"] == 0


# --- 2. no 500 from input ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path,body",
    [
        ("/v1/completions", b'{"prompt": "\\ud800abc", "max_tokens": 2}'),  # a lone surrogate as a JSON escape
        ("/v1/completions", b'{"prompt": "\xed\xa0\x80abc", "max_tokens": 2}'),  # the same as raw bytes
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udfffx"}]}'),
        ("/v1/completions", b'{"prompt": "x", "model": "\\ud800"}'),  # a field echoed back in an error message
        ("/v1/completions", b"[" * 200_000),  # RecursionError in json
        ("/v1/completions", b'{"prompt": "x", "extra": ' + b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH + b"}"),
    ],
    ids=["surrogate_escape", "surrogate_bytes", "surrogate_chat", "surrogate_model", "nested_200k", "nested_65"],
)  # fmt: skip
def test_invalid_unicode_and_deep_nesting_get_400(path, body, server):
    endpoint = "completions" if path == "/v1/completions" else "chat_completions"
    before = metric(server, "specdec_http_requests_total", endpoint=endpoint, status="400")
    r = httpx.post(url(server) + path, content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert error_of(r.content)["code"] == "invalid_json"
    assert metric(server, "specdec_http_requests_total", endpoint=endpoint, status="400") == before + 1
    assert complete(server, "still there?", 2)


def test_a_valid_surrogate_pair_is_fine(server):
    r = httpx.post(url(server) + "/v1/completions", content=b'{"prompt": "smile \\ud83d\\ude00", "max_tokens": 2}')
    assert r.status_code == 200, r.text


def test_5xx_is_counted_and_closes_the_connection(server, monkeypatch):
    """A bug behind an endpoint (planted): 500 with OpenAI's body, counted, and ``Connection: close`` so that a
    keep-alive client does not send its next request into a closing socket; the server keeps serving."""
    engine = server[1].state.engine

    async def broken(*args, **kwargs):
        raise RuntimeError("planted bug")

    before = metric(server, "specdec_http_requests_total", endpoint="completions", status="500")
    monkeypatch.setattr(engine, "add_request", broken)
    body = json.dumps({"prompt": "x", "max_tokens": 2}).encode()
    responses, closed = talk(server, raw_post("/v1/completions", body) + raw_post("/v1/completions", body))
    assert [r[0] for r in responses] == [500] and closed  # the pipelined second request is not read
    assert responses[0][1]["connection"] == "close" and "planted bug" in error_of(responses[0][2])["message"]
    assert metric(server, "specdec_http_requests_total", endpoint="completions", status="500") == before + 1
    monkeypatch.undo()
    assert complete(server, "after the bug", 2)
    with httpx.Client(base_url=url(server)) as c:  # keep-alive: five requests on one connection, all answered
        for _ in range(5):
            assert c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 200


# --- 3-5. HTTP hygiene -----------------------------------------------------------------------------------------


def test_content_length_with_transfer_encoding_is_refused_and_closed(server):
    smuggled = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    body = b"0\r\n\r\n" + smuggled
    head = post_head("/v1/completions", len(body), "Transfer-Encoding: chunked\r\n")
    before = metric(server, "specdec_http_requests_total", endpoint="http", status="400")
    responses, closed = talk(server, head + body)
    assert [r[0] for r in responses] == [400] and closed  # the hidden request is never answered
    assert metric(server, "specdec_http_requests_total", endpoint="http", status="400") == before + 1
    assert responses[0][1]["connection"] == "close" and "Transfer-Encoding" in error_of(responses[0][2])["message"]


@pytest.mark.parametrize("pieces", [1, 25], ids=["one_write", "4kb_writes"])
def test_oversized_headers_are_refused(pieces, server):
    head = post_head("/v1/completions", 2, "X-Filler: " + "a" * 100_000 + "\r\n") + b"{}"
    size = -(-len(head) // pieces)
    before = metric(server, "specdec_http_requests_total", endpoint="http", status="431")
    responses, closed = talk(server, *(head[i : i + size] for i in range(0, len(head), size)))
    assert closed and all(r[0] == 431 for r in responses)  # 431, or a reset before it could be read: never served
    assert metric(server, "specdec_http_requests_total", endpoint="http", status="431") == before + 1


def test_headers_under_the_cap_are_fine(server):
    body = json.dumps({"prompt": "x", "max_tokens": 1}).encode()
    head = post_head("/v1/completions", len(body), "X-Filler: " + "a" * (MAX_HEADER_BYTES // 2) + "\r\n")
    last = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    responses, closed = talk(server, head + body + last)
    assert [r[0] for r in responses] == [200, 200] and closed


@pytest.mark.parametrize(
    "chunks",
    [
        [],  # connects and sends nothing
        [b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"],  # a head that never ends
        [b"P", b"O", b"S", b"T", b" ", b"/", b"v", b"1", b"/"],  # slowloris: a byte every 0.3 s, never a full head
    ],
    ids=["silent", "half_head", "slowloris"],
)
def test_stalled_heads_time_out(chunks, server):
    """Closed after ``REQUEST_TIMEOUT``: with a 408 when part of a request came, without a word when nothing did."""
    before = metric(server, "specdec_http_requests_total", endpoint="http", status="408")
    responses, closed = talk(server, *chunks, pause=0.3)
    assert closed, f"the server held a stalled connection open for {HANG_GUARD} s"
    assert [r[0] for r in responses] == ([408] if chunks else [])
    if chunks:
        assert responses[0][1]["connection"] == "close" and error_of(responses[0][2])["code"] == "request_timeout"
    expected = before + 1 if chunks else before
    assert metric(server, "specdec_http_requests_total", endpoint="http", status="408") == expected


def test_an_idle_keep_alive_connection_is_closed_without_a_408(server):
    responses, closed = talk(server, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    assert closed and [r[0] for r in responses] == [200]


def test_stalled_body_times_out_and_is_counted(server):
    before = metric(server, "specdec_http_requests_total", endpoint="completions", status="408")
    responses, closed = talk(server, post_head("/v1/completions", 100) + b'{"prompt": "x"')
    assert closed and [r[0] for r in responses] == [408]
    assert responses[0][1]["connection"] == "close"
    assert metric(server, "specdec_http_requests_total", endpoint="completions", status="408") == before + 1


def test_long_prompts_are_tokenised_off_the_event_loop(server, monkeypatch):
    """A 200,000-character prompt: tokenised in a worker thread (``encode_batch``, which releases the GIL), while
    /health is served. (The issue measured /health at 456 ms behind a 1,000,000-character prompt.)"""
    llm = server[2]
    threads = []

    class Spy:
        def __getattr__(self, name):
            return getattr(llm.tokenizer_, name)

        def encode(self, *args, **kwargs):
            threads.append(threading.current_thread().name)
            return llm.tokenizer_.encode(*args, **kwargs)

        def encode_batch(self, *args, **kwargs):
            threads.append(threading.current_thread().name)
            return llm.tokenizer_.encode_batch(*args, **kwargs)

    monkeypatch.setattr(llm, "tokenizer_", llm.tokenizer, raising=False)
    monkeypatch.setattr(llm, "tokenizer", Spy())
    r = httpx.post(url(server) + "/v1/completions", json={"prompt": "fox " * 50_000, "max_tokens": 1})
    assert r.status_code == 400 and error_of(r.content)["code"] == "context_length_exceeded"
    assert threads and all(t.startswith("asyncio_") for t in threads), threads  # the default executor's workers


def test_logprobs_responses_are_built_off_the_event_loop(server, monkeypatch):
    """A response's logprobs (n choices, the prompt's too: megabytes of JSON) are built in a worker thread, not on
    the event loop that serves /health and every other stream."""
    import spec_engine.server.app as app_module

    threads, real = [], app_module.completion_logprobs

    def spy(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(app_module, "completion_logprobs", spy)
    body = {"prompt": "fox " * 40, "max_tokens": 4, "logprobs": 5, "echo": True, "n": 2}
    r = httpx.post(url(server) + "/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert threads and all(t.startswith("asyncio_") for t in threads), threads


# --- isolation: a planted engine fault fails one request only ----------------------------------------------------


def test_a_faulty_request_fails_alone(server, monkeypatch, request):
    """``verify_tree`` raises for any tree whose root is the POISON token (planted): the request whose prompt ends
    in it gets 500 (or an SSE error event then [DONE]); the three decoding beside it finish with the tokens they get
    alone, and nothing leaks."""
    engine = server[1].state.engine
    good = [[5, 17, 3, 60], [9, 8, 7], [40, 41, 42, 43, 44]]

    async def alone(ids):
        stream = await engine.add_request(ids, SamplingParams(max_tokens=12))
        deltas = [d async for d in stream]
        return [t for d in deltas for t in d.token_ids], "".join(d.text for d in deltas)

    solo = [asyncio.run(alone(ids)) for ids in good]
    used = {t for ids, (out, _) in zip(good, solo) for t in ids + out}
    poison = next(t for t in range(1, 256) if t not in used)
    real = spec_engine.runner.verify_tree

    def faulty(target_logits, draft_tokens, parents, **kwargs):
        if bool((draft_tokens[:, 0] == poison).any()):
            raise RuntimeError(f"planted fault: token {poison} at a root")
        return real(target_logits, draft_tokens, parents, **kwargs)

    before = health(server)
    errors_before = metric(server, "specdec_requests_total", reason="error")
    http500_before = metric(server, "specdec_http_requests_total", endpoint="completions", status="500")
    monkeypatch.setattr(spec_engine.runner, "verify_tree", faulty)
    # the fault sits in the regular step's verify: steps in one native call (no verify_tree) and greedy trees'
    # one-call verification are turned off; they fail under the same per-request isolation (Engine._isolated wraps
    # the whole decode)
    request.addfinalizer(lambda config=engine.engine.config: engine.engine.reconfigure(config))
    engine.engine.reconfigure(EngineConfig(plain_chain=1, spec_chain_steps=0, native_tree_step=False))

    def post(ids, stream=False):
        body = {"prompt": ids, "max_tokens": 12, "temperature": 0, "stream": stream}
        return httpx.post(url(server) + "/v1/completions", json=body, timeout=HANG_GUARD * 3)

    for poison_streams in (False, True):
        with ThreadPoolExecutor(4) as pool:
            bad = pool.submit(post, [1, 2, poison], poison_streams)
            futures = [pool.submit(post, ids, i == 0) for i, ids in enumerate(good)]
            responses = [f.result() for f in futures]
            bad = bad.result()
        if poison_streams:
            events = [line[6:] for line in bad.text.splitlines() if line.startswith("data: ")]
            assert bad.status_code == 200 and events[-1] == "[DONE]"
            assert "planted fault" in json.loads(events[-2])["error"]["message"]
        else:
            assert bad.status_code == 500 and "planted fault" in error_of(bad.content)["message"]
            assert bad.headers["connection"] == "close"
        texts = []
        for r in responses:
            assert r.status_code == 200
            if r.headers["content-type"].startswith("text/event-stream"):
                chunks = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
                texts.append("".join(c["choices"][0]["text"] for c in chunks if c["choices"]))
            else:
                texts.append(r.json()["choices"][0]["text"])
        assert texts == [text for _, text in solo]
    h = wait_idle(server)
    assert h["kv_blocks_used"] == 0 and h["num_requests_in_flight"] == 0
    assert h["num_requests_finished"]["error"] - before["num_requests_finished"]["error"] == 2
    assert metric(server, "specdec_requests_total", reason="error") == errors_before + 2
    assert metric(server, "specdec_http_requests_total", endpoint="completions", status="500") == http500_before + 2


def test_a_fault_delivering_one_output_fails_that_request_alone(server, monkeypatch):
    """A fault turning one request's output into a delta (planted in the loop thread's decoding of its text) fails
    that request alone, with finish reason "error" (500), instead of killing the loop thread and hanging every
    request; the request beside it finishes, and nothing leaks."""
    engine = server[1].state.engine
    real = engine._new_text

    def faulty(sink, output_ids, finished, params=None):
        if params is not None and params.max_tokens == 7:  # (the planted request's mark)
            raise RuntimeError("planted delivery fault")
        return real(sink, output_ids, finished, params)

    monkeypatch.setattr(engine, "_new_text", faulty)
    before = health(server)

    def post(max_tokens):
        body = {"prompt": [5, 17, 3], "max_tokens": max_tokens, "temperature": 0}
        return httpx.post(url(server) + "/v1/completions", json=body, timeout=HANG_GUARD * 3)

    with ThreadPoolExecutor(2) as pool:
        bad, good = pool.submit(post, 7), pool.submit(post, 12)
        bad, good = bad.result(), good.result()
    assert bad.status_code == 500 and "planted delivery fault" in error_of(bad.content)["message"]
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 12
    h = wait_idle(server)
    assert h["status"] == "ok" and h["kv_blocks_used"] == 0 and h["num_requests_in_flight"] == 0
    assert h["num_requests_finished"]["error"] - before["num_requests_finished"]["error"] == 1


# --- the soak --------------------------------------------------------------------------------------------------


def test_soak_of_mixed_clients_ends_clean(server):
    """40 requests over ~4 s: streamed and not, read to the end or left mid-request, greedy and seeded."""
    r = asyncio.run(run_soak(url(server), num_requests=40, duration_s=4.0, max_tokens=24))
    assert r["in_flight_after"] == 0 and r["kv_blocks_used_after"] == 0
    assert r["lost"] == 0 and r["server_5xx"] == 0
    assert set(r["statuses"]) <= {"200", "left"}, r["statuses"]
    assert r["statuses"].get("200", 0) >= 20  # the two kinds that read to the end, at least
    assert r["tokens"] == 24 * len([1 for i in range(40) if i % 4 < 2])
