"""Structured outputs (``guided_json``) on five chat requests, each with its schema: the speculative engine against
plain decoding under the same guide, alternating rounds (``specdec generate --compare``'s), and plain decoding
without the guide as a control (what the guide itself costs: a guided request decodes one Python-driven step per
call, with a grammar mask per node).

    python bench/bench_structured.py [--model smollm2] [--method hybrid|suffix|...] [--repeats 5] [--max-tokens 128]
        [--compact]

Per request: tokens, each engine's median tok/s, the speedup, alpha, tau, whether the tokens equal plain decoding's
and whether the answer parses as JSON; then the medians. Exits 1 when some request's tokens differ.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: the repository root, not bench/, heads the import path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import save_same_tokens  # noqa: E402
from spec_engine.cli import _alternating_tps, add_model_args, build_llm  # noqa: E402
from spec_engine.sampling import SamplingParams  # noqa: E402


def _obj(**props) -> dict:
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


STR, INT, NUM = {"type": "string"}, {"type": "integer"}, {"type": "number"}
# Written for this benchmark, never used to tune anything: everyday extraction and listing requests.
REQUESTS = [
    ("List three fruits and their colours as JSON.",
     _obj(fruits={"type": "array", "items": _obj(name=STR, colour=STR)})),
    ("Give a JSON object for a book you like: its title, author and year.", _obj(title=STR, author=STR, year=INT)),
    ("Describe the Python function `def add(a, b): return a + b` as JSON: its name, its parameters and what it "
     "returns.", _obj(name=STR, parameters={"type": "array", "items": STR}, returns=STR)),
    ("Extract the person from this sentence as JSON: 'Maria Lopez, 29, lives in Madrid and works as a nurse.'",
     _obj(name=STR, age=INT, city=STR, job=STR)),
    ("Give today's weather in Paris as JSON: the city, the temperature in Celsius and the conditions.",
     _obj(city=STR, temperature_c=NUM, conditions=STR)),
]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5, help="alternating rounds per request")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--compact", action="store_true", help="disable_any_whitespace: compact JSON, keys forced whole")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "out" / "bench_structured.json"))
    add_model_args(ap)
    ap.set_defaults(model="smollm2")
    args = ap.parse_args(argv)
    args.compare = True  # build_llm sizes the suffix cache as --compare does (no global tree)
    llm = build_llm(args, fallback=True)
    base = build_llm(argparse.Namespace(**{**vars(args), "model": str(llm.model_dir)}), speculate=False)
    rows = []
    for text, schema in REQUESTS:
        prompt = {"prompt_token_ids": llm.render_chat([{"role": "user", "content": text}])[1]}
        guided = SamplingParams(max_tokens=args.max_tokens, guided_json=schema, disable_any_whitespace=args.compact)
        out = llm.generate([prompt], guided, use_tqdm=False)[0]
        ref = base.generate([prompt], guided, use_tqdm=False)[0]
        spec_tps, base_tps = _alternating_tps(llm, base, prompt, guided, args.repeats)
        free = SamplingParams(max_tokens=len(ref.outputs[0].token_ids), ignore_eos=True)  # the same length, unguided
        free_tps, control_tps = _alternating_tps(base, base, prompt, free, args.repeats)
        try:
            parses = out.outputs[0].finish_reason == "stop" and isinstance(json.loads(out.outputs[0].text), dict)
        except ValueError:
            parses = False
        m = out.metrics
        row = {"request": text[:60], "tokens": len(out.outputs[0].token_ids), "spec_tps": spec_tps,
               "base_tps": base_tps, "speedup": spec_tps / base_tps, "unguided_tps": free_tps,
               "control_tps": control_tps, "alpha": m["acceptance_rate"], "tau": m["mean_accepted_length"],
               "same": out.outputs[0].token_ids == ref.outputs[0].token_ids, "json": parses}  # fmt: skip
        rows.append(row)
        print(f"{row['speedup']:.2f}x  {spec_tps:6.1f} vs {base_tps:6.1f} tok/s guided; plain unguided "
              f"{free_tps:6.1f} (control {control_tps:6.1f})  alpha {row['alpha']:.2f}  tau {row['tau']:.2f}  "
              f"{'same' if row['same'] else 'DIFFERENT'}  {'json' if parses else 'NOT JSON'}  {row['tokens']} tok  "
              f"{row['request']!r}", flush=True)  # fmt: skip
    median = statistics.median(r["speedup"] for r in rows)
    cost = statistics.median(r["base_tps"] / r["unguided_tps"] for r in rows)
    print(f"median speedup {median:.2f}x over {len(rows)} guided requests; guided plain decoding at {cost:.2f} of "
          f"unguided ({llm.speculative_config['method']}, {llm.dtype}, {platform.node()})")  # fmt: skip
    payload = {"rows": rows, "median_speedup": median, "guided_over_unguided": cost}
    return save_same_tokens(args.out, payload, rows, "bench_structured")


if __name__ == "__main__":
    raise SystemExit(main())
