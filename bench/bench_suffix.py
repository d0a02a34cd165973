"""Suffix decoding: our suffix trees against arctic-inference's on the same traces, and end-to-end speedups.

    python bench/bench_suffix.py [--quick] [--model DIR] [--chat] [--max-tokens N] [--out DIR] [--traces FILE]
                                 [--arctic-python /tmp/arctic-venv/bin/python]

1. Traces: the target's greedy answers (plain decoding) to code-editing requests: a function from a held-out stdlib
   file (the zoo never trained on it) followed by an instruction to copy or rewrite it. ``--chat`` wraps each
   request in the model's chat template (SmolLM2).
2. Acceptance, offline: each trace is replayed as greedy speculative decoding would run it (draft from the context,
   keep the longest drafted path that matches the trace, emit it plus one token), requests one after another, the
   whole set twice (the second pass finds the first pass's answers in the global tree). Ours
   (``SuffixCache`` over the C++ trees) and arctic-inference 0.3.0's ``SuffixDecodingCache`` (the peer; run in its
   own interpreter, ``--arctic-python``, through this file's ``--peer`` mode) see the same traces with the same knobs
   (vLLM's defaults: max_tree_depth 24, max_spec_factor 1.0, min_token_prob 0.1; 16 tokens per step), as trees and
   as chains (arctic's ``use_tree_spec``). Columns: tau (tokens per target pass), accepted per step, drafted nodes
   per step, acceptance (accepted / drafted).
3. End to end, batch 1, greedy: plain decoding against ``{"method": "suffix"}`` (and the hybrid, with the model's
   draft) on the same requests, each configuration timed back to back with plain decoding per request (the load
   drift of a shared machine hits both sides of a ratio); speedup = median of the per-request ratios of decode
   tok/s. Tokens are checked against plain decoding. A control row times held-out code continued (``--held-out``;
   ``bench.harness.build_prompts``), where matching has little to find: the never-slower check.

Writes ``--out``/suffix.json with the machine's name, and the traces to ``--out``/traces.json (``--traces`` replays
them).
"""

from __future__ import annotations

import argparse
import ast
import json
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

KNOBS = {"max_tree_depth": 24, "max_spec_tokens": 16, "max_spec_factor": 1.0, "min_token_prob": 0.1}
INSTRUCTIONS = (
    "\n\n# The same function again, unchanged:\n",
    "\n\n# The same function, with a docstring added:\n",
)


# --- the replay (no spec_engine import: the peer's interpreter runs it too) ----------------------------------------


def accepted_path(tokens: list[int], parents: list[int], truth: list[int]) -> int:
    """Drafted nodes a greedy verifier keeps: the longest path from the root whose tokens are ``truth``'s prefix."""
    children: dict[int, dict[int, int]] = {}
    for i, (t, p) in enumerate(zip(tokens, parents)):
        children.setdefault(p, {}).setdefault(t, i)
    node, n = -1, 0
    for t in truth:
        node = children.get(node, {}).get(t)
        if node is None:
            break
        n += 1
    return n


def replay(traces: list[dict], start, speculate, append, finish, passes: int = 2) -> list[dict]:
    """Per pass: tau, accepted and drafted tokens per step over the traces served one after another.

    ``start(key, prompt)``, ``speculate(key, context) -> (tokens, parents)``, ``append(key, tokens)``,
    ``finish(key)`` drive one suffix cache; a request's key is unique per pass."""
    out = []
    for p in range(passes):
        steps = drafted = accepted = emitted = 0
        for i, tr in enumerate(traces):
            key, prompt, answer = p * len(traces) + i, tr["prompt"], tr["output"]
            start(key, prompt)
            pos = 0
            while pos < len(answer):
                tokens, parents = speculate(key, prompt + answer[:pos])
                n = min(accepted_path(tokens, parents, answer[pos:]), len(answer) - pos - 1)
                new = answer[pos : pos + n + 1]
                append(key, new)
                steps, drafted, accepted, emitted = steps + 1, drafted + len(tokens), accepted + n, emitted + len(new)
                pos += len(new)
            finish(key)
        out.append({"pass": p + 1, "tau": emitted / steps, "accepted_per_step": accepted / steps,
                    "drafted_per_step": drafted / steps, "acceptance": accepted / max(drafted, 1),
                    "steps": steps, "tokens": emitted})  # fmt: skip
    return out


def replay_arctic(traces: list[dict], use_tree: bool) -> list[dict]:
    from arctic_inference.suffix_decoding import SuffixDecodingCache

    cache = SuffixDecodingCache(max_tree_depth=KNOBS["max_tree_depth"], max_cached_requests=-1)

    def speculate(key, context):
        d = cache.speculate(key, context, max_spec_tokens=KNOBS["max_spec_tokens"],
                            max_spec_factor=KNOBS["max_spec_factor"], min_token_prob=KNOBS["min_token_prob"],
                            use_tree_spec=use_tree)  # fmt: skip
        return list(d.token_ids), list(d.parents)

    return replay(traces, cache.start_request, speculate, cache.add_active_response, cache.stop_request)


def replay_ours(traces: list[dict], use_tree: bool) -> list[dict]:
    import numpy as np

    from spec_engine.drafters.suffix import NativeSuffixTree
    from spec_engine.drafters.suffix_ref import SuffixCache

    cache = SuffixCache(KNOBS["max_tree_depth"], -1, NativeSuffixTree)
    history: dict[int, list[int]] = {}
    prompt_len: dict[int, int] = {}

    def start(key, prompt):
        history[key], prompt_len[key] = list(prompt), len(prompt)
        cache.update(key, np.array(prompt), len(prompt))

    def append(key, tokens):
        history[key] += tokens
        cache.update(key, np.array(history[key]), prompt_len[key])

    def speculate(key, context):
        d = cache.speculate(key, np.array(context), KNOBS["max_spec_tokens"], KNOBS["max_spec_factor"],
                            KNOBS["min_token_prob"], use_tree)  # fmt: skip
        return d.tokens, d.parents

    return replay(traces, start, speculate, append, cache.finish)


# --- traces and end to end ------------------------------------------------------------------------------------------


def functions(count: int, min_chars: int = 300, max_chars: int = 900) -> list[str]:
    """Source of ``count`` top-level functions from the held-out stdlib files, evenly spread."""
    from spec_engine.training.train import corpus_files, parsed_files

    _, held = corpus_files()
    found = []
    for text, tree in parsed_files(held):
        for node in tree.body:
            if isinstance(node, ast.FunctionDef):
                src = ast.get_source_segment(text, node) or ""
                if min_chars <= len(src) <= max_chars:
                    found.append(src)
                    break
    step = max(len(found) // count, 1)
    return found[::step][:count]


def requests(llm, count: int, chat: bool) -> list[list[int]]:
    out = []
    for i, src in enumerate(functions(count)):
        text = src + INSTRUCTIONS[i % len(INSTRUCTIONS)]
        if chat:  # ChatML (SmolLM2's template)
            ask = f"Rewrite this function, adding a docstring:\n\n{src}"
            text = f"<|im_start|>user\n{ask}<|im_end|>\n<|im_start|>assistant\n"
        out.append(llm.encode(text))
    return out


def make_traces(llm, prompts: list[list[int]], max_tokens: int) -> list[dict]:
    from spec_engine import SamplingParams

    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=max_tokens,
                        temperature=0.0), use_tqdm=False)  # fmt: skip
    return [{"prompt": p, "output": o.outputs[0].token_ids} for p, o in zip(prompts, outs)]


def end_to_end(model: str, configs: dict, prompts: list[list[int]], max_tokens: int, rounds: int) -> dict:
    """Per configuration: median speedup over plain decoding (per request and round, back to back), tau, same."""
    from spec_engine import LLM, SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    plain = LLM(model, max_model_len=2048)
    engines = {name: LLM(model, speculative_config=spec, max_model_len=2048) for name, spec in configs.items()}
    base = [o.outputs[0].token_ids for o in plain.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                            use_tqdm=False)]  # fmt: skip
    for llm in [plain, *engines.values()]:  # one-time costs (first forwards, the thread tuner's probes) untimed
        llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)
    result = {}
    for name, llm in engines.items():
        ratios, taus, plain_tps, spec_tps, same = [], [], [], [], True
        for r in range(rounds):
            for i, p in enumerate(prompts):
                pair = [(plain, None), (llm, name)]
                if (r + i) % 2:
                    pair.reverse()  # which side runs first alternates
                tps = {}
                for engine, who in pair:
                    o = engine.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0]
                    tps[who] = o.metrics["decode_tokens_per_s"]
                    if who is not None:
                        taus.append(o.metrics["mean_accepted_length"])
                        same &= o.outputs[0].token_ids == base[i]
                ratios.append(tps[name] / tps[None])
                plain_tps.append(tps[None])
                spec_tps.append(tps[name])
        result[name] = {"speedup": statistics.median(ratios), "ratios": ratios, "tau": statistics.mean(taus),
                        "plain_tok_s": statistics.median(plain_tps), "spec_tok_s": statistics.median(spec_tps),
                        "same_tokens": same}  # fmt: skip
    return result


def run_peer(traces: list[dict], python: str) -> dict | None:  # the peer sees KNOBS as they are here
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = Path(tmp) / "traces.json", Path(tmp) / "arctic.json"
        src.write_text(json.dumps(traces))
        cmd = [python, __file__, "--peer", str(src), str(dst), "--max-tree-depth", str(KNOBS["max_tree_depth"])]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            print(f"arctic-inference peer failed:\n{done.stderr[-2000:]}", file=sys.stderr)
            return None
        return json.loads(dst.read_text())


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="6 requests, 96 tokens, 1 timed round")
    ap.add_argument("--model", default=None, help="target directory (default: the embedded target)")
    ap.add_argument("--draft", default=None, help="the hybrid's model drafter (default: the embedded draft)")
    ap.add_argument("--chat", action="store_true", help="wrap the requests in the model's chat template")
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--timed-requests", type=int, default=5, help="requests timed end to end (0: acceptance only)")
    ap.add_argument("--held-out", type=int, default=3, help="held-out code prompts timed as a control row")
    ap.add_argument("--arctic-python", default="/tmp/arctic-venv/bin/python")
    ap.add_argument("--out", default="bench/out")
    ap.add_argument("--traces", default=None, help="replay these traces (a traces.json this bench wrote)")
    ap.add_argument(
        "--max-tree-depth",
        type=int,
        default=KNOBS["max_tree_depth"],
        help="the trees' depth on both sides (vLLM's default: 24; the engine's: 32)",
    )
    ap.add_argument("--peer", nargs=2, metavar=("TRACES", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.quick:
        args.requests, args.max_tokens, args.rounds, args.timed_requests, args.held_out = 6, 96, 1, 3, 2
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    KNOBS["max_tree_depth"] = args.max_tree_depth
    if args.peer:  # arctic-inference's interpreter: the replay only
        traces = json.loads(Path(args.peer[0]).read_text())
        out = {mode: replay_arctic(traces, mode == "tree") for mode in ("tree", "chain")}
        Path(args.peer[1]).write_text(json.dumps(out))
        return 0
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from spec_engine import LLM, default_model_paths

    target, draft = default_model_paths()
    model, draft = args.model or target, args.draft or (draft if args.model is None else None)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.traces and Path(args.traces).is_file():  # the same traces again (a new drafter, the same target)
        traces = json.loads(Path(args.traces).read_text())
        prompts = [t["prompt"] for t in traces]
    else:
        llm = LLM(model, max_model_len=2048)
        prompts = requests(llm, args.requests, args.chat)
        traces = make_traces(llm, prompts, args.max_tokens)
        del llm
        (out / "traces.json").write_text(json.dumps(traces))
    print(f"{len(traces)} traces, {sum(len(t['output']) for t in traces)} tokens ({model}); knobs {KNOBS}")
    ours = {mode: replay_ours(traces, mode == "tree") for mode in ("tree", "chain")}
    peer = run_peer(traces, args.arctic_python) if Path(args.arctic_python).is_file() else None
    if peer is None:
        print(f"arctic-inference skipped: no interpreter at --arctic-python {args.arctic_python} (a venv with "
              "arctic-inference==0.3.0: README, 'Benchmarks')")  # fmt: skip
    print(f"{'drafter':<22}{'pass':>5}{'tau':>7}{'acc/step':>9}{'drafted':>9}{'alpha':>7}")
    for mode in ("tree", "chain"):
        for who, res in (("ours", ours), ("arctic-inference", peer)):
            for row in (res or {}).get(mode, []):
                print(f"{who + ' ' + mode:<22}{row['pass']:>5}{row['tau']:>7.2f}{row['accepted_per_step']:>9.2f}"
                      f"{row['drafted_per_step']:>9.2f}{row['acceptance']:>7.2f}")  # fmt: skip
    configs = {"suffix": {"method": "suffix"}}
    if draft:
        configs["hybrid"] = {"method": "hybrid", "model": draft}
        configs["draft_model"] = {"method": "draft_model", "model": draft}
    sets = {"code-editing": prompts[: args.timed_requests]}
    if args.held_out:  # the control row: held-out code continued, where suffix matching has little to find
        from bench.harness import build_prompts

        sets["held-out"] = [p.ids for p in build_prompts(LLM(model, max_model_len=2048), args.held_out, 0)[0]]
    e2e = {}
    for what, timed in sets.items():
        if not timed:
            continue
        e2e[what] = end_to_end(model, configs, timed, args.max_tokens, args.rounds)
        print(f"{what}, end to end, batch 1, greedy, {len(timed)} requests x {args.rounds} rounds, "
              f"{args.max_tokens} tokens:")  # fmt: skip
        for name, r in e2e[what].items():
            same = "same" if r["same_tokens"] else "DIFFERENT"
            print(f"  {name:<12} speedup {r['speedup']:.2f}x (plain {r['plain_tok_s']:.0f} tok/s, {name} "
                  f"{r['spec_tok_s']:.0f}) tau {r['tau']:.2f} | {same} tokens")  # fmt: skip
    (out / "suffix.json").write_text(
        json.dumps(
            {
                "machine": platform.node(),
                "model": model,
                "knobs": KNOBS,
                "ours": ours,
                "arctic": peer,
                "end_to_end": e2e,
            },
            indent=1,
        )
    )
    print(f"wrote {out / 'suffix.json'}")
    if not all(r["same_tokens"] for rows in e2e.values() for r in rows.values()):
        print("DIFFERENT tokens in some row: its speedup is not a result", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
