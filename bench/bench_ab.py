"""Two source trees of specdec, interleaved: plain and speculative decoding tok/s of each, and whether their tokens
agree. For a change that should not move speed (a refactor), or one that should (an optimisation), on one machine in
one run.

    python bench/bench_ab.py --before ../wt-before [--after .] [--model smollm2|embedded] [--rounds 5]

One worker process per (tree, mode) loads its engine once (its tree first on the import path, its own extension
build cache), one after another; each round then runs every worker's requests in turn, the order rotating from round
to round, so load drifts reach both trees alike. Speculation is the model's drafter alone (SmolLM2: its EAGLE-3
head): a suffix tree would answer the rounds after the first from memory.

Per (model, mode): each tree's median tok/s over the rounds (p20-p80), the ratio after / before, and whether every
request's tokens were the same in both trees (greedy). Exits 1 on differing tokens. The machine's CPU is printed
with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

# run as a file: the repository root, not bench/, heads the import path; a worker imports its own tree (PYTHONPATH)
if __package__ in (None, "") and "--worker" not in sys.argv:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

REQUESTS = [  # everyday coding and chat requests, none tuned for
    "Write a Python function that returns the n-th Fibonacci number.",
    "Write a Python class Stack with push, pop, peek and is_empty methods.",
    "Give me three tips for writing a clear email to a colleague.",
]


def worker(model: str, mode: str, max_tokens: int) -> None:
    """Load the engine, then answer each "run" line on stdin with one JSON line: tok/s and the tokens."""
    from spec_engine import LLM, SamplingParams, default_model_paths

    if model == "embedded":
        target, draft = default_model_paths()
        spec = {"method": "draft_model", "model": draft} if mode == "spec" else None
        llm = LLM(model=target, speculative_config=spec)
        prompts = [{"prompt_token_ids": llm.tokenizer.encode(text).ids} for text in REQUESTS]
    else:
        # the head alone: a suffix tree would answer a request it has served before from memory, every round after
        llm = LLM(model=model, speculative_config={"method": "eagle"} if mode == "spec" else None)
        prompts = [{"prompt_token_ids": llm.render_chat([{"role": "user", "content": t}])[1]} for t in REQUESTS]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    llm.generate(prompts[:1], SamplingParams(max_tokens=8), use_tqdm=False)  # warm: the extension, the caches
    print(json.dumps({"ready": True}), flush=True)
    for _ in sys.stdin:
        start = time.perf_counter()
        outs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]  # batch 1, one after another
        seconds = time.perf_counter() - start
        tokens = [o.outputs[0].token_ids for o in outs]
        print(json.dumps({"tps": sum(map(len, tokens)) / seconds, "tokens": tokens}), flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", help="the source tree to compare against (a git worktree; required)")
    ap.add_argument("--after", default=str(Path(__file__).resolve().parents[1]))
    ap.add_argument("--model", action="append", help="smollm2 (default) or embedded; repeatable")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--worker", nargs=2, metavar=("MODEL", "MODE"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(*args.worker, args.max_tokens)
        return 0
    if args.before is None:
        ap.error("--before is required")
    from bench.harness import cpu_name

    trees = {"before": Path(args.before).resolve(), "after": Path(args.after).resolve()}
    keys = [(m, mode, t) for m in args.model or ["smollm2"] for mode in ("plain", "spec") for t in trees]
    procs = {}
    for m, mode, t in keys:
        env = {**os.environ, "PYTHONPATH": str(trees[t]), "SPECDEC_CACHE": f"/tmp/specdec-ab-{t}"}
        cmd = [sys.executable, __file__, "--worker", m, mode, "--max-tokens", str(args.max_tokens)]
        procs[m, mode, t] = subprocess.Popen(cmd, cwd=trees[t], env=env, stdin=subprocess.PIPE,
                                             stdout=subprocess.PIPE, text=True)  # fmt: skip
        # one at a time: a worker's build or load would keep the cores busy while another warms up, and its thread
        # tuner would start on one thread
        json.loads(procs[m, mode, t].stdout.readline())
    runs = {k: [] for k in keys}
    for r in range(args.rounds + 1):  # round 0 warms every worker (thread tuner, caches) and is not counted
        for k in keys[r % len(keys) :] + keys[: r % len(keys)]:
            procs[k].stdin.write("run\n")
            procs[k].stdin.flush()
            if (answer := json.loads(procs[k].stdout.readline())) and r:
                runs[k].append(answer)
    for p in procs.values():
        p.stdin.close()
        p.wait()
    print(f"# {cpu_name()}, {os.cpu_count()} cores, batch 1, greedy, {len(REQUESTS)} requests x {args.max_tokens} "
          f"tokens, {args.rounds} rounds")  # fmt: skip
    same_all = True
    for m in args.model or ["smollm2"]:
        for mode in ("plain", "spec"):
            tps = {t: sorted(x["tps"] for x in runs[m, mode, t]) for t in trees}
            same = all(x["tokens"] == y["tokens"] for x, y in zip(runs[m, mode, "before"], runs[m, mode, "after"]))
            same_all &= same
            cells = [f"{t} {statistics.median(v):7.1f} tok/s ({v[len(v) // 5]:.1f}-{v[-1 - len(v) // 5]:.1f})"
                     for t, v in tps.items()]  # fmt: skip
            ratio = statistics.median(tps["after"]) / statistics.median(tps["before"])
            print(f"{m:8} {mode:5} | {' | '.join(cells)} | after/before {ratio:.3f} | "
                  f"{'same tokens' if same else 'DIFFERENT tokens'}")  # fmt: skip
    return 0 if same_all else 1


if __name__ == "__main__":
    sys.exit(main())
