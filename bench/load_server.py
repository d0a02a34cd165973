"""Bounded load against ``specdec serve`` on loopback: N requests, C concurrent clients, per speculation method.

For each method it starts a server in-process (a uvicorn thread on a free 127.0.0.1 port), or uses ``--url`` (a
loopback server you started), then runs N greedy /v1/completions requests with C in flight at once and prints one
line per (method, clients): request and token throughput, p50/p95 end-to-end latency, p50 time to first token
(streamed), and the engine's acceptance rate (alpha) and tokens per target pass (tau) over the run.

    python bench/load_server.py --quick --tiny            # a tiny random pair made on the spot (see make_tiny_pair)
    python bench/load_server.py --model DIR --draft DIR   # default: the embedded default pair
    python bench/load_server.py --tiny --soak 30          # the soak (issue 22): mixed clients for 30 s, see run_soak

There is no roofline here: the figure of merit is throughput at a latency, and the baseline is ``none`` (no
speculation) on the same server and load. JSON goes to bench/out/load_server.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

import httpx
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROMPTS = ["def fib(n):", "the quick brown fox", "hello world, hello server", "speculative decoding drafts",
           "Once upon a time", "import numpy as np\n", "The capital of France is", "for i in range(10):"]  # fmt: skip


def make_tiny_pair(root: Path, layers: int, hidden: int) -> tuple[str, str]:
    """A random target whose layers past the second barely move the residual stream, and a draft that is exactly
    its first two layers: the draft agrees with the target often (like a trained pair) at 2/layers of the cost.
    Needs transformers and tokenizers (test dependencies)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from tiny_models import make_model, make_tokenizer
    from transformers import LlamaForCausalLM

    target, draft = root / "target", root / "draft"
    if (draft / "config.json").is_file():
        return str(target), str(draft)
    vocab = make_tokenizer(target).get_vocab_size()
    make_tokenizer(draft)
    make_model(
        target,
        "llama_gqa",
        vocab_size=vocab,
        layers=layers,
        hidden=hidden,
        logit_scale=4.0,
        max_position_embeddings=1024,
    )
    model = LlamaForCausalLM.from_pretrained(target)
    for layer in model.model.layers[2:]:
        layer.self_attn.o_proj.weight.data.mul_(0.02)
        layer.mlp.down_proj.weight.data.mul_(0.02)
    model.save_pretrained(target)
    model.config.num_hidden_layers = 2
    model.model.layers = model.model.layers[:2]
    model.save_pretrained(draft)
    return str(target), str(draft)


def start_server(model: str, draft: str | None, method: str, gamma: int, max_num_seqs: int):
    import uvicorn

    from spec_engine import LLM, SamplingParams
    from spec_engine.server.app import create_app, uvicorn_config

    spec = None
    if method == "draft_model":
        spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": gamma}
    elif method == "ngram":
        spec = {"method": "ngram", "num_speculative_tokens": gamma}
    llm = LLM(model, spec, max_num_seqs=max_num_seqs)
    llm.generate(["warm up"], SamplingParams(max_tokens=8), use_tqdm=False)
    app = create_app(llm, "bench", max_pending=1024)
    server = uvicorn.Server(uvicorn_config(app, port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]

    def stop():
        server.should_exit = True
        thread.join()

    return f"http://127.0.0.1:{port}", stop


async def run_load(url: str, num_requests: int, clients: int, max_tokens: int) -> dict:
    """N streamed greedy requests, ``clients`` at a time; latencies are per request, end to end."""
    sem = asyncio.Semaphore(clients)
    latencies, ttfts, tokens = [], [], []

    async def one(client: httpx.AsyncClient, i: int):
        body = {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}, "ignore_eos": True}  # fmt: skip
        async with sem:
            t0 = time.perf_counter()
            first = None
            async with client.stream("POST", "/v1/completions", json=body) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    if line.startswith("data: {") and first is None:
                        first = time.perf_counter()
                    if line.startswith("data: {") and '"usage"' in line:
                        tokens.append(json.loads(line[6:])["usage"]["completion_tokens"])
            latencies.append(time.perf_counter() - t0)
            ttfts.append((first or t0) - t0)

    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        before = (await client.get("/health")).json()
        t0 = time.perf_counter()
        await asyncio.gather(*(one(client, i) for i in range(num_requests)))
        wall = time.perf_counter() - t0
        after = (await client.get("/health")).json()
    drafted = after["num_drafted_tokens"] - before["num_drafted_tokens"]
    accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
    steps = after["num_steps"] - before["num_steps"]
    q = statistics.quantiles(latencies, n=20) if len(latencies) > 1 else latencies * 19
    return {
        "requests": num_requests,
        "clients": clients,
        "wall_s": wall,
        "req_per_s": num_requests / wall,
        "tok_per_s": sum(tokens) / wall,
        "latency_p50_s": statistics.median(latencies),
        "latency_p95_s": q[18],
        "ttft_p50_s": statistics.median(ttfts),
        "alpha": accepted / drafted if drafted else None,
        "tau": (accepted + steps) / steps if steps else None,
        "kv_blocks_used_after": after["kv_blocks_used"],
    }


SOAK_KINDS = ("stream", "complete", "stream_then_leave", "complete_then_leave")


async def run_soak(url: str, num_requests: int, duration_s: float, max_tokens: int, leave_after_s: float = 0.05):
    """The soak of issue 22: ``num_requests`` requests started evenly over ``duration_s`` seconds, cycling through
    ``SOAK_KINDS``: streamed and non-streamed requests read to the end, and clients that leave mid-request (a stream
    closed after its first chunk; a non-streamed request dropped after ``leave_after_s``). Sampling alternates
    between greedy and seeded. Ends once the server is idle (or 60 s after the last request, a hang guard).

    Returns the figures: requests, tokens, p50/p95 latency of the requests read to the end, responses by status
    (clients that left have none: "left"), "lost" (requests that neither finished nor were left by their client,
    per the engine's own totals), 5xx seen by /metrics, and the final in-flight count and KV blocks.
    """
    statuses: dict[str, int] = {}
    latencies, tokens = [], []

    def seen(status) -> None:
        statuses[str(status)] = statuses.get(str(status), 0) + 1

    async def one(client: httpx.AsyncClient, i: int, start: float):
        await asyncio.sleep(max(0.0, start - time.perf_counter()))
        kind = SOAK_KINDS[i % len(SOAK_KINDS)]
        body = {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": max_tokens, "ignore_eos": True,
                "temperature": 0.0 if i % 2 else 0.8, "seed": i, "stream": kind.startswith("stream"),
                "stream_options": {"include_usage": True} if kind.startswith("stream") else None}  # fmt: skip
        t0 = time.perf_counter()
        if kind == "complete":
            r = await client.post("/v1/completions", json=body)
            seen(r.status_code)
            if r.status_code == 200:
                tokens.append(r.json()["usage"]["completion_tokens"])
                latencies.append(time.perf_counter() - t0)
        elif kind == "complete_then_leave":
            try:
                r = await asyncio.wait_for(client.post("/v1/completions", json=body), leave_after_s)
                seen(r.status_code)  # finished before the client left
            except TimeoutError:
                seen("left")
        else:
            async with client.stream("POST", "/v1/completions", json=body) as r:
                seen(r.status_code if kind == "stream" or r.status_code != 200 else "left")
                if r.status_code != 200:
                    return
                async for line in r.aiter_lines():
                    if kind == "stream_then_leave" and line.startswith("data: {"):
                        break  # leaving the block closes the connection mid-stream
                    if line.startswith("data: {") and '"usage"' in line:
                        tokens.append(json.loads(line[6:])["usage"]["completion_tokens"])
                    if line.startswith("data: {") and '"error"' in line:
                        seen("stream_error")
                if kind == "stream":
                    latencies.append(time.perf_counter() - t0)

    def scrape(text: str) -> int:
        return sum(int(float(line.rsplit(" ", 1)[1])) for line in text.splitlines()
                   if line.startswith("specdec_http_requests_total{") and 'status="5' in line)  # fmt: skip

    limits = httpx.Limits(max_connections=num_requests, max_keepalive_connections=8)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        before = (await client.get("/health")).json()
        errors_before = scrape((await client.get("/metrics")).text)
        t0 = time.perf_counter()
        step = duration_s / max(num_requests, 1)
        await asyncio.gather(*(one(client, i, t0 + i * step) for i in range(num_requests)))
        wall = time.perf_counter() - t0
        deadline = time.perf_counter() + 60
        while True:
            after = (await client.get("/health")).json()
            # idle as the tests define it: a client that left is out of flight at once, but its request runs (and
            # holds KV blocks) until the engine's next step applies the abort
            idle = after["num_requests_in_flight"] == 0 and after["num_requests_running"] == 0
            if idle or time.perf_counter() > deadline:
                break
            await asyncio.sleep(0.05)
        errors_after = scrape((await client.get("/metrics")).text)
    finished = sum(after["num_requests_finished"].values()) - sum(before["num_requests_finished"].values())
    accepted = after["num_requests_total"] - before["num_requests_total"]
    q = statistics.quantiles(latencies, n=20) if len(latencies) > 1 else latencies * 19
    return {
        "requests": num_requests,
        "wall_s": wall,
        "tokens": sum(tokens),
        "latency_p50_s": statistics.median(latencies) if latencies else None,
        "latency_p95_s": q[18] if latencies else None,
        "statuses": dict(sorted(statuses.items())),
        "finished_by_reason": {
            k: v - before["num_requests_finished"].get(k, 0) for k, v in after["num_requests_finished"].items()
        },  # fmt: skip
        "lost": accepted - finished,
        "server_5xx": errors_after - errors_before,
        "in_flight_after": after["num_requests_in_flight"],
        "kv_blocks_used_after": after["kv_blocks_used"],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="target dir (default: the embedded default pair)")
    ap.add_argument("--draft", help="draft dir for --methods draft_model")
    ap.add_argument("--tiny", action="store_true", help="make and use a random pair (make_tiny_pair) in /tmp")
    ap.add_argument("--tiny-size", default="12x512", help="LAYERSxHIDDEN of the --tiny target (default 12x512)")
    ap.add_argument("--url", help="an already running loopback server (then --methods is only a label)")
    ap.add_argument("--methods", default="none,draft_model,ngram")
    ap.add_argument("--clients", default="1,4,16")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    ap.add_argument("--quick", action="store_true", help="32 requests of 32 tokens")
    ap.add_argument("--soak", type=float, default=None, metavar="SECONDS",
                    help="instead of the load table: the mixed-client soak (run_soak) over SECONDS")  # fmt: skip
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "load_server.json"))
    args = ap.parse_args()
    if args.quick:
        args.requests, args.max_tokens = 32, 32
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.url and urlparse(args.url).hostname not in ("127.0.0.1", "localhost", "::1"):
        raise SystemExit("error: --url must be a loopback address")
    model, draft = args.model, args.draft
    if args.tiny:
        layers, hidden = (int(x) for x in args.tiny_size.split("x"))
        model, draft = make_tiny_pair(Path(f"/tmp/specdec_load_{layers}x{hidden}"), layers, hidden)
    elif model is None and not args.url:
        from spec_engine import default_model_paths

        model, draft = default_model_paths()
    if args.soak is not None:
        return soak_main(args, model, draft)
    clients = [int(c) for c in args.clients.split(",")]
    rows = []
    print(f"{'method':<12} {'clients':>7} {'req/s':>7} {'tok/s':>8} {'p50 s':>7} {'p95 s':>7} {'ttft50':>7} "
          f"{'alpha':>6} {'tau':>5}")  # fmt: skip
    for method in args.methods.split(","):
        url, stop = (args.url, lambda: None) if args.url else start_server(model, draft, method, args.gamma, 16)
        try:
            for c in clients:
                r = asyncio.run(run_load(url, args.requests, c, args.max_tokens))
                r["method"] = method
                rows.append(r)
                alpha = f"{r['alpha']:.2f}" if r["alpha"] is not None else "-"
                tau = f"{r['tau']:.2f}" if r["tau"] is not None else "-"
                line = f"{method:<12} {c:>7} {r['req_per_s']:>7.2f} {r['tok_per_s']:>8.1f} {r['latency_p50_s']:>7.3f} "
                print(line + f"{r['latency_p95_s']:>7.3f} {r['ttft_p50_s']:>7.3f} {alpha:>6} {tau:>5}", flush=True)
        finally:
            stop()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"machine": platform.node(), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "model": model, "draft": draft, "requests": args.requests, "max_tokens": args.max_tokens,
            "gamma": args.gamma}  # fmt: skip
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(f"saved {out}")
    return 0


def soak_main(args, model: str | None, draft: str | None) -> int:
    method = "draft_model" if "," in args.methods else args.methods  # the default list soaks the draft model
    url, stop = (args.url, lambda: None) if args.url else start_server(model, draft, method, args.gamma, 16)
    try:
        r = asyncio.run(run_soak(url, args.requests, args.soak, args.max_tokens))
    finally:
        stop()
    r["method"] = method
    print(f"soak ({method}): {r['requests']} requests over {r['wall_s']:.1f} s, {r['tokens']} tokens read; latency "
          f"p50 {r['latency_p50_s']:.3f} s, p95 {r['latency_p95_s']:.3f} s")  # fmt: skip
    print(f"  responses by status: {r['statuses']}; engine finished: {r['finished_by_reason']}")
    print(f"  lost: {r['lost']}; server 5xx: {r['server_5xx']}; in flight after: {r['in_flight_after']}; "
          f"KV blocks used after: {r['kv_blocks_used_after']}")  # fmt: skip
    out = Path(args.out).with_name("load_server_soak.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"machine": platform.node(), "torch": torch.__version__, "model": model, "draft": draft,
            "max_tokens": args.max_tokens, "seconds": args.soak}  # fmt: skip
    out.write_text(json.dumps({"meta": meta, "soak": r}, indent=2))
    print(f"saved {out}")
    ok = r["lost"] == 0 and r["server_5xx"] == 0 and r["in_flight_after"] == 0 and r["kv_blocks_used_after"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
