"""A burst of chat requests that share one long system prompt, with and without prefix caching.

    python bench/bench_prefix_caching.py [--quick] [--model smollm2] [--requests 8] [--system-functions 6] [--rounds 3]
                                         [--max-tokens 32] [--out bench/out]

Each round sends ``--requests`` chat requests in one ``generate`` call: the same system prompt (the source of
``--system-functions`` held-out stdlib functions, "answer questions about this code"; a new one every round, so no
round finds an earlier round's blocks) and a question of their own (bench_drafters.py's chat questions). Engines
(plain decoding, bf16): prefix caching off, then on; they alternate within each round, the order rotated between
rounds. Columns, medians over rounds: the burst's wall time, time to first token (median and last request), prompt
tokens taken from the cache, and output tok/s; every engine's tokens are checked against the first's. Writes
``--out``/prefix_caching.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file: the repository root, not bench/, heads the import path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench.bench_drafters import CHAT  # noqa: E402
from bench.bench_suffix import functions  # noqa: E402
from bench.harness import cpu_name  # noqa: E402
from spec_engine import LLM, SamplingParams  # noqa: E402

ENGINES = {"uncached": False, "cached": True}


def burst(llm: LLM, code: str, questions: list[str]) -> list[list[int]]:
    system = f"You answer questions about this code.\n\n```python\n{code}\n```"
    return [
        llm.render_chat([{"role": "system", "content": system}, {"role": "user", "content": q}])[1] for q in questions
    ]


def run_burst(llm: LLM, prompts: list[list[int]], max_tokens: int) -> dict:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    wall = time.perf_counter() - start
    ttft = sorted(o.metrics["time_to_first_token"] for o in outs)
    return {
        "wall_s": wall,
        "ttft_median_s": statistics.median(ttft),
        "ttft_last_s": ttft[-1],
        "cached_tokens": sum(o.metrics["num_cached_tokens"] for o in outs),
        "prompt_tokens": sum(len(p) for p in prompts),
        "tokens_per_s": sum(len(o.outputs[0].token_ids) for o in outs) / wall,
        "tokens": [o.outputs[0].token_ids for o in outs],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2", help="a GGUF file, a model directory or a registry name")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--requests", type=int, default=8, help="requests per burst")
    ap.add_argument("--system-functions", type=int, default=6, help="stdlib functions in the shared system prompt")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--quick", action="store_true", help="1 round of 3 requests, 2 functions, 8 tokens each")
    ap.add_argument("--out", default="bench/out")
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.requests, args.system_functions, args.max_tokens = 1, 3, 2, 8
    for name in ("requests", "system_functions", "rounds", "max_tokens", "threads"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")

    torch.set_num_threads(args.threads)
    engines = {
        name: LLM(args.model, dtype="bfloat16", max_model_len=4096, kv_cache_memory=512 << 20, enable_prefix_caching=on)
        for name, on in ENGINES.items()
    }
    first = next(iter(engines.values()))
    sources = functions(args.rounds * args.system_functions)
    if len(sources) < args.rounds * args.system_functions:
        raise SystemExit(f"only {len(sources)} held-out functions: lower --rounds or --system-functions")
    questions = [CHAT[i % len(CHAT)] for i in range(args.requests)]
    results: dict[str, list[dict]] = {name: [] for name in engines}
    for llm in engines.values():  # warm-up (the native extension, the threads), with no system prompt to cache
        run_burst(llm, [llm.render_chat([{"role": "user", "content": questions[0]}])[1]], 4)
    for i in range(args.rounds):
        code = "\n\n".join(sources[i * args.system_functions : (i + 1) * args.system_functions])
        prompts = burst(first, code, questions)
        order = list(engines)[i % len(engines) :] + list(engines)[: i % len(engines)]
        for name in order:
            results[name].append(run_burst(engines[name], prompts, args.max_tokens))
        reference = results[order[0]][-1]["tokens"]
        for name in engines:
            if results[name][-1]["tokens"] != reference:
                raise SystemExit(f"round {i}: {name} decoded other tokens than {order[0]}")
        print(
            f"round {i + 1}/{args.rounds}: {sum(len(p) for p in prompts)} prompt tokens "
            f"({len(prompts[0])} in the first request); same tokens in every engine",
            flush=True,
        )

    keys = ("wall_s", "ttft_median_s", "ttft_last_s", "cached_tokens", "prompt_tokens", "tokens_per_s")
    rows = {name: {k: statistics.median(r[k] for r in runs) for k in keys} for name, runs in results.items()}
    for name, runs in results.items():  # the rounds' spread of the burst's time to first token
        rows[name]["ttft_p20_s"], rows[name]["ttft_p80_s"] = np.percentile([r["ttft_median_s"] for r in runs], [20, 80])
    print(f"\n{cpu_name()}, {args.threads} threads; {args.requests} requests a burst, {args.max_tokens} tokens each")
    print("TTFT: the median request's time to first token, median over rounds (p20-p80); computed: prompt tokens")
    print("processed (the rest came from the cache); bound: the speedup on TTFT if time followed the tokens computed")
    print(
        f"{'engine':<10} {'wall s':>8} {'TTFT s (p20-p80)':>20} {'TTFT last s':>12} {'computed':>9} {'bound':>6} "
        f"{'tok/s':>7}"
    )
    for name, row in rows.items():
        computed = row["prompt_tokens"] - row["cached_tokens"]
        print(
            f"{name:<10} {row['wall_s']:>8.2f} {row['ttft_median_s']:>7.2f} ({row['ttft_p20_s']:.2f}-"
            f"{row['ttft_p80_s']:.2f}) {row['ttft_last_s']:>12.2f} {computed:>9.0f} "
            f"{row['prompt_tokens'] / computed:>6.2f} {row['tokens_per_s']:>7.1f}"
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = {
        "machine": cpu_name(),
        "platform": platform.platform(),
        "args": vars(args),
        "rows": rows,
        "rounds": {name: [{k: r[k] for k in keys} for r in runs] for name, runs in results.items()},
    }
    (out / "prefix_caching.json").write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
