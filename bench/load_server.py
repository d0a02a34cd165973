"""Bounded load against ``specdec serve`` on loopback: N requests, C concurrent clients, per speculation method.

For each method it starts a server in-process (a uvicorn thread on a free 127.0.0.1 port), or uses ``--url`` (a
loopback server you started), then runs N greedy /v1/completions requests with C in flight at once and prints one
line per (method, clients): request and token throughput, p50/p95 end-to-end latency, p50 time to first token
(streamed), and the engine's acceptance rate (alpha) and tokens per target pass (tau) over the run.

    python bench/load_server.py --quick --tiny            # a tiny random pair made on the spot (see make_tiny_pair)
    python bench/load_server.py --model DIR --draft DIR   # default: the embedded default pair

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
    from spec_engine.server.app import create_app

    spec = None
    if method == "draft_model":
        spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": gamma}
    elif method == "ngram":
        spec = {"method": "ngram", "num_speculative_tokens": gamma}
    llm = LLM(model, spec, max_num_seqs=max_num_seqs)
    llm.generate(["warm up"], SamplingParams(max_tokens=8), use_tqdm=False)
    app = create_app(llm, "bench", max_pending=1024)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
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
                "ignore_eos": True}  # fmt: skip
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


if __name__ == "__main__":
    sys.exit(main())
