"""What limits a request set's speedup: the prompt's share of the time, the answers' length, or the head's agreement
at each depth (issue 66's chat analysis). Counts, not a clock, except the prompt's share.

    python bench/bench_chat_limits.py [--sets humaneval,chat] [--prompts 20] [--depth 6] [--topk 4]

For each set (``bench_drafters.py``'s requests, greedy, bf16, batch 1): the prompts' and answers' lengths (median;
how many answers reach ``--max-tokens``), the prompt's share of plain decoding's time (from the request's
``decode_tokens_per_s``), and, for the shipped EAGLE head as a chain of ``--depth`` and as a dynamic tree of
``--topk`` x ``--depth``: tau and alpha_j, the share of steps that kept draft j among those that kept draft j - 1
(from ``Engine.accepted_hist``). Writes ``--out``/bench_chat_limits.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a file: the repository root, not bench/, heads the import path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_drafters import CHAT, chat_ids, humaneval_prompts  # noqa: E402
from bench.harness import cpu_name  # noqa: E402
from spec_engine import LLM, SamplingParams  # noqa: E402


def depth_alphas(hist: list[int]) -> list[float | None]:
    """alpha_j for j = 1 .. len(hist) - 1 from ``hist`` [k] = steps that kept k drafts."""
    kept = [sum(hist[j:]) for j in range(len(hist))]  # [j]: steps that kept at least j drafts
    return [kept[j] / kept[j - 1] if kept[j - 1] else None for j in range(1, len(hist))]


def plain_figures(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> dict:
    answers, shares = [], []
    for ids in prompts:
        start = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
        total = time.perf_counter() - start
        n = len(out.outputs[0].token_ids)
        answers.append(n)
        rate = (out.metrics or {}).get("decode_tokens_per_s")
        if rate:
            shares.append(max(total - n / rate, 0.0) / total)
    return {"prompt_tokens": statistics.median(map(len, prompts)), "answer_tokens": statistics.median(answers),
            "at_cap": sum(n >= params.max_tokens for n in answers), "requests": len(prompts),
            "prompt_share": statistics.median(shares) if shares else None}  # fmt: skip


def drafted_figures(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> dict:
    before = list(llm.engine.accepted_hist)
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
    hist = [n - (before[k] if k < len(before) else 0) for k, n in enumerate(llm.engine.accepted_hist)]
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"tau": generated / max(sum(hist), 1), "alpha_j": depth_alphas(hist), "hist": hist}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--sets", default="humaneval,chat")
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="bench/out")
    args = ap.parse_args(argv)
    sets = args.sets.split(",")
    if unknown := set(sets) - {"humaneval", "chat"}:
        ap.error(f"--sets takes humaneval and chat, got {sorted(unknown)}")
    torch.set_num_threads(args.threads)
    kw = dict(dtype="bfloat16", max_model_len=4096, kv_cache_memory=512 << 20, enable_prefix_caching=False)
    plain = LLM(args.model, **kw)
    head = {"method": "eagle", "num_speculative_tokens": args.depth}
    drafted = {
        "chain": LLM(args.model, speculative_config=head, **kw),
        "tree": LLM(args.model, speculative_config=head | {"tree": "dynamic", "eagle_topk": args.topk}, **kw),
    }
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    report = {"machine": cpu_name(), "depth": args.depth, "topk": args.topk, "sets": {}}
    for name in sets:
        prompts = ([p.ids for p in humaneval_prompts(plain, args.prompts)] if name == "humaneval"
                   else [chat_ids(plain, text) for text in CHAT[: args.prompts]])  # fmt: skip
        figures = plain_figures(plain, prompts, params)
        figures |= {shape: drafted_figures(llm, prompts, params) for shape, llm in drafted.items()}
        report["sets"][name] = figures
        share = figures["prompt_share"]
        print(f"{name}: prompt {figures['prompt_tokens']} tokens, answer {figures['answer_tokens']} "
              f"({figures['at_cap']}/{figures['requests']} at the cap), prompt's share "
              f"{'-' if share is None else f'{share:.1%}'}")  # fmt: skip
        for shape in drafted:
            alphas = " ".join("-" if a is None else f"{a:.2f}" for a in figures[shape]["alpha_j"])
            print(f"  {shape}: tau {figures[shape]['tau']:.2f}; alpha_j {alphas}")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "bench_chat_limits.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
