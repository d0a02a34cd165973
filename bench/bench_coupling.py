"""Seeded sampling two ways on the default pair: the position-keyed coupling (drafter-invariant, the default for
seeded requests) against rejection sampling (``invariant=False``), with plain decoding as the baseline and a control.

    python bench/bench_coupling.py            # writes bench/out/bench_coupling.json
    python bench/bench_coupling.py --quick

Batch 1, held-out code prompts (numpy's sources and stdlib files the pair's recipe held out), chain depth 4,
temperature 0.8 and 1.0. Modes are timed in interleaved rounds; alpha is accepted / drafted tokens, tau tokens per
target pass. The coupling accepts a drafted token when draft and target put the perturbed maximum on the same token:
P >= (1 - TV) / (1 + TV), against 1 - TV for rejection sampling.
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

import torch  # noqa: E402

from bench.harness import build_prompts  # noqa: E402
from spec_engine import LLM, SamplingParams, default_model_paths  # noqa: E402


def run(llm: LLM, prompts, params: list[SamplingParams]) -> dict:
    tokens = steps = drafted = accepted = 0
    start = time.perf_counter()
    for prompt, p in zip(prompts, params):
        out = llm.generate({"prompt_token_ids": prompt.ids}, p, use_tqdm=False)[0]
        m = out.metrics
        tokens += len(out.outputs[0].token_ids)
        steps, drafted, accepted = steps + m["num_steps"], drafted + m["num_drafted"], accepted + m["num_accepted"]
    seconds = time.perf_counter() - start
    return {"tok_s": tokens / seconds, "alpha": accepted / drafted if drafted else None, "tau": tokens / steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="4 prompts, 64 tokens, 2 rounds")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--depth", type=int, default=4, help="chain depth of the speculative modes")
    ap.add_argument("--out", type=Path, default=Path("bench/out/bench_coupling.json"))
    args = ap.parse_args()
    rounds = args.rounds or (2 if args.quick else 3)
    max_tokens = 64 if args.quick else 128
    target, draft = default_model_paths()
    plain = LLM(target)
    spec = LLM(target, {"method": "draft_model", "model": draft, "num_speculative_tokens": args.depth})
    prompts, _ = build_prompts(plain, *((3, 1) if args.quick else (6, 2)), length=64)
    rows = []
    for temperature in (0.8, 1.0):

        def params(invariant, t=temperature):
            return [SamplingParams(max_tokens=max_tokens, temperature=t, seed=100 + i, ignore_eos=True,
                                   invariant=invariant) for i in range(len(prompts))]  # fmt: skip

        modes = {
            "plain": (plain, params(None)),
            "rejection": (spec, params(False)),
            "coupled": (spec, params(True)),
            "plain (control)": (plain, params(None)),
        }
        results = {name: [] for name in modes}
        for r in range(rounds):
            order = list(modes) if r % 2 == 0 else list(reversed(modes))  # interleaved, alternating order
            for name in order:
                results[name].append(run(modes[name][0], prompts, modes[name][1]))
        base = statistics.median(x["tok_s"] for x in results["plain"])
        for name, xs in results.items():
            row = {
                "temperature": temperature,
                "mode": name,
                "tok_s": statistics.median(x["tok_s"] for x in xs),
                "speedup": statistics.median(x["tok_s"] for x in xs) / base,
                "alpha": xs[0]["alpha"],
                "tau": statistics.median(x["tau"] for x in xs),
            }
            rows.append(row)
            alpha = "-" if row["alpha"] is None else f"{row['alpha']:.3f}"
            print(f"T={temperature} {name:16s} {row['tok_s']:7.1f} tok/s  {row['speedup']:.2f}x  alpha {alpha}  "
                  f"tau {row['tau']:.2f}")  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"machine": platform.node(), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "rounds": rounds, "max_tokens": max_tokens, "depth": args.depth,
            "prompts": [p.name for p in prompts]}  # fmt: skip
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
