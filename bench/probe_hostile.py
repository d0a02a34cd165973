"""The findings of issue 22, probed as a hostile client would, against an in-process server on loopback.

    python bench/probe_hostile.py                     # this checkout
    python bench/probe_hostile.py --root /tmp/old     # another checkout (e.g. `git archive REV | tar -x -C /tmp/old`)

Prints one line per finding (what the server answered) and saves JSON to bench/out/probe_hostile[_LABEL].json.
Uses the tiny random models of tests/tiny_models.py (target + draft with the same weights), so the figures are
about the server, not the model.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import select
import socket
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def start(root: Path, request_timeout: float):
    sys.path[:0] = [str(root), str(ROOT / "tests")]
    import uvicorn
    from tiny_models import make_model, make_tokenizer

    from spec_engine import LLM, SamplingParams
    from spec_engine.server import app as server_app

    models = Path(tempfile.mkdtemp(prefix="probe_hostile_"))
    vocab = make_tokenizer(models / "target").get_vocab_size()
    make_tokenizer(models / "draft")
    for name in ("target", "draft"):
        make_model(models / name, "llama_gqa", vocab_size=vocab, logit_scale=4.0, max_position_embeddings=1024)
    spec = {"method": "draft_model", "model": str(models / "draft"), "num_speculative_tokens": 3}
    llm = LLM(models / "target", spec, max_num_seqs=8)
    llm.generate(["warm up"], SamplingParams(max_tokens=4), use_tqdm=False)
    if hasattr(server_app, "uvicorn_config"):  # the guarded HTTP layer
        app = server_app.create_app(llm, "tiny", max_body_bytes=2 << 20, request_timeout=request_timeout)
        config = server_app.uvicorn_config(app, port=0, log_level="critical")
    else:
        app = server_app.create_app(llm, "tiny", max_body_bytes=2 << 20)
        config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="critical")
    server = uvicorn.Server(config)
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.02)
    return server.servers[0].sockets[0].getsockname()[1], app


def talk(port: int, payload: bytes, guard: float = 10.0) -> tuple[list[int], bool]:
    """Send ``payload``, read until the server closes (or ``guard`` s): the statuses answered, and whether it closed."""
    with socket.create_connection(("127.0.0.1", port), timeout=guard) as sock:
        data, closed = b"", False
        try:
            sock.sendall(payload)
            while chunk := sock.recv(65536):
                data += chunk
            closed = True
        except (ConnectionResetError, BrokenPipeError):
            closed = True
        except TimeoutError:
            pass
    return [int(m) for m in re.findall(rb"HTTP/1\.1 (\d{3}) ", data)], closed


def post(path: str, body: bytes, extra: str = "") -> bytes:
    return f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n{extra}\r\n".encode() + body


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", default=str(ROOT), help="the checkout whose spec_engine to serve")
    ap.add_argument("--label", default="after")
    ap.add_argument("--request-timeout", type=float, default=2.0)
    args = ap.parse_args()
    port, app = start(Path(args.root), args.request_timeout)
    import httpx

    base = f"http://127.0.0.1:{port}"
    http = httpx.Client(base_url=base, timeout=60)
    results = {}

    def status(path: str, body: bytes):
        try:
            return http.post(path, content=body).status_code
        except httpx.HTTPError as e:
            return type(e).__name__

    def report(name: str, value) -> None:
        results[name] = value
        print(f"{name:<34} {value}", flush=True)

    # 1. one bad value among 4 requests decoding
    for field, value in (("temperature", 1e300), ("top_p", 1e-300), ("top_k", 2**64)):
        with ThreadPoolExecutor(5) as pool:
            good = [pool.submit(http.post, "/v1/completions", json={"prompt": f"req {i}", "max_tokens": 400,
                                                                     "temperature": 0}) for i in range(4)]  # fmt: skip
            time.sleep(0.3)  # the four are decoding
            bad = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 4, field: value}).status_code
            report(f"{field}={value:g}: bad / others", f"{bad} / {[f.result().status_code for f in good]}")
    # 2. no 500 from input
    for name, body in (("lone surrogate prompt", b'{"prompt": "\\ud800abc", "max_tokens": 2}'),
                       ("200,000 nested [", b"[" * 200_000)):  # fmt: skip
        report(name, status("/v1/completions", body))
    chat = b'{"messages": [{"role": "user", "content": "\\ud800abc"}], "max_tokens": 2}'
    report("lone surrogate chat content", status("/v1/chat/completions", chat))
    # a 500 (planted bug), then the next request on the same keep-alive connection
    engine, failures, statuses = app.state.engine, 0, set()
    real = engine.add_request

    async def broken(*a, **k):
        raise RuntimeError("planted bug")

    def count_500() -> float:
        text = httpx.get(base + "/metrics").text  # a fresh connection: the shared one may be closing after a 500
        lines = [x for x in text.splitlines() if x.startswith("specdec_http_requests_total{") and 'status="500"' in x]
        return sum(float(x.rsplit(" ", 1)[1]) for x in lines)

    before = count_500()
    for _ in range(5):
        with httpx.Client(base_url=base, timeout=30) as c:
            engine.add_request = broken
            try:
                r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
                statuses.add((r.status_code, r.headers.get("connection")))
            except httpx.HTTPError as e:
                statuses.add(type(e).__name__)
            engine.add_request = real
            try:
                c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}).raise_for_status()
            except httpx.HTTPError:
                failures += 1
    report("planted 500: (status, Connection)", sorted(statuses, key=str))
    report("  next keep-alive request failed", f"{failures} of 5")
    report("  counted in http_requests_total", count_500() - before)
    # 3. request smuggling
    body = b'{"prompt": "x", "max_tokens": 1}'
    chunked = f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\nGET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    statuses, closed = talk(port, post("/v1/completions", chunked, "Transfer-Encoding: chunked\r\n"))
    report("CL + TE: statuses, closed", f"{statuses}, {closed}")
    # 4. a 100 KB header in one write
    statuses, closed = talk(port, post("/health", b"", "X-Filler: " + "a" * 100_000 + "\r\n").replace(b"POST", b"GET"))
    report("100 KB header, one write", f"{statuses}, closed={closed}")
    # 5. stalled clients, and a 1,000,000-character prompt vs /health
    stalled = [socket.create_connection(("127.0.0.1", port)) for _ in range(17)]
    for s in stalled:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    time.sleep(args.request_timeout + 2)
    still_open = sum(1 for s in stalled if not select.select([s], [], [], 0)[0])
    report(f"17 stalled, open after {args.request_timeout + 2:g} s", still_open)
    for s in stalled:
        s.close()
    lags, done = [], threading.Event()

    def poll():
        with httpx.Client(base_url=base, timeout=60) as c:
            while not done.is_set():
                c.get("/health")
                lags.append(time.perf_counter())
                time.sleep(0.01)

    poller = threading.Thread(target=poll)
    poller.start()
    while len(lags) < 5:  # the poller is warm
        time.sleep(0.01)
    t0 = time.perf_counter()
    r = http.post("/v1/completions", json={"prompt": "fox " * 250_000, "max_tokens": 1})
    took = time.perf_counter() - t0
    done.set()
    poller.join()
    code = r.json()["error"]["code"] if r.status_code != 200 else ""
    report("1M-char prompt: status, took", f"{r.status_code} {code}, {1000 * took:.0f} ms")
    # the client polls in this process, so a server holding the GIL starves it too: the figure is the longest time
    # between two answers to a client polling every 10 ms (the issue timed /health at 456 ms from outside)
    gap = max(b - a for a, b in zip(lags[4:], lags[5:]))
    report("  /health meanwhile: longest gap", f"{1000 * gap:.0f} ms over {len(lags) - 5} polls")
    out = ROOT / "bench" / "out" / f"probe_hostile_{args.label}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": platform.node(), "root": args.root, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
