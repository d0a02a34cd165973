"""Replay the adaptive controller on recorded drafts: its decisions without the wall clock's noise.

    python bench/replay_adaptive.py [--prompts 24] [--max-tokens 64] [--set KNOB=VALUE ...]

On a shared 2-core machine two runs of the same interleaved A/B differ by +-5% per prompt, more than the knobs of
``spec_engine/adaptive.py`` move. This script separates the two things the engine's speed depends on:

1. **What the draft proposes** is deterministic (greedy): for every position i of each prompt's greedy
   continuation y, the draft's own 8-token greedy chain from the true prefix (prompt + y[:i]) is recorded once
   (``bench/out/replay_*.json``). A step drafted at depth G from position i accepts the longest prefix of that
   chain equal to y[i:], exactly as the engine's greedy verification does.
2. **What a step costs** comes from a model fit to the engine's measured steps on this CPU (float32, default pair;
   ``COSTS``): a plain chain call, a drafted step by depth, the draft's catch-up per token, per-call overhead.

The replay drives ``AdaptiveController`` the way ``Engine._decode`` does (a plain choice, the plain probe included,
runs a chain of ``EngineConfig.plain_chain`` steps, observed in one call; a drafted choice runs up to 4 native
steps, ending at a rejection while the request is ``unsure``; the draft cache is filled lazily, so a request's first
drafted step catches up its prompt), over held-out prompts sharing one controller (as a server's requests do) and
over the five demo prompts each with a fresh one (as ``specdec generate --compare`` runs them). It prints each
prompt's ratio to plain decoding for the controller's knobs as set (``--set OPTIMISM=1.0`` etc.) and for fixed
depths 1-3. The ratios are the model's: confirm a choice with an interleaved run of the engine itself.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from types import SimpleNamespace

if __package__ in (None, ""):  # run as a file: the repository root, not bench/, heads the import path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import spec_engine.adaptive as adaptive  # noqa: E402
from spec_engine import LLM, SamplingParams, default_model_paths  # noqa: E402
from spec_engine.drafters.draft_model import read_draft_vocab  # noqa: E402
from spec_engine.engine import EngineConfig  # noqa: E402

CHAIN = 8  # draft tokens recorded per position (the adaptive maximum depth)
PLAIN_CHAIN = EngineConfig().plain_chain  # plain steps per native call, as the engine runs them
DEMO = ["def fibonacci(n):", "import os", "class Stack:", "def read_csv(path):", "for i in range(10):"]
# ms, float32, default pair v2, 2 threads, quiet machine (2026-11-23): bench_step.py's forwards, and the engine's
# own steps timed around Engine.step (a depth-1 native call of one step: 1.26 ms, of which C++ 0.95)
COSTS = {
    "plain_forward": 0.70,  # one token of a plain chain
    "plain_call": 0.30,  # per plain chain call (measured with 8-token chains: ~5.9 ms)
    "target_per_token": 0.055,  # target pass: plain_forward + this per verified token past the root
    "draft_level": 0.09,  # one drafted level (the draft's forward + its reduced lm_head)
    "spec_step": 0.17,  # per drafted step: the draft's root forward and logits, acceptance, ATen calls in C++
    "spec_call": 0.31,  # per native speculative call: engine step, Python, dispatch
    "catch_up_token": 0.0125,  # per token of the draft's catch-up (a prompt)
    "catch_up_call": 0.05,
}


def record(prompts: list[tuple[str, list[int]]], max_tokens: int, path: Path) -> list[dict]:
    """The target's greedy tokens y and, for each position i, the draft's greedy chain after prompt + y[:i]."""
    target, draft = default_model_paths()
    plain = LLM(target, None, dtype="float32")
    # a draft model loaded as a "target": its reduced vocabulary needs the regular step, not plain native chains
    drafter = LLM(draft, None, dtype="float32", max_num_seqs=64, engine_config=EngineConfig(plain_chain=1))
    drafter.engine.target.restrict_vocab(read_draft_vocab(draft, drafter.engine.target.config.vocab_size, None))
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    chain = SamplingParams(max_tokens=CHAIN, temperature=0.0, ignore_eos=True)
    out = []
    for name, ids in prompts:
        y = plain.generate([{"prompt_token_ids": ids}], greedy, use_tqdm=False)[0].outputs[0].token_ids
        drafts = drafter.generate([{"prompt_token_ids": ids + y[:i]} for i in range(max_tokens)], chain,
                                  use_tqdm=False)  # fmt: skip
        out.append({"name": name, "prompt_len": len(ids), "y": y, "chains": [d.outputs[0].token_ids for d in drafts]})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out))
    return out


def accepted(rec: dict, pos: int, G: int, max_tokens: int) -> int:
    """Drafts a depth-G step at ``pos`` keeps: the longest prefix of the recorded chain equal to y."""
    n = 0
    for j in range(min(G, max_tokens - pos - 1)):
        if rec["chains"][pos][j] != rec["y"][pos + j]:
            break
        n += 1
    return n


def plain_ms(max_tokens: int) -> float:
    calls = -(-max_tokens // PLAIN_CHAIN)
    return calls * COSTS["plain_call"] + max_tokens * COSTS["plain_forward"]


def replay(ctl, rec: dict, max_tokens: int, fixed: int = 0) -> float:
    """Milliseconds of one request decoded under ``ctl`` (or at the ``fixed`` depth, its draft prefilled)."""
    c = COSTS
    req = SimpleNamespace(spec_state=None, params=SimpleNamespace(max_tokens=max_tokens), output_token_ids=[],
                          num_computed=rec["prompt_len"] - 1, draft_len=0,
                          metrics=SimpleNamespace(alpha_estimate=None))  # fmt: skip
    total, pos = 0.0, 0
    if fixed:  # a fixed depth prefills the draft with the prompt
        total += c["catch_up_call"] + c["catch_up_token"] * req.num_computed
        req.draft_len = req.num_computed
    while pos < max_tokens:
        G = fixed or ctl.choose([req])[0]
        if G == 0:
            K = min(PLAIN_CHAIN, max_tokens - pos)
            t = c["plain_call"] + K * c["plain_forward"]
            ctl.observe([req], [0], [1], 0.0, t / K / 1e3, steps=K)
            pos, req.num_computed, total = pos + K, req.num_computed + K, total + t
            req.output_token_ids.extend([0] * K)
            continue
        unsure = not fixed and ctl.unsure([req])
        for s in range(max(min(4, (max_tokens - pos) // (G + 1)), 1)):
            lag = req.num_computed - req.draft_len
            n = accepted(rec, pos, G, max_tokens) + 1
            t_draft = G * c["draft_level"] + (c["catch_up_call"] + c["catch_up_token"] * lag if lag > 1 else 0.0)
            t_target = c["plain_forward"] + G * c["target_per_token"] + c["spec_step"]
            t = t_target + t_draft + (c["spec_call"] if s == 0 else 0.0)
            if not fixed:
                ctl.observe([req], [G], [n], t_draft / 1e3, t / 1e3)
            pos, req.num_computed, total = pos + n, req.num_computed + n, total + t
            req.output_token_ids.extend([0] * n)
            req.draft_len = req.num_computed - (n == G + 1)  # a full chain leaves its last draft to catch up
            if pos >= max_tokens or (unsure and n == 1):
                break
    return total


def controller():
    ctl = adaptive.AdaptiveController(CHAIN, lambda g: g + 1, cache_lag=lambda r: r.num_computed - r.draft_len)
    ctl._cold = False  # the engine's first step pays one-time costs; a replay has none
    return ctl


def ratios(recs: list[dict], max_tokens: int, shared: bool, fixed: int = 0, rounds: int = 3) -> list[float]:
    """Plain time over replayed time per prompt (median over ``rounds`` passes when one controller is shared)."""
    ctl = controller()
    per = [[] for _ in recs]
    for _ in range(rounds if shared else 1):
        for i, rec in enumerate(recs):
            per[i].append(plain_ms(max_tokens) / replay(ctl if shared else controller(), rec, max_tokens, fixed))
    return [statistics.median(p) for p in per]


def row(name: str, xs: list[float]) -> str:
    per = " ".join(f"{x:.2f}" for x in xs)
    return f"{name:<10} geomean {statistics.geometric_mean(xs):.3f} min {min(xs):.2f} | {per}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=24, help="held-out prompts (numpy source slices)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--demo-tokens", type=int, default=128)
    ap.add_argument("--set", action="append", default=[], metavar="KNOB=VALUE",
                    help="a constant of spec_engine/adaptive.py for this replay (e.g. OPTIMISM=1.0)")  # fmt: skip
    ap.add_argument("--out-dir", type=Path, default=Path(__file__).parent / "out")
    args = ap.parse_args(argv)
    for kv in args.set:
        knob, _, value = kv.partition("=")
        if not hasattr(adaptive, knob):
            ap.error(f"spec_engine.adaptive has no {knob}")
        setattr(adaptive, knob, type(getattr(adaptive, knob))(value))
    held_path = args.out_dir / f"replay_held_{args.prompts}_{args.max_tokens}.json"
    demo_path = args.out_dir / f"replay_demo_{args.demo_tokens}.json"
    if held_path.is_file():
        held = json.loads(held_path.read_text())
    else:
        from bench.bench_step import held_out_prompts

        print(f"[replay] recording {args.prompts} held-out prompts (once, into {held_path})")
        held = record(held_out_prompts(LLM(default_model_paths()[0], None), args.prompts), args.max_tokens, held_path)
    if demo_path.is_file():
        demo = json.loads(demo_path.read_text())
    else:
        print(f"[replay] recording the demo prompts (once, into {demo_path})")
        plain = LLM(default_model_paths()[0], None)
        demo = record([(t, plain.encode(t)) for t in DEMO], args.demo_tokens, demo_path)
    knobs = {k: getattr(adaptive, k) for k in ("OPTIMISM", "OPTIMISM_PSEUDO_TRIALS", "MIN_GAIN", "PRIOR_STRENGTH",
                                               "SURE_TRIALS", "PROBE_INTERVAL", "PLAIN_PROBE_INTERVAL")}  # fmt: skip
    print(f"knobs: {knobs}")
    print(f"held-out, {len(held)} prompts x {args.max_tokens} tokens, one controller; ratio to plain decoding:")
    print(row("adaptive", ratios(held, args.max_tokens, shared=True)))
    for g in (1, 2, 3):
        print(row(f"fixed {g}", ratios(held, args.max_tokens, shared=True, fixed=g)))
    print(f"demo prompts x {args.demo_tokens} tokens, a fresh controller each ({', '.join(DEMO)}):")
    print(row("adaptive", ratios(demo, args.demo_tokens, shared=False)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
