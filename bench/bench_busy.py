"""Decoding through a busy stretch: other processes hold the cores for a while, then leave. How fast the engine
decodes during and after, and on how many threads (spec_engine/threads.py, "CPU threads per decode step").

    python bench/bench_busy.py [--model smollm2] [--busy-seconds 9] [--hogs 2] [--requests 14] [--max-tokens 128]

Plain greedy decoding of HumanEval chat requests one after another (ignore EOS, so every request is the same
length), with ``--hogs`` busy-loop processes started with the first request and stopping after ``--busy-seconds``.
One line per request: when it ended, its tok/s, and ``*`` where the engine then decoded on one thread. After the
stretch every request should be back at the quiet machine's speed within a few hundred steps; an engine that stays
on one thread decodes the rest at about half of it. Run it on an otherwise quiet machine.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a file: the repository root, not bench/, heads the import path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_drafters import humaneval_prompts  # noqa: E402
from bench.harness import cpu_name  # noqa: E402
from spec_engine import LLM, SamplingParams  # noqa: E402

HOG = "import sys, time\nend = time.time() + float(sys.argv[1])\nwhile time.time() < end:\n    pass\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--busy-seconds", type=float, default=9.0)
    ap.add_argument("--hogs", type=int, default=2, help="busy-loop processes during the stretch")
    ap.add_argument("--requests", type=int, default=14)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    if args.busy_seconds < 0 or args.hogs < 0 or args.requests < 1 or args.max_tokens < 1:
        ap.error("--busy-seconds and --hogs must be >= 0, --requests and --max-tokens >= 1")
    torch.set_num_threads(args.threads)
    llm = LLM(args.model, dtype="bfloat16", max_model_len=4096, kv_cache_memory=512 << 20)
    prompts = humaneval_prompts(llm, args.requests)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompts[0].ids}], SamplingParams(max_tokens=8), use_tqdm=False)  # warm
    print(f"{cpu_name()}, {args.threads} threads; {args.hogs} busy processes for {args.busy_seconds:g} s")
    hogs = [subprocess.Popen([sys.executable, "-c", HOG, str(args.busy_seconds)]) for _ in range(args.hogs)]
    start, rates = time.perf_counter(), []
    try:
        for p in prompts:
            t = time.perf_counter()
            out = llm.generate([{"prompt_token_ids": p.ids}], params, use_tqdm=False)[0]
            rates.append(len(out.outputs[0].token_ids) / (time.perf_counter() - t))
            one = "*" if llm.engine.threads is not None and llm.engine.threads.single else ""
            print(f"{time.perf_counter() - start:6.1f} s  {rates[-1]:6.1f} tok/s{one}  {p.name}", flush=True)
    finally:
        for h in hogs:
            h.kill()
    late = statistics.median(rates[len(rates) // 2 :])
    print(f"total {time.perf_counter() - start:.1f} s; the last half of the requests: {late:.1f} tok/s median")
    return 0


if __name__ == "__main__":
    sys.exit(main())
