"""The default pair's quality and its speculation at long context (issue #20's "must show").

    python bench/bench_pair.py [--target DIR --draft DIR] [--threads N] [--skip-compare] [--out bench/out/pair.json]

1. Held-out perplexity of target and draft on windows of 256, 1024 and 2048 tokens (those within the model's
   context): the zoo's held-out stdlib files, and numpy's own sources (text the zoo never trained on).
2. Greedy speculation (the pair's default ``speculative_config``) at 256, 1024 and 2048 tokens of context: prompts of
   ``context - 64`` tokens from held-out files, 64 new tokens; acceptance alpha and tau per context.
3. A 1500-token prompt and 256 new tokens: alpha, tau, tok/s.
4. ``specdec generate --compare`` on the five demo prompts, 128 tokens, three runs each (one process per run).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file: the repository root, not bench/, heads the import path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from spec_engine import LLM, SamplingParams, default_model_paths  # noqa: E402
from spec_engine.models import load_model  # noqa: E402
from spec_engine.training.train import EOS, corpus_files, perplexity  # noqa: E402

CONTEXTS = (256, 1024, 2048)
DEMO_PROMPTS = ("def fibonacci(n):", "import os", "class Stack:", "def read_csv(path):", "for i in range(10):")
NEW_TOKENS = 64


def held_out_texts() -> dict[str, list[str]]:
    """{"stdlib": held-out split files, "numpy": numpy's non-test sources}, each sorted by path."""
    _, held = corpus_files()
    texts = {"stdlib": [p.read_text(encoding="utf-8", errors="replace") for p in held]}
    import numpy

    root = Path(numpy.__file__).parent
    files = sorted(p for p in root.rglob("*.py") if "tests" not in p.parts)
    texts["numpy"] = [p.read_text(encoding="utf-8", errors="replace") for p in files]
    return texts


def stream_of(llm: LLM, texts: list[str]) -> torch.Tensor:
    eos = llm.tokenizer.token_to_id(EOS)
    ids: list[int] = []
    for t in texts:
        ids += llm.encode(t) + [eos]
    return torch.tensor(ids, dtype=torch.int32)  # [N]


def long_prompts(llm: LLM, texts: list[str], length: int, count: int) -> list[list[int]]:
    """``count`` prompts of ``length`` tokens, each from its own file at least ``length + NEW_TOKENS`` long, spread
    evenly over the qualifying files."""
    encoded = [ids for ids in (llm.encode(t) for t in texts) if len(ids) >= length + NEW_TOKENS]
    pick = [encoded[(2 * i + 1) * len(encoded) // (2 * count)] for i in range(min(count, len(encoded)))]
    return [ids[:length] for ids in pick]


def speculate(llm: LLM, prompts: list[list[int]], max_tokens: int) -> dict:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    drafted = accepted = steps = generated = 0
    t0 = time.perf_counter()
    for ids in prompts:
        out = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
        m = out.metrics
        drafted, accepted, steps = drafted + m["num_drafted"], accepted + m["num_accepted"], steps + m["num_steps"]
        generated += len(out.outputs[0].token_ids)
    elapsed = time.perf_counter() - t0
    return {"prompts": len(prompts), "alpha": accepted / max(1, drafted), "tau": generated / max(1, steps),
            "tok_s": generated / elapsed}  # fmt: skip


def demo_compare(runs: int) -> dict:
    results = {}
    for prompt in DEMO_PROMPTS:
        rows = []
        for _ in range(runs):
            cmd = [sys.executable, "-m", "spec_engine.cli", "generate", "--prompt", prompt, "--max-tokens", "128",
                   "--compare", "--json"]  # fmt: skip
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=True)
            rep = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append({k: rep[k] for k in ("speedup", "tokens_per_s", "baseline_tokens_per_s", "acceptance_rate",
                                              "mean_accepted_length")})  # fmt: skip
            print(f"  {prompt!r}: {rows[-1]}", flush=True)
        results[prompt] = rows
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target")
    ap.add_argument("--draft")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--windows", type=int, default=24, help="perplexity windows per split and context")
    ap.add_argument("--prompts", type=int, default=4, help="speculation prompts per context")
    ap.add_argument("--skip-compare", action="store_true")
    ap.add_argument("--out", type=Path, default=Path("bench/out/pair.json"))
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    target_dir, draft_dir = default_model_paths()
    target_dir, draft_dir = args.target or target_dir, args.draft or draft_dir

    spec = {"method": "draft_model", "model": draft_dir}
    llm = LLM(target_dir, speculative_config=spec, dtype="float32")
    ctx = llm.max_model_len
    texts = held_out_texts()
    report: dict = {"target": target_dir, "draft": draft_dir, "context": ctx, "perplexity": {}, "speculation": {}}

    models = {name: load_model(d, dtype=torch.float32) for name, d in (("target", target_dir), ("draft", draft_dir))}
    for split, files in texts.items():
        stream = stream_of(llm, files)
        for name, model in models.items():
            for n in CONTEXTS:
                if n <= ctx:
                    ppl = perplexity(model, stream, n, max_windows=args.windows * 256 // n + 1)
                    report["perplexity"][f"{split}/{name}/{n}"] = round(ppl, 2)
                    print(f"ppl {split:6s} {name:6s} @{n:5d}: {ppl:.2f}", flush=True)

    pool = texts["stdlib"] + texts["numpy"]
    for n in CONTEXTS:
        if n <= ctx:
            row = speculate(llm, long_prompts(llm, pool, n - NEW_TOKENS, args.prompts), NEW_TOKENS)
            report["speculation"][str(n)] = row
            print(f"speculation @{n}: {row}", flush=True)
    if ctx >= 1500 + 256:
        row = speculate(llm, long_prompts(llm, pool, 1500, 1), 256)
        report["prompt1500_new256"] = row
        print(f"1500-token prompt + 256 new: {row}", flush=True)
    if not args.skip_compare:
        report["demo_compare"] = demo_compare(3)
        speedups = [r["speedup"] for rows in report["demo_compare"].values() for r in rows]
        report["demo_min_speedup"] = min(speedups)
        report["demo_geomean_speedup"] = math.exp(sum(map(math.log, speedups)) / len(speedups))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
