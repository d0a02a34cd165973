"""Adaptive speculation vs fixed depths vs no speculation, end to end, in one run.

    python bench/bench_adaptive.py [--model DIR --draft DIR] [--quick]

Configs (greedy, ignore_eos, the same prompts for every engine):
- batch 1: no speculation, every fixed depth in --gammas, adaptive ("auto"); each run serves --batch1-prompts
  prompts one after another (max_num_seqs 1), so no single prompt's predictability decides the ratios;
- batch 16: no speculation, adaptive;
- a useless draft (the draft's config, random init): no speculation (the batch-1 figure), adaptive;
- "none (control)": a second, identical no-speculation engine at each batch size. Its ratio to "none" is the
  noise floor of the run: a ratio closer to 1 than the control's spread is a tie.

One line per config: tok/s median [p20, p80] over --repeats timed runs (after one untimed warm-up run on the same
engine, so the adaptive controller starts from measured costs, as in a running server), the ratio to no speculation,
the acceptance rate, tau (tokens per target pass) and the mean chosen depth. Timed runs go round-robin over the
engines of a batch size and the ratio is the median of per-round ratios, so drifts in machine load hit every config
alike. On a shared machine other jobs preempt runs at random, so each ratio is also given in process CPU time
(one thread: equal to wall time on an idle machine), which preemption does not inflate. JSON goes to
bench/out/bench_adaptive.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

if __package__ in (None, ""):  # run as a file: the repository root, not bench/, heads the import path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from spec_engine import LLM, SamplingParams, default_model_paths  # noqa: E402

PROMPTS = [
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n\ndef main(",
    "class Stack:\n    def __init__(self):\n",
    "    for i in range(len(items)):\n",
    "def read_file(path):\n    with open(path",
    "    if not isinstance(value, str):\n        raise",
    '"""Utilities for parsing command-line arguments."""\n\nimport',
    "    def __repr__(self):\n        return",
    "try:\n    import threading\nexcept ImportError:\n",
    "def _check_arg(name, value):\n",
    "    result = []\n    for key, value in",
    "class Error(Exception):\n    pass\n\n\nclass",
    "    @property\n    def name(self):\n",
    "def copy(src, dst, *, follow_symlinks=True):\n",
    "    while True:\n        line = f.readline()\n",
    "__all__ = [",
]


def random_draft(draft_dir: str, out: Path) -> str:
    """The draft's architecture and tokenizer with random weights: a draft that is never right."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(draft_dir)).save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        if (Path(draft_dir) / f).is_file():
            shutil.copy(Path(draft_dir) / f, out / f)
    return str(out)


def prompt_inputs(llm: LLM, n: int) -> list:
    if llm.tokenizer is not None:
        return [PROMPTS[i % len(PROMPTS)] for i in range(n)]
    rng = np.random.default_rng(0)  # no tokenizer (tiny test models): random token ids
    vocab = llm.target.config.vocab_size
    return [{"prompt_token_ids": rng.integers(0, vocab, 8 + i % 5).tolist()} for i in range(n)]


class Config:
    """One engine and its timed runs."""

    def __init__(self, name: str, args, draft: str | None, gamma, batch: int, num_prompts: int | None = None):
        spec = None if draft is None else {"model": draft, "num_speculative_tokens": gamma}
        self.name, self.batch, self.gamma = name, batch, gamma if draft else 0
        self.llm = LLM(args.model, speculative_config=spec, max_num_seqs=batch, max_model_len=args.max_tokens + 64)
        self.prompts = prompt_inputs(self.llm, num_prompts or batch)
        self.params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
        self.llm.generate(self.prompts, self.params, use_tqdm=False)  # warm-up: kernels, the controller's cost fits
        self.llm.engine.gamma_hist = [0] * len(self.llm.engine.gamma_hist)
        self.rates, self.cpu_rates, self.drafted, self.accepted, self.steps, self.generated = [], [], 0, 0, 0, 0

    def time_once(self) -> None:
        start, cpu_start = time.perf_counter(), time.process_time()
        outs = self.llm.generate(self.prompts, self.params, use_tqdm=False)
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
        num = sum(len(o.outputs[0].token_ids) for o in outs)
        self.rates.append(num / elapsed)
        self.cpu_rates.append(num / cpu)
        self.generated += num
        for o in outs:
            self.drafted += o.metrics["num_drafted"]
            self.accepted += o.metrics["num_accepted"]
            self.steps += o.metrics["num_steps"]

    def summary(self) -> dict:
        q20, q80 = np.percentile(self.rates, [20, 80])
        hist = self.llm.engine.gamma_hist
        return {
            "name": self.name,
            "batch": self.batch,
            "gamma": self.gamma,
            "tok_s": statistics.median(self.rates),
            "tok_s_p20": float(q20),
            "tok_s_p80": float(q80),
            "alpha": self.accepted / self.drafted if self.drafted else 0.0,
            "tau": self.generated / self.steps if self.steps else 1.0,
            "mean_gamma": sum(g * n for g, n in enumerate(hist)) / max(sum(hist), 1),
            "gamma_hist": list(hist),
            "rates": list(self.rates),
            "cpu_tok_s": statistics.median(self.cpu_rates),
            "cpu_rates": list(self.cpu_rates),
        }


def measure(configs: list[Config], repeats: int) -> list[dict]:
    """Round-robin over the engines, so a change in machine load hits every config alike; each round starts one
    config later, so no config always runs first (or right after the same neighbour)."""
    for r in range(repeats):
        for i in range(len(configs)):
            configs[(r + i) % len(configs)].time_once()
    return [c.summary() for c in configs]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model")
    ap.add_argument("--draft")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--gammas", default="1,2,3,4,6,8")
    ap.add_argument("--batch1-prompts", type=int, default=4, help="prompts served one at a time per batch-1 run")
    ap.add_argument("--quick", action="store_true", help="48 tokens, depths 2,4,8")
    args = ap.parse_args(argv)
    if args.quick:
        args.max_tokens, args.gammas = 48, "2,4,8"
    if not (args.model and args.draft):
        target, draft = default_model_paths()
        args.model, args.draft = args.model or target, args.draft or draft
    gammas = [int(g) for g in args.gammas.split(",")]

    with tempfile.TemporaryDirectory() as tmp:
        useless = random_draft(args.draft, Path(tmp) / "random_draft")
        n1 = args.batch1_prompts
        batch1 = [Config("none", args, None, 0, 1, n1)]
        batch1 += [Config(f"fixed gamma={g}", args, args.draft, g, 1, n1) for g in gammas]
        batch1 += [Config("adaptive", args, args.draft, "auto", 1, n1),
                   Config("adaptive, random draft", args, useless, "auto", 1, n1),
                   Config("none (control)", args, None, 0, 1, n1)]  # fmt: skip
        batch16 = [Config("none", args, None, 0, 16), Config("adaptive", args, args.draft, "auto", 16),
                   Config("none (control)", args, None, 0, 16)]  # fmt: skip
        results = measure(batch1, args.repeats) + measure(batch16, args.repeats)
    for r in results:
        base = results[0] if r["batch"] == 1 else results[len(batch1)]
        # paired: each timed run against the no-speculation run of the same round, then the median
        r["vs_none"] = statistics.median(a / b for a, b in zip(r["rates"], base["rates"]))
        r["cpu_vs_none"] = statistics.median(a / b for a, b in zip(r["cpu_rates"], base["cpu_rates"]))
        print(f"{r['name']:<22} B={r['batch']:<3} {r['tok_s']:8.1f} tok/s [{r['tok_s_p20']:7.1f}, "
              f"{r['tok_s_p80']:7.1f}]  x{r['vs_none']:.2f} vs none (CPU time: x{r['cpu_vs_none']:.2f})  "
              f"alpha {r['alpha']:.2f}  tau {r['tau']:.2f}  mean gamma {r['mean_gamma']:.2f}")  # fmt: skip
    fixed = [r for r in results if r["name"].startswith("fixed")]
    best = max(fixed, key=lambda r: r["vs_none"])
    auto1 = next(r for r in results if r["name"] == "adaptive" and r["batch"] == 1)
    print(
        f"batch 1: adaptive / best fixed ({best['name']}) = x{auto1['vs_none'] / best['vs_none']:.2f} "
        f"(CPU time: x{auto1['cpu_vs_none'] / best['cpu_vs_none']:.2f})"
    )

    report = {
        "machine": platform.node(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "model": args.model,
        "draft": args.draft,
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "best_fixed": best["name"],
        "results": results,
    }
    out = Path(__file__).parent / "out" / "bench_adaptive.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"saved {out}")
    return report


if __name__ == "__main__":
    main()
