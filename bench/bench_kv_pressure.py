"""Chat requests that set no max_tokens, on a small KV cache: how many run side by side, and their throughput.

    python bench/bench_kv_pressure.py [--model smollm2] [--requests 16] [--kv-mib 48] [--max-model-len 1024]
                                      [--spec none|hybrid] [--out bench/out]

A server's chat request without ``max_tokens`` may run to the end of the context, so its room is the context less
its prompt (``spec_engine/server/app.py``). The requests (bench_drafters.py's chat questions, greedy, each ending at
its EOS) run in one ``generate`` call on a cache of ``--kv-mib`` MiB. Reported: the wall time, output tok/s, the most
requests running at once, the preemptions (``Scheduler.make_room``), and the tokens, checked against the same requests
on a cache that holds them all. An engine that reserved every block a request could need at admission runs
cache / context requests at a time; one that takes blocks as requests grow runs as many as their tokens fit.
Writes ``--out``/kv_pressure.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file: the repository root, not bench/, heads the import path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.bench_drafters import CHAT  # noqa: E402
from bench.harness import cpu_name  # noqa: E402
from spec_engine import LLM, SamplingParams  # noqa: E402


def run(llm: LLM, prompts: list[list[int]]) -> dict:
    """The requests in one generate call, stepped here to watch how many run at once."""
    engine = llm.engine
    reqs = [engine.add_request(ids, SamplingParams(max_tokens=llm.max_model_len - len(ids))) for ids in prompts]
    start, most = time.perf_counter(), 0
    while engine.has_unfinished():
        engine.step()
        most = max(most, len(engine.running))
    wall = time.perf_counter() - start
    tokens = sum(len(r.output_token_ids) for r in reqs)
    preemptions = engine.stats.get("num_preemptions", 0)  # (an engine that reserves up front has none)
    return {"wall_s": wall, "tok_s": tokens / wall, "tokens": tokens, "most_running": most,
            "preemptions": preemptions, "outputs": [r.output_token_ids for r in reqs]}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--kv-mib", type=int, default=48, help="the small cache, MiB for both models' KV")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--spec", choices=("none", "hybrid"), default="none")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="bench/out")
    args = ap.parse_args(argv)
    if args.requests < 1 or args.kv_mib < 1:
        ap.error("--requests and --kv-mib must be >= 1")
    torch.set_num_threads(args.threads)
    spec = {"method": "hybrid"} if args.spec == "hybrid" else None
    kw = dict(speculative_config=spec, max_model_len=args.max_model_len, max_num_seqs=args.requests,
              enable_prefix_caching=False)  # fmt: skip
    small = LLM(args.model, kv_cache_memory=args.kv_mib << 20, **kw)
    ample = LLM(args.model, **kw)
    prompts = [small.render_chat([{"role": "user", "content": q}])[1] for q in (CHAT * args.requests)[: args.requests]]
    small.generate(["warm up"], SamplingParams(max_tokens=4), use_tqdm=False)
    rows = {"small": run(small, prompts), "ample": run(ample, prompts)}
    same = rows["small"].pop("outputs") == rows["ample"].pop("outputs")
    blocks, size = small.allocator.num_blocks - 1, small.allocator.block_size
    whole = blocks * size // args.max_model_len
    print(f"{cpu_name()}, {args.threads} threads; {args.model}, {args.requests} chat requests without max_tokens, "
          f"context {args.max_model_len}, spec {args.spec}; small cache {args.kv_mib} MiB = {blocks} blocks of "
          f"{size} (whole-context reservations: {whole} at a time)")  # fmt: skip
    print(f"{'cache':8} {'wall s':>8} {'tok/s':>8} {'tokens':>7} {'most running':>13} {'preemptions':>12}")
    for name, r in rows.items():
        print(f"{name:8} {r['wall_s']:8.2f} {r['tok_s']:8.1f} {r['tokens']:7d} {r['most_running']:13d} "
              f"{r['preemptions']:12d}")  # fmt: skip
    print("tokens: " + ("same" if same else "DIFFER"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    machine = {"node": platform.node(), "cpu": cpu_name(), "threads": args.threads}
    (out / "kv_pressure.json").write_text(json.dumps({"machine": machine, "args": vars(args), "rows": rows,
                                                      "same_tokens": same}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
