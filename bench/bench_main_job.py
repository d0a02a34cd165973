"""The main job's figure on requests no one tuned for: ``specdec generate --model M --chat TEXT --compare`` for each
of five coding requests, in one process (each engine built once), with --compare's own rounds.

    python bench/bench_main_job.py [--model smollm2] [--method hybrid|suffix|...] [--repeats 5] [--max-tokens 128]

Per request: the answer's first line, tokens, each engine's median tok/s over the alternating rounds, their ratio
(the speedup), alpha, tau and whether the tokens equal plain decoding's; then the median speedup. Exits 1 when some
request's tokens differ (the greedy contract).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: the repository root, not bench/, heads the import path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import save_same_tokens  # noqa: E402
from spec_engine.cli import _alternating_tps, add_model_args, build_llm  # noqa: E402
from spec_engine.sampling import SamplingParams  # noqa: E402
from spec_kernels.linear import native_path  # noqa: E402

# Written for this benchmark, never used to tune anything: everyday coding requests of different kinds.
REQUESTS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "Write a Python function that checks whether a string is a palindrome, ignoring case and spaces.",
    "Rewrite this loop as a list comprehension:\nresult = []\nfor x in numbers:\n    if x % 2 == 0:\n"
    "        result.append(x * x)",
    "Write a Python class Stack with push, pop, peek and is_empty methods.",
    "Explain what this function does and add type hints:\ndef merge(a, b):\n    out = []\n    i = j = 0\n"
    "    while i < len(a) and j < len(b):\n        if a[i] < b[j]:\n            out.append(a[i]); i += 1\n"
    "        else:\n            out.append(b[j]); j += 1\n    return out + a[i:] + b[j:]",
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5, help="alternating rounds per request (--compare-repeats)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "out" / "bench_main_job.json"))
    add_model_args(ap)
    ap.set_defaults(model="smollm2")
    args = ap.parse_args(argv)
    args.compare = True  # build_llm sizes the suffix cache as --compare does
    llm = build_llm(args, fallback=True)
    base = build_llm(argparse.Namespace(**{**vars(args), "model": str(llm.model_dir)}), speculate=False)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    rows = []
    for text in REQUESTS:
        prompt = {"prompt_token_ids": llm.render_chat([{"role": "user", "content": text}])[1]}
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        ref = base.generate([prompt], params, use_tqdm=False)[0]
        spec_tps, base_tps = _alternating_tps(llm, base, prompt, params, args.repeats)
        m, answer = out.metrics, out.outputs[0].text.strip()
        row = {"request": text.splitlines()[0][:60], "tokens": len(out.outputs[0].token_ids), "spec_tps": spec_tps,
               "base_tps": base_tps, "speedup": spec_tps / base_tps, "alpha": m["acceptance_rate"],
               "tau": m["mean_accepted_length"], "same": out.outputs[0].token_ids == ref.outputs[0].token_ids,
               "answer": answer.splitlines()[0][:60] if answer else ""}  # fmt: skip
        rows.append(row)
        print(f"{row['speedup']:.2f}x  {spec_tps:7.1f} vs {base_tps:7.1f} tok/s  alpha {row['alpha']:.2f}  "
              f"tau {row['tau']:.2f}  {'same' if row['same'] else 'DIFFERENT'}  {row['tokens']} tok  "
              f"{row['request']!r} -> {row['answer']!r}", flush=True)  # fmt: skip
    median = statistics.median(r["speedup"] for r in rows)
    print(f"median speedup {median:.2f}x over {len(rows)} requests ({llm.speculative_config['method']}, "
          f"{llm.dtype}, {platform.node()}, bf16 linear {native_path()[0]})")  # fmt: skip
    payload = {"rows": rows, "median_speedup": median, "method": llm.speculative_config["method"], "dtype": llm.dtype}
    return save_same_tokens(args.out, payload, rows, "bench_main_job")


if __name__ == "__main__":
    raise SystemExit(main())
