"""Replay the adaptive controller on recorded drafts: its decisions without the wall clock's noise.

    python bench/replay_adaptive.py [--prompts 24] [--max-tokens 64] [--set KNOB=VALUE ...]
    python bench/replay_adaptive.py --model smollm2 [--noise 0.05 --seeds 3] [--engine plain_chain=8 ...]

On a shared 2-core machine two runs of the same interleaved A/B differ by +-5% per prompt, more than the knobs of
``spec_engine/adaptive.py`` and ``spec_engine/estimates.py`` move. This script separates the two things the engine's
speed depends on:

1. **What the draft proposes** is deterministic (greedy): for every position i of each prompt's greedy
   continuation y, the draft's own 8-token greedy chain from the true prefix (prompt + y[:i]) is recorded once
   (``bench/out/replay_*.json``). A step drafted at depth G from position i accepts the longest prefix of that
   chain equal to y[i:], exactly as the engine's greedy verification does. With ``--model`` (a target and its
   EAGLE head, whose chain reads the target's features), the count the target keeps of the head's 8-deep chain at
   each position is recorded instead, each prefix a request to an engine drafting 8 deep (``record_head``).
2. **What a step costs** comes from a model fit to the engine's measured steps on one machine (``PROFILES``: the
   default pair in float32; SmolLM2 with its head in bfloat16 on the Xeon): a plain step by context, a drafted
   step by depth and context, the draft's levels and catch-up per token, per-call overhead.

The replay drives ``AdaptiveController`` the way ``Engine._decode`` does (``replay``: native calls of the
engine's lengths; the draft cache is filled lazily, so a request's first drafted step catches up its prompt), over
requests sharing one controller (as a server's requests do) and over the five demo prompts each with a fresh one
(as ``specdec generate --compare`` runs them). It prints each prompt's ratio to plain decoding for the
controller's knobs as set (``--set OPTIMISM=1.0`` etc.) and the engine's (``--engine``), and for fixed depths (1-3;
1-8 with ``--model``). ``--noise`` multiplies each time the controller sees by a log-normal factor (the step-to-step
jitter of a real machine; the totals stay the model's). The ratios are the model's: confirm a choice with an
interleaved run of the engine itself.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

if __package__ in (None, ""):  # run as a file: the repository root, not bench/, heads the import path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import spec_engine.adaptive as adaptive  # noqa: E402
import spec_engine.estimates as estimates  # noqa: E402
from spec_engine import LLM, SamplingParams, default_model_paths  # noqa: E402
from spec_engine.drafters.draft_model import read_draft_vocab  # noqa: E402
from spec_engine.engine import EngineConfig  # noqa: E402
from spec_engine.request import Request  # noqa: E402

CHAIN = 8  # draft tokens recorded per position (the adaptive maximum depth)
ENGINE = EngineConfig()  # the engine's call structure: plain chains, speculative calls (full, and while unsure)
DEMO = ["def fibonacci(n):", "import os", "class Stack:", "def read_csv(path):", "for i in range(10):"]


class StubRequest(SimpleNamespace):
    """A request as the adaptive controller reads it, without an engine (this replay's, and the tests'): the fields
    its maker gives, and ``Request``'s own ``tokens_left``."""

    tokens_left = Request.tokens_left  # (the property itself: max_tokens less the output's tokens)


@dataclass(frozen=True)
class Costs:
    """Milliseconds of a step's parts on one machine, L the context (prompt and tokens so far)."""

    plain_forward: float  # a plain step's forward and logits at L = 0 ...
    plain_per_key: float  # ... plus this per token of context
    plain_call: float  # per plain chain call
    target_per_token: float  # a drafted step's target pass: a plain forward, plus this per verified token past the
    target_per_token_key: float  # root, plus this per such token and token of context (its attention)
    spec_step: float  # per drafted step: acceptance, compaction
    draft_first: float  # a drafted step's draft cost beyond its levels' (the head first maps the target's features)
    draft_level: float  # one drafted level (the draft's forward and its reduced lm_head)
    spec_call: float  # per native speculative call: engine step, Python, dispatch
    catch_up_token: float  # per token of the draft's catch-up (a prompt)
    catch_up_call: float

    def plain(self, L: int) -> float:
        return self.plain_forward + self.plain_per_key * L

    def target(self, G: int, L: int) -> float:
        return self.plain(L) + self.spec_step + G * (self.target_per_token + self.target_per_token_key * L)

    def draft(self, G: int) -> float:
        return self.draft_first + G * self.draft_level


PROFILES = {
    # float32, default pair v2, 2 threads, quiet machine (2026-11-23): bench_step.py's forwards, and the engine's
    # own steps timed around Engine.step (a depth-1 native call of one step: 1.26 ms, of which C++ 0.95); a plain
    # chain call of 8 tokens ~5.9 ms
    "pair": Costs(
        plain_forward=0.70,
        plain_per_key=0.0,
        plain_call=0.30,
        target_per_token=0.055,
        target_per_token_key=0.0,
        spec_step=0.17,
        draft_first=0.0,
        draft_level=0.09,
        spec_call=0.31,
        catch_up_token=0.0125,
        catch_up_call=0.05,
    ),
    # SmolLM2-135M-Instruct bf16 and its shipped EAGLE-3 head, 2 threads, the Xeon with AMX (2026-11-26): fit to
    # the step's parts and the forwards by context in bench/RESULTS-log.md, "The verify's attention, trees and the
    # native tree step" (checked against "The adaptive head against fixed depths, replayed without noise")
    "smollm2": Costs(
        plain_forward=13.1,
        plain_per_key=0.0025,
        plain_call=0.3,
        target_per_token=0.05,
        target_per_token_key=0.0013,
        spec_step=0.1,
        draft_first=0.23,
        draft_level=0.41,
        spec_call=0.3,
        catch_up_token=0.03,
        catch_up_call=0.3,
    ),
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


def record_head(model: str, n: int, max_tokens: int, path: Path) -> list[dict]:
    """The same for a target and its EAGLE head (HumanEval chat requests, as ``bench_drafters.py`` sends them): the
    target's greedy answer y (ending at EOS, as a chat user's does) and, for each position i, how many of the head's
    8-deep greedy chain drafted there the target keeps (``ks[i]``). The head's chain reads the target's features,
    so it is not run on its own: each prefix prompt + y[:i] is a request of its own to an engine drafting 8 deep,
    and ``ks[i]`` is what its first decode step (root: the prefix's last token) accepted."""
    from bench.bench_drafters import humaneval_prompts
    from spec_engine.engine import Engine

    kw = dict(dtype="bfloat16", max_model_len=4096, kv_cache_memory=512 << 20)
    plain = LLM(model, **kw)
    head = LLM(model, speculative_config={"method": "eagle", "num_speculative_tokens": CHAIN}, max_num_seqs=16, **kw)
    first: dict[int, int] = {}  # prompt length -> drafts its first decode step kept
    apply = head.engine._apply

    def spy(self: Engine, reqs, result):
        for b, req in enumerate(reqs):
            first.setdefault(len(req.prompt_token_ids), result.counts[0][b] - 1)
        return apply(reqs, result)

    head.engine._apply = spy.__get__(head.engine)
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    chain = SamplingParams(max_tokens=CHAIN + 1, temperature=0.0, ignore_eos=True)
    out = []
    for p in humaneval_prompts(plain, n):
        y = plain.generate([{"prompt_token_ids": p.ids}], greedy, use_tqdm=False)[0].outputs[0].token_ids
        first.clear()
        head.generate([{"prompt_token_ids": p.ids + y[:i]} for i in range(len(y))], chain, use_tqdm=False)
        ks = [first[len(p.ids) + i] for i in range(len(y))]
        out.append({"name": p.name, "prompt_len": len(p.ids), "y": y, "ks": ks})
        print(f"[replay] {p.name}: {len(y)} tokens, mean accepted of 8 {statistics.mean(ks):.2f}", flush=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out))
    return out


def answer_len(rec: dict, max_tokens: int) -> int:
    return min(len(rec["y"]), max_tokens)


def accepted(rec: dict, pos: int, G: int, n: int) -> int:
    """Drafts a depth-G step at ``pos`` keeps of an answer of ``n`` tokens: the recorded count (``ks``), or the
    longest prefix of the recorded chain equal to y."""
    cap = min(G, n - pos - 1)
    if "ks" in rec:
        return max(min(rec["ks"][pos], cap), 0)
    k = 0
    while k < cap and rec["chains"][pos][k] == rec["y"][pos + k]:
        k += 1
    return k


def plain_ms(costs: Costs, rec: dict, max_tokens: int) -> float:
    """Plain decoding's milliseconds: chains of ``EngineConfig.plain_chain`` steps."""
    n, L0 = answer_len(rec, max_tokens), rec["prompt_len"]
    calls = -(-n // ENGINE.plain_chain)
    return calls * costs.plain_call + sum(costs.plain(L0 + i) for i in range(n))


def replay(ctl, rec: dict, max_tokens: int, costs: Costs, fixed: int = 0, noise=None) -> float:
    """Milliseconds of one request decoded under ``ctl`` (or at the ``fixed`` depth, its draft prefilled), as the
    engine runs it: a plain choice is a chain of ``EngineConfig.plain_chain`` steps (the plain probe
    ``plain_probe_steps`` of them); a drafted one a native call of up to ``spec_chain_steps`` steps
    (``unsure_chain_steps`` while the controller is unsure, ending at a step that accepted nothing). The controller
    sees each step's time as the engine reports it (a call's own work spread over a full call's steps), times
    ``noise()`` if given; the total is the model's."""
    c, n, L0 = costs, answer_len(rec, max_tokens), rec["prompt_len"]
    jitter = noise or (lambda: 1.0)
    req = StubRequest(spec_state=None, params=SimpleNamespace(max_tokens=max_tokens), output_token_ids=[],
                      cache_seqlen=L0 - 1, draft_len=0,
                      metrics=SimpleNamespace(alpha_estimate=None))  # fmt: skip
    total, pos = 0.0, 0
    if fixed:  # a fixed depth prefills the draft with the prompt
        total += c.catch_up_call + c.catch_up_token * req.cache_seqlen
        req.draft_len = req.cache_seqlen
    while pos < n:
        left = max_tokens - pos
        G = min(fixed, left - 1) if fixed else ctl.choose([req])[0]
        if G == 0:
            K = min(ENGINE.plain_chain, n - pos)
            if ctl.plain_probe:  # the engine's probe: as many steps as measuring needs
                K = min(K, ctl.plain_probe_steps(1))
            steps = [c.plain(L0 + pos + i) for i in range(K)]
            if not fixed:
                per_step = c.plain_call / ENGINE.plain_chain + sum(steps) / K
                ctl.observe([req], [0], [1], 0.0, per_step * jitter() / 1e3, steps=K)
            pos, req.cache_seqlen, total = pos + K, req.cache_seqlen + K, total + c.plain_call + sum(steps)
            req.output_token_ids.extend([0] * K)
            continue
        unsure = not fixed and ctl.unsure([req])
        limit = ENGINE.unsure_chain_steps if unsure else ENGINE.spec_chain_steps
        total += c.spec_call
        for _ in range(max(min(limit, (max_tokens - pos) // (G + 1)), 1)):
            lag = req.cache_seqlen - req.draft_len
            k = accepted(rec, pos, G, n) + 1
            t_draft = c.draft(G) + (c.catch_up_call + c.catch_up_token * lag if lag > 1 else 0.0)
            t = c.target(G, L0 + pos) + t_draft
            if not fixed:
                seen = jitter()
                ctl.observe(
                    [req], [G], [k], t_draft * seen / 1e3, (t + c.spec_call / ENGINE.spec_chain_steps) * seen / 1e3
                )
            pos, req.cache_seqlen, total = pos + k, req.cache_seqlen + k, total + t
            req.output_token_ids.extend([0] * k)
            req.draft_len = req.cache_seqlen - (k == G + 1)  # a full chain leaves its last draft to catch up
            if pos >= n or (unsure and k == 1):
                break
    return total


def controller():
    ctl = adaptive.AdaptiveController(CHAIN, lambda g: g + 1, cache_lag=lambda r: r.cache_seqlen - r.draft_len)
    ctl._cold = False  # the engine's first step pays one-time costs; a replay has none
    return ctl


def ratios(recs: list[dict], max_tokens: int, costs: Costs, shared: bool, fixed: int = 0, rounds: int = 1,
           noise: float = 0.0, seed: int = 0) -> list[float]:  # fmt: skip
    """Plain time over replayed time per prompt (median over ``rounds`` passes when one controller is shared;
    ``noise``: the controller sees each step's time times a log-normal factor of this sigma)."""
    rng = random.Random(seed)
    jitter = (lambda: math.exp(rng.gauss(0.0, noise))) if noise else None
    ctl = controller()
    per = [[] for _ in recs]
    for _ in range(rounds if shared else 1):
        for i, rec in enumerate(recs):
            t = replay(ctl if shared else controller(), rec, max_tokens, costs, fixed, jitter)
            per[i].append(plain_ms(costs, rec, max_tokens) / t)
    return [statistics.median(p) for p in per]


def row(name: str, xs: list[float], ref: list[float] | None = None) -> str:
    per = " ".join(f"{x:.2f}" for x in xs)
    vs = f" ({statistics.geometric_mean(xs) / statistics.geometric_mean(ref):.3f} of the best fixed)" if ref else ""
    return f"{name:<10} geomean {statistics.geometric_mean(xs):.3f}{vs} median {statistics.median(xs):.2f} | {per}"


def head_rows(args, costs: Costs) -> None:
    """A target with its EAGLE head (``--model``): the adaptive controller, shared by the requests as one engine's
    is, against every fixed depth, on HumanEval chat requests."""
    path = args.out_dir / f"replay_{args.model}_he{args.prompts}_{args.max_tokens}.json"
    if path.is_file():
        recs = json.loads(path.read_text())
    else:
        print(f"[replay] recording {args.prompts} HumanEval requests (once, into {path})")
        recs = record_head(args.model, args.prompts, args.max_tokens, path)
    fixed = {g: ratios(recs, args.max_tokens, costs, shared=True, fixed=g) for g in range(1, CHAIN + 1)}
    best = max(fixed, key=lambda g: statistics.geometric_mean(fixed[g]))
    print(f"HumanEval, {len(recs)} requests x <= {args.max_tokens} tokens, one controller; ratio to plain decoding:")
    for seed in range(args.seeds):
        xs = ratios(recs, args.max_tokens, costs, shared=True, noise=args.noise, seed=seed)
        print(row(f"adaptive{seed}" if args.seeds > 1 else "adaptive", xs, fixed[best]))
    for g, xs in fixed.items():
        print(row(f"fixed {g}", xs))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a target with an EAGLE head (smollm2): HumanEval requests")
    ap.add_argument("--prompts", type=int, default=None, help="held-out prompts (default 24; HumanEval: 20)")
    ap.add_argument("--max-tokens", type=int, default=None, help="default 64 (HumanEval: 128)")
    ap.add_argument("--demo-tokens", type=int, default=128)
    ap.add_argument("--noise", type=float, default=0.0, help="sigma of the log-normal noise on the times observed")
    ap.add_argument("--seeds", type=int, default=1, help="adaptive runs, one noise seed each")
    ap.add_argument("--set", action="append", default=[], metavar="KNOB=VALUE",
                    help="a constant of spec_engine/adaptive.py or estimates.py (e.g. OPTIMISM=1.0)")  # fmt: skip
    ap.add_argument("--engine", action="append", default=[], metavar="KNOB=VALUE",
                    help="an EngineConfig field for this replay (e.g. plain_chain=8)")  # fmt: skip
    ap.add_argument("--out-dir", type=Path, default=Path(__file__).parent / "out")
    args = ap.parse_args(argv)
    if args.model is not None and args.model not in PROFILES:
        ap.error(f"no cost profile for {args.model}; profiles: {', '.join(p for p in PROFILES if p != 'pair')}")
    for kv in args.set:
        knob, _, value = kv.partition("=")
        module = next((m for m in (adaptive, estimates) if hasattr(m, knob)), None)
        if module is None:
            ap.error(f"neither spec_engine.adaptive nor spec_engine.estimates has {knob}")
        setattr(module, knob, type(getattr(module, knob))(value))
    global ENGINE
    for kv in args.engine:
        knob, _, value = kv.partition("=")
        if not hasattr(ENGINE, knob):
            ap.error(f"EngineConfig has no {knob}")
        ENGINE = dataclasses.replace(ENGINE, **{knob: type(getattr(ENGINE, knob))(value)})
    knobs = {k: getattr(estimates, k) for k in ("OPTIMISM", "OPTIMISM_PSEUDO_TRIALS", "PRIOR_STRENGTH")}
    knobs |= {k: getattr(adaptive, k) for k in ("MIN_GAIN", "SURE_TRIALS", "PROBE_INTERVAL", "PLAIN_PROBE_INTERVAL")}
    print(f"knobs: {knobs}; {ENGINE}")
    if args.model is not None:
        args.prompts, args.max_tokens = args.prompts or 20, args.max_tokens or 128
        head_rows(args, PROFILES[args.model])
        return 0
    args.prompts, args.max_tokens = args.prompts or 24, args.max_tokens or 64
    costs = PROFILES["pair"]
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
    print(f"held-out, {len(held)} prompts x {args.max_tokens} tokens, one controller; ratio to plain decoding:")
    print(row("adaptive", ratios(held, args.max_tokens, costs, shared=True, rounds=3, noise=args.noise)))
    for g in (1, 2, 3):
        print(row(f"fixed {g}", ratios(held, args.max_tokens, costs, shared=True, fixed=g, rounds=3)))
    print(f"demo prompts x {args.demo_tokens} tokens, a fresh controller each ({', '.join(DEMO)}):")
    print(row("adaptive", ratios(demo, args.demo_tokens, costs, shared=False, noise=args.noise)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
