"""End-to-end benchmark: our engine in every speculation mode, side by side with HF transformers on the same weights.

    python bench/bench_e2e.py [--quick] [--model DIR --draft DIR] [--max-tokens N] [--threads N] [--out DIR]
    specdec bench [same flags]

Glossary:
    mode      one engine configuration: ``none`` (no speculation), ``chainG`` (draft chain of depth G),
              ``tree[b1,b2,..]`` (static tree, children per depth), ``ngram`` (prompt lookup), ``adaptive``
              (``num_speculative_tokens="auto"``), ``useless_*`` (a random-init draft of the draft's config)
    peers     HF transformers on the same directories, float32: greedy ``generate``, assisted generation
              (``assistant_model=``, constant schedule of G tokens), prompt lookup (``prompt_lookup_num_tokens=G``)
    alpha     the engine's acceptance rate: accepted drafts / drafted tokens (drafted = depth asked per step)
    alpha_hat per-position acceptance: accepted / positions tried, where a step tries positions up to its first
              rejection (at most G). It is the i.i.d. alpha of Leviathan et al., the one E below assumes
    tau       tokens emitted per target pass
    c         cost ratio: one draft forward / one target forward, 1 token per row on a KV cache at the same batch
              size and context, timed directly on the engine's own models (``measure_forward_ms``)
    E         (1 - alpha_hat^(G+1)) / (1 - alpha_hat): the expected tokens per step
    bound     E / (1 + G c): the speedup an engine with no overhead and a free verification width would reach
    bound_v   E / (v + G c), v = t_target(G+1 tokens) / t_target(1 token): the same, charging the measured cost of
              verifying G+1 tokens in one pass (on CPU it is not free)

Tokens/s of a batch-1 run is max_tokens / the wall time of one ``generate`` call (prefill included), median over
prompts; batched runs report total tokens / wall time. Every greedy run is compared token by token with the
no-speculation run at the same batch size: a difference is a correctness canary and is flagged in the table.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import math
import os
import platform
import pstats
import shutil
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

PROMPT_LEN = 96
BATCHED = (4, 16)


@dataclass
class Prompt:
    name: str
    ids: list[int]


@dataclass
class Run:
    """One timed configuration (ours in some mode, or an HF peer) in one round of the round robin."""

    name: str
    kind: str  # "ours" | "hf"
    batch: int
    round: str  # "modes" (ours at batch 1), "peers" (ours against HF, batch 1), "batch" (ours, batch > 1)
    gamma: float | None = None  # depth per step (mean for adaptive); None without speculation
    nodes: int | None = None  # T of the verified tree (gamma + 1 for a chain)
    gamma_cap: int | None = None  # fixed depth, for counting the positions a step tried
    ref: Run | None = None  # ours without speculation in the same round: speedups are paired with it
    tokens_per_s: list[float] = field(default_factory=list)  # one sample per group of prompts, in round order
    prompt_idx: list[int] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list)
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    tried: int = 0
    generated: int = 0
    hist: list[int] = field(default_factory=list)  # [k] = steps that accepted k drafts
    canary: str = ""
    derived: dict = field(default_factory=dict)

    @property
    def median(self) -> float:
        return statistics.median(self.tokens_per_s) if self.tokens_per_s else float("nan")

    def quantiles(self) -> tuple[float, float]:
        xs = self.tokens_per_s
        if len(xs) < 5:
            return min(xs, default=float("nan")), max(xs, default=float("nan"))
        q = statistics.quantiles(xs, n=5)
        return q[0], q[3]

    def summary(self) -> dict:
        p20, p80 = self.quantiles()
        return {
            "name": self.name, "kind": self.kind, "batch": self.batch, "round": self.round, "gamma": self.gamma,
            "tokens_per_s": self.median, "tokens_per_s_p20": p20, "tokens_per_s_p80": p80,
            "samples": self.tokens_per_s, "num_steps": self.steps, "num_drafted": self.drafted,
            "num_accepted": self.accepted, "num_generated": self.generated, "accepted_length_hist": self.hist,
            "canary": self.canary, **self.derived,
        }  # fmt: skip


def paired_ratio(a: Run, b: Run) -> float | None:
    """Median over groups of a's tok/s / b's tok/s, both timed back to back in the same round."""
    ratios = [x / y for x, y in zip(a.tokens_per_s, b.tokens_per_s) if y > 0]
    return statistics.median(ratios) if ratios else None


# --- prompts ------------------------------------------------------------------------------------------------------


def _evenly(items: list, n: int) -> list:
    if len(items) <= n:
        return list(items)
    return [items[(2 * i + 1) * len(items) // (2 * n)] for i in range(n)]


def _code_files(num_held: int, num_numpy: int) -> list[tuple[str, str]]:
    """(name, text): evenly spaced held-out stdlib files of the zoo's split, then numpy's own sources."""
    from spec_engine.zoo.train import corpus_files

    _, held = corpus_files()
    held = [p for p in held if p.stat().st_size > 6000]
    files = [(f"stdlib:{p.name}", p.read_text(encoding="utf-8", errors="replace")) for p in _evenly(held, num_held)]
    try:
        import numpy

        root = Path(numpy.__file__).parent
        cands = sorted(p for p in root.rglob("*.py") if "tests" not in p.parts and p.stat().st_size > 8000)
        files += [(f"numpy:{p.relative_to(root)}", p.read_text(encoding="utf-8")) for p in _evenly(cands, num_numpy)]
    except ImportError:
        pass
    return files


def build_prompts(llm, num_held: int, num_numpy: int, length: int = PROMPT_LEN) -> tuple[list[Prompt], str]:
    """Fixed slices of ``length`` tokens starting a third of the way into each file (past license headers)."""
    vocab = llm.target.config.vocab_size
    prompts = []
    for name, text in _code_files(num_held, num_numpy):
        ids = llm.encode(text) if llm.tokenizer is not None else [b % vocab for b in text.encode()]
        start = len(ids) // 3
        prompts.append(Prompt(name, ids[start : start + length]))
    return prompts, "tokenizer" if llm.tokenizer is not None else "utf-8 bytes mod vocab (no tokenizer.json)"


# --- timing our engine --------------------------------------------------------------------------------------------


def _params(max_tokens: int):
    from spec_engine import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def _absorb(run: Run, outs) -> None:
    for o in outs:
        m = o.metrics
        run.outputs.append(list(o.outputs[0].token_ids))
        run.steps += m["num_steps"]
        run.drafted += m["num_drafted"]
        run.accepted += m["num_accepted"]
        run.generated += len(o.outputs[0].token_ids)
        hist = m["accepted_length_hist"]
        run.hist += [0] * (len(hist) - len(run.hist))
        for k, n in enumerate(hist):
            run.hist[k] += n
            run.tried += n * (k if run.gamma_cap is not None and k >= run.gamma_cap else k + 1)
    if run.drafted:
        run.gamma = run.gamma_cap or run.drafted / run.steps


def _hf_load(model_dir: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # like ignore_eos: every run emits exactly max_tokens
    model.generation_config.pad_token_id = 0
    return model


@dataclass
class Contender:
    """A run and what generates for it: our ``LLM``, or an HF model with its ``generate`` keyword arguments."""

    run: Run
    llm: object
    hf_kwargs: dict | None = None

    def _generate(self, group: list[Prompt], max_tokens: int) -> list:
        if self.hf_kwargs is None:
            return self.llm.generate([{"prompt_token_ids": p.ids} for p in group], _params(max_tokens), use_tqdm=False)
        (p,) = group  # HF runs at batch 1 only
        x = torch.tensor([p.ids])
        with torch.inference_mode():
            out = self.llm.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens,
                                    min_new_tokens=max_tokens, do_sample=False, **self.hf_kwargs)  # fmt: skip
        return [out[0, len(p.ids) :].tolist()]

    def warm(self, group: list[Prompt]) -> None:
        self._generate([Prompt(p.name, p.ids[:32]) for p in group], 8)

    def time(self, group: list[Prompt], idx: list[int], max_tokens: int, record: bool) -> float:
        """Tokens/s of one ``generate`` on the group; ``record`` keeps its tokens and metrics."""
        t0 = time.perf_counter()
        outs = self._generate(group, max_tokens)
        elapsed = time.perf_counter() - t0
        r = self.run
        if self.hf_kwargs is None:
            num_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            if record:
                _absorb(r, outs)
        else:
            num_tokens = sum(len(t) for t in outs)
            if record:
                r.outputs += outs
                r.generated += num_tokens
        if record:
            r.prompt_idx += idx
        return num_tokens / elapsed


def round_robin(contenders: list[Contender], groups: list[tuple[list[int], list[Prompt]]], max_tokens: int,
                bar: tqdm, repeats: int = 1) -> None:  # fmt: skip
    """Time every contender on every group, back to back, rotating who goes first; keep each pair's best of
    ``repeats`` passes.

    The machine is shared, so its load drifts and spikes: timing each group under all contenders within seconds of
    each other, dividing pairwise, and keeping the fastest pass (interference only ever adds time) cancels most of
    what timing mode after mode would bake into the speedups.
    """
    for c in contenders:
        c.warm(groups[0][1])
    best = [[0.0] * len(groups) for _ in contenders]
    for rep in range(repeats):
        for i, (idx, group) in enumerate(groups):
            k = (i + rep) % len(contenders)
            for j in list(range(k, len(contenders))) + list(range(k)):
                c = contenders[j]
                bar.set_postfix_str(f"{c.run.name} B={c.run.batch}")
                best[j][i] = max(best[j][i], c.time(group, idx, max_tokens, record=rep == 0))
                bar.update()
    for c, tps in zip(contenders, best):
        c.run.tokens_per_s = tps


# --- the cost ratio c ---------------------------------------------------------------------------------------------


def forward_step(model, kv, batch: int, ctx: int, T: int):
    """A callable running ``model`` + its logits on T new tokens per row over a ``ctx``-token cached prefix (a draft
    with a reduced vocabulary: its K rows).

    The engine's own forward on its own paged cache (contents are irrelevant to the time), distinct blocks per row
    where the cache has them.
    """
    from spec_engine.tree import causal_mask
    from spec_kernels import linear

    block_size, num_blocks, dev = kv.data.shape[3], kv.data.shape[2], kv.data.device
    per_row = -(-(ctx + T) // block_size)
    table = (torch.arange(batch * per_row) % (num_blocks - 1) + 1).view(batch, per_row).int().to(dev)  # [B, W]
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model.config.vocab_size, (batch, T), generator=gen).to(dev)  # [B, T]
    seqlens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)  # [B]
    positions = ctx + torch.arange(T, device=dev).expand(batch, T)  # [B, T]
    mask = causal_mask(batch, T, dev)

    @torch.inference_mode()
    def once():
        hidden = model(tokens, positions, kv.data, seqlens, mask, table)  # [B, T, H]
        if model.vocab_map is None:
            model.logits(hidden)
        else:  # a draft's reduced vocabulary: its K rows, as a drafted level computes them (no scatter to V)
            linear(hidden, model.head_weight)
        if dev.type == "cuda":
            torch.cuda.synchronize()  # time the work, not its launch

    return once


def time_interleaved(fns: dict, reps: int) -> dict:
    """{name: median ms} of each callable over ``reps`` rounds; a round calls every one once, back to back, so load
    drift hits all alike. One warm-up call each first."""
    times = {k: [] for k in fns}
    for fn in fns.values():
        fn()
    for _ in range(reps):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(1e3 * (time.perf_counter() - t0))
    return {k: statistics.median(v) for k, v in times.items()}


def measure_costs(llm, batches: list[int], ctx: int, sizes: list[int], reps: int) -> dict:
    """{batch: {"target_ms": {T: ms}, "draft_ms": ms, "c": ratio}} for every verified tree size T in ``sizes``.

    Medians of ``reps`` rounds; each round times every forward once, back to back, so load drift hits all alike.
    """
    eng = llm.engine
    out = {}
    for B in batches:
        fns = {T: forward_step(eng.target, eng.kv, B, ctx, T) for T in sorted({1, *sizes})}
        fns["draft"] = forward_step(eng.drafter.model, eng.drafter.kv, B, ctx, 1)
        ms = time_interleaved(fns, reps)
        draft = ms.pop("draft")
        out[B] = {"target_ms": ms, "draft_ms": draft, "c": draft / ms[1]}
    return out


def expected_tokens(alpha: float, gamma: float) -> float:
    if alpha >= 1.0:
        return gamma + 1
    return (1 - alpha ** (gamma + 1)) / (1 - alpha)


# --- profile of one speculative step ------------------------------------------------------------------------------


@contextmanager
def _patched(obj, name: str, wrapper):
    if not hasattr(obj, name):  # the engine moved on: time what is still there
        yield
        return
    own = name in vars(obj)
    orig = getattr(obj, name)
    setattr(obj, name, wrapper(orig))
    try:
        yield
    finally:
        if own:
            setattr(obj, name, orig)
        else:
            delattr(obj, name)


def profile_steps(llm, prompts: list[Prompt], max_tokens: int) -> dict:
    """Wall time per step of each stage of ``Engine._spec_step`` (timers around the calls), plus torch.profiler's
    top aten ops and cProfile's top Python functions for the same generate, all at batch ``len(prompts)``."""
    import spec_engine.engine as engine_mod
    from spec_engine.drafters import draft_model as draft_mod
    from spec_engine.drafters.draft_model import DraftModelDrafter

    eng = llm.engine
    timers: dict[str, float] = {}
    calls: dict[str, int] = {}

    def timed(label):
        def wrap(fn):
            def inner(*a, **k):
                t0 = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    timers[label] = timers.get(label, 0.0) + time.perf_counter() - t0
                    calls[label] = calls.get(label, 0) + 1

            return inner

        return wrap

    patches = [
        (eng, "_decode", "Engine._decode (whole step)"),
        (eng, "_propose", "Engine._propose (drafting, whole)"),
        (eng, "_block_table", "Engine._block_table"),
        (eng, "_emit", "Engine._emit"),
        (eng, "_prefill", "Engine._prefill (prompt, amortised over the steps)"),
        (eng.target, "forward", "target forward (LlamaForCausalLM.forward)"),
        (eng.target, "logits", "target logits (lm_head)"),
        (engine_mod, "verify_tree", "verify_tree"),
        (engine_mod, "compact_kv_", "compact_kv_ (target)"),
        (eng, "_step_inputs", "Engine._step_inputs (host rows -> device)"),
        (eng, "_read_step", "Engine._read_step (the one host read)"),
    ]
    if eng.drafter is not None:
        patches.append((eng.drafter, "propose", "drafter.propose (whole)"))
        patches.append((eng.drafter, "commit", "drafter.commit (whole)"))
        if isinstance(eng.drafter, DraftModelDrafter):
            patches += [
                (eng.drafter, "_catch_up", "draft _catch_up"),
                (eng.drafter.model, "forward", "draft forward (LlamaForCausalLM.forward)"),
                (eng.drafter.model, "logits", "draft logits (lm_head)"),
                (eng.drafter, "_draw_children", "draft _draw_children (topk)"),
                (eng.drafter, "_tree_shape", "draft _tree_shape"),
                (draft_mod, "compact_kv_", "compact_kv_ (draft)"),
            ]
    req = [{"prompt_token_ids": p.ids} for p in prompts]
    llm.generate(req, _params(16), use_tqdm=False)
    stack = []
    try:
        for obj, name, label in patches:
            cm = _patched(obj, name, timed(label))
            cm.__enter__()
            stack.append(cm)
        llm.generate(req, _params(max_tokens), use_tqdm=False)
    finally:
        for cm in reversed(stack):
            cm.__exit__(None, None, None)
    num_steps = calls["Engine._decode (whole step)"]
    stages = {k: 1e3 * v / num_steps for k, v in sorted(timers.items(), key=lambda kv: -kv[1])}
    B = len(prompts)

    from torch.profiler import ProfilerActivity, profile

    before = eng.stats["num_steps"]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        llm.generate(req, _params(max_tokens), use_tqdm=False)
    n = (eng.stats["num_steps"] - before) / B  # row-steps / rows: about the engine steps
    ops = [
        {"op": e.key, "self_ms_per_step": e.self_cpu_time_total / 1e3 / n, "calls_per_step": e.count / n}
        for e in sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:15]
    ]

    pr = cProfile.Profile()
    before = eng.stats["num_steps"]
    pr.enable()
    llm.generate(req, _params(max_tokens), use_tqdm=False)
    pr.disable()
    n = (eng.stats["num_steps"] - before) / B
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(20)
    return {"batch": B, "num_steps": num_steps, "stage_ms_per_step": stages, "torch_ops": ops, "cprofile_steps": n,
            "cprofile_top_tottime": buf.getvalue()}  # fmt: skip


# --- the useless draft ----------------------------------------------------------------------------------------------


def make_useless_draft(draft_dir: str, out_dir: Path) -> str:
    """A random-init model of the draft's config and vocab (the tokenizer copied so the pair still matches)."""
    from spec_engine.models import LlamaForCausalLM, ModelConfig, save_model

    cfg = json.loads((Path(draft_dir) / "config.json").read_text())
    torch.manual_seed(1234)
    model = LlamaForCausalLM(ModelConfig.from_dir(draft_dir))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.02)
    save_model(model, cfg, out_dir, dtype=torch.float32)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (Path(draft_dir) / name).is_file():
            shutil.copy(Path(draft_dir) / name, out_dir / name)
    return str(out_dir)


# --- the plan -------------------------------------------------------------------------------------------------------


def adaptive_supported(draft_dir: str) -> tuple[bool, str]:
    from spec_engine.llm import _parse_speculative_config

    try:
        _parse_speculative_config({"method": "draft_model", "model": draft_dir, "num_speculative_tokens": "auto"})
    except (ValueError, TypeError) as e:
        return False, f"adaptive skipped: the engine does not accept num_speculative_tokens='auto' yet ({e})"
    return True, ""


def _chain(draft: str, g: int) -> dict:
    return {"method": "draft_model", "model": draft, "num_speculative_tokens": g}


def _tree_nodes(tree: list[int]) -> int:
    return 1 + sum(math.prod(tree[: d + 1]) for d in range(len(tree)))


def _tree_name(tree: list[int]) -> str:
    return "tree[" + ",".join(map(str, tree)) + "]"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="specdec bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="target HF directory (default: the embedded default target)")
    ap.add_argument("--draft", help="draft HF directory (default: the embedded default draft)")
    ap.add_argument("--quick", action="store_true", help="a subset that runs in a few minutes")
    ap.add_argument("--max-tokens", type=int, default=None, help="tokens per request (default 128, quick 64)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    ap.add_argument("--out", default="bench/out", help="directory for e2e.json and the PNGs")
    ap.add_argument("--gammas", default=None, help="chain depths, e.g. 1,2,4 (default 1..8, quick 2,4,6)")
    ap.add_argument("--repeats", type=int, default=None, help="passes per prompt, fastest kept (default 2, quick 1)")
    ap.add_argument("--no-hf", action="store_true", help="skip the HF transformers peers")
    ap.add_argument("--no-profile", action="store_true", help="skip the profile of one speculative step")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    if argv and argv[0] == "--":  # ``specdec bench -- --quick`` passes the separator through
        argv = argv[1:]
    return ap.parse_args(argv)


# --- report -----------------------------------------------------------------------------------------------------------


def _fmt(x, spec: str = ".2f", none: str = "-") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return none
    return format(x, spec)


def derive(runs: list[Run], costs: dict) -> None:
    """Fill speedup, alpha, tau, c, E, bound, measured/bound for every run; speedups pair it with ``run.ref``."""
    for r in runs:
        d = r.derived
        d["speedup"] = paired_ratio(r, r.ref) if r.ref else None
        if not r.steps:
            continue
        d["tau"] = r.generated / r.steps
        d["step_ms"] = 1e3 * r.batch * d["tau"] / r.median if r.median else None  # B * tau tokens per step
        cost = costs.get(r.batch)
        if cost and (r.name == "none" or r.name.startswith(("chain", "useless_chain"))):
            # what the models alone cost per step (draft: the catch-up forward plus gamma - 1 more); the rest of
            # the step is engine overhead: Python, verification, compaction, block tables
            T = r.nodes or 1
            d["model_ms"] = cost["target_ms"].get(T, float("nan")) + (r.gamma or 0) * cost["draft_ms"]
            d["overhead_ms"] = d["step_ms"] - d["model_ms"]
        if not r.drafted:
            continue
        d["alpha"] = r.accepted / r.drafted
        if "adaptive" in r.name:
            continue  # the depth changes per step (0 included): E(alpha, gamma) and the bound do not apply
        d["alpha_hat"] = r.accepted / r.tried if r.tried else 0.0
        d["E"] = expected_tokens(d["alpha_hat"], r.gamma)
        cost = costs.get(r.batch)
        if cost is None:
            continue
        is_model = r.name.startswith(("chain", "tree", "useless"))
        c = cost["c"] if is_model else 0.0
        d["c"] = c
        d["bound"] = d["E"] / (1 + r.gamma * c)
        T = r.nodes if r.nodes in cost["target_ms"] else round(r.gamma) + 1
        T = min(cost["target_ms"], key=lambda t: abs(t - T))
        v = cost["target_ms"][T] / cost["target_ms"][1]
        d["verify_ratio"] = v
        d["bound_v"] = d["E"] / (v + r.gamma * c)
        d["measured_over_bound"] = d["speedup"] / d["bound"] if d["speedup"] else None


TABLE_COLUMNS = [  # (header, width, value of a run, format)
    ("mode", 22, lambda r: r.name, "<"),
    ("round", 5, lambda r: r.round, "<"),
    ("B", 2, lambda r: r.batch, ">"),
    ("gamma", 5, lambda r: r.gamma, ".1f"),
    ("tok/s", 8, lambda r: r.median, ".1f"),
    ("p20-p80", 11, lambda r: "{:.0f}-{:.0f}".format(*r.quantiles()), ">"),
    ("speedup", 7, lambda r: r.derived.get("speedup"), ".2f"),
    ("alpha", 5, lambda r: r.derived.get("alpha"), ".2f"),
    ("tau", 5, lambda r: r.derived.get("tau"), ".2f"),
    ("c", 5, lambda r: r.derived.get("c"), ".3f"),
    ("E", 5, lambda r: r.derived.get("E"), ".2f"),
    ("bound", 5, lambda r: r.derived.get("bound"), ".2f"),
    ("meas/bd", 7, lambda r: r.derived.get("measured_over_bound"), ".2f"),
    ("bound_v", 7, lambda r: r.derived.get("bound_v"), ".2f"),
    ("step ms", 7, lambda r: r.derived.get("step_ms"), ".1f"),
    ("model", 6, lambda r: r.derived.get("model_ms"), ".1f"),
    ("other", 6, lambda r: r.derived.get("overhead_ms"), ".1f"),
    ("canary", 0, lambda r: r.canary, "<"),
]


def table(runs: list[Run]) -> str:
    """One line per run; ``model`` is what the forwards alone cost per step, ``other`` the rest of the step."""

    def cell(value, width: int, spec: str) -> str:
        if spec in "<>":
            return format(str(value), f"{spec}{width}")
        return format(_fmt(value, spec), f">{width}")

    head = " ".join(format(h, f"{'<' if i in (0, len(TABLE_COLUMNS) - 1) else '>'}{w}")
                    for i, (h, w, _, _) in enumerate(TABLE_COLUMNS))  # fmt: skip
    lines = [head, "-" * len(head)]
    lines += [" ".join(cell(get(r), w, spec) for _, w, get, spec in TABLE_COLUMNS) for r in runs]
    return "\n".join(lines)


def markdown_table(runs: list[Run]) -> str:
    """The table as GitHub markdown, for bench/RESULTS.md."""

    def cell(value, spec: str) -> str:
        return str(value) if spec in "<>" else _fmt(value, spec)

    head = [h for h, *_ in TABLE_COLUMNS]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    lines += ["| " + " | ".join(cell(get(r), spec) for _, _, get, spec in TABLE_COLUMNS) + " |" for r in runs]
    return "\n".join(lines)


def goals(runs: list[Run], useless_note: str, big_batch: int) -> list[dict]:
    modes = [r for r in runs if r.round == "modes" and r.drafted and not r.name.startswith("useless")]
    best = max(modes, key=lambda r: r.derived.get("speedup") or 0, default=None)
    chains = [r for r in modes if r.name.startswith("chain")]
    best_chain = max(chains, key=lambda r: r.derived.get("speedup") or 0, default=None)
    peers = [r for r in runs if r.round == "peers"]
    hf_assisted = next((r for r in peers if r.name.startswith("hf_assisted")), None)
    ours_peers = [r for r in peers if r.kind == "ours" and r.name != "none"]
    best_peer = max(ours_peers, key=lambda r: r.median, default=None)
    same = hf_assisted and next((r for r in ours_peers if r.name == f"chain{hf_assisted.gamma}"), None)
    useless = next((r for r in runs if r.name == "useless_adaptive"), None)
    useless_kind = "adaptive"
    if useless is None:
        useless = next((r for r in runs if r.name.startswith("useless_chain")), None)
        useless_kind = "static chain (adaptive unavailable)"
    big = [r for r in runs if r.round == "batch" and r.batch == big_batch and r.drafted]
    best_big = max(big, key=lambda r: r.derived.get("speedup") or 0, default=None)
    rows = []

    def add(goal, target, value, detail):
        rows.append({"goal": goal, "target": target, "value": value,
                     "met": None if value is None else value >= target, "detail": detail})  # fmt: skip

    add("spec vs our no-spec, batch 1 greedy", 2.5, best and best.derived.get("speedup"), best and best.name)
    detail = hf_assisted and best_peer and f"{best_peer.name} vs {hf_assisted.name}, paired per prompt"
    if same:
        detail += f"; same draft and gamma: {same.name} {paired_ratio(same, hf_assisted):.2f}x"
    add("ours vs HF assisted (tok/s)", 3.0, best_peer and hf_assisted and paired_ratio(best_peer, hf_assisted),
        detail or "HF peers not run")  # fmt: skip
    add("measured / bound (best chain, batch 1)", 0.9, best_chain and best_chain.derived.get("measured_over_bound"),
        best_chain and best_chain.name)  # fmt: skip
    add(f"useless draft ({useless_kind}) vs no-spec", 0.95, useless and useless.derived.get("speedup"),
        useless.name if useless else useless_note)  # fmt: skip
    add(f"batch {big_batch}: best spec vs no-spec", 1.0, best_big and best_big.derived.get("speedup"),
        best_big and best_big.name)  # fmt: skip
    return rows


def plots(runs: list[Run], out: Path, title: str) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[bench] matplotlib missing (pip install 'specdec[bench]'): no plots")
        return []
    files = []
    ours1 = [r for r in runs if r.round == "modes"]
    chains = sorted((r for r in ours1 if r.name.startswith("chain")), key=lambda r: r.gamma)
    fig, ax = plt.subplots(figsize=(8, 5))
    if chains:
        g = [r.gamma for r in chains]
        ax.plot(g, [r.derived.get("speedup") for r in chains], "o-", label="measured: draft chain", lw=2)
        ax.plot(g, [r.derived.get("bound") for r in chains], "s--", label="bound E/(1+γc)")
        ax.plot(g, [r.derived.get("bound_v") for r in chains], "^:", label="bound with measured verify cost E/(v+γc)")
    for marker, color, prefix, label in (("D", "tab:purple", "tree", "static trees"),
                                         ("P", "tab:red", "hf_assisted", "HF assisted (same draft)"),
                                         ("X", "tab:gray", "useless_chain", "useless draft chain")):  # fmt: skip
        sel = [r for r in runs if r.name.startswith(prefix) and r.batch == 1 and r.gamma]
        if sel:
            ax.scatter([r.gamma for r in sel], [r.derived.get("speedup") for r in sel], marker=marker, s=70,
                       color=color, label=label, zorder=3)  # fmt: skip
            for r in sel:
                ax.annotate(r.name, (r.gamma, r.derived.get("speedup")), fontsize=7, xytext=(4, 4),
                            textcoords="offset points")  # fmt: skip
    for name, style in (("ngram", "g-."), ("adaptive", "m-."), ("hf_greedy", "k:")):
        r = next((r for r in ours1 + [r for r in runs if r.kind == "hf"] if r.name == name), None)
        if r and r.derived.get("speedup"):
            ax.axhline(r.derived["speedup"], color=style[0], ls=style[1:], lw=1, label=f"{name} (any γ)")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_xlabel("γ (draft depth)")
    ax.set_ylabel("speedup over our no-speculation, batch 1")
    ax.set_title(f"Speedup vs γ — {title}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / "e2e_speedup_vs_gamma.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    files.append(str(path))

    show = [r for r in ours1 if r.hist]
    best_chain = max((r for r in show if r.name.startswith("chain")), key=lambda r: r.median, default=None)
    best_tree = max((r for r in show if r.name.startswith("tree")), key=lambda r: r.median, default=None)
    picks = [r for r in (best_chain, best_tree) if r] + [r for r in show if r.name in ("ngram", "adaptive")]
    if picks:
        fig, ax = plt.subplots(figsize=(8, 4.5))
        K = max(len(r.hist) for r in picks)
        width = 0.8 / len(picks)
        for i, r in enumerate(picks):
            total = sum(r.hist)
            ax.bar([k + i * width for k in range(len(r.hist))], [n / total for n in r.hist], width,
                   label=f"{r.name} (τ={r.derived.get('tau', 0):.2f})")  # fmt: skip
        ax.set_xticks([k + 0.4 - width / 2 for k in range(K)], [str(k) for k in range(K)])
        ax.set_xlabel("drafted tokens accepted in one step")
        ax.set_ylabel("fraction of steps")
        ax.set_title(f"Accepted lengths, batch 1 — {title}", fontsize=10)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3, axis="y")
        fig.tight_layout()
        path = out / "e2e_accepted_hist.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        files.append(str(path))
    return files


def _canary(run: Run, batch1: Run | None) -> None:
    """Greedy tokens must equal ours without speculation: the same round's reference, and batch 1's for batch > 1."""
    if run.ref is run:
        if batch1 is None or run is batch1:
            run.canary = "ref"
            return
        by_idx = dict(zip(batch1.prompt_idx, batch1.outputs))
        same = sum(by_idx.get(i) == o for i, o in zip(run.prompt_idx, run.outputs))
        run.canary = f"ref; {same}/{len(run.outputs)} equal to batch 1" + (
            "" if same == len(run.outputs) else " MISMATCH"
        )
        return
    if run.ref is None:
        return
    bad = [i for i, (a, b) in enumerate(zip(run.outputs, run.ref.outputs)) if a != b]
    if not bad:
        run.canary = "ok" if run.kind == "ours" else "same tokens"
        return
    a, b = run.outputs[bad[0]], run.ref.outputs[bad[0]]
    pos = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    word = "MISMATCH" if run.kind == "ours" else "differs (float order)"
    run.canary = f"{word} {len(bad)}/{len(run.outputs)} (first: prompt {run.prompt_idx[bad[0]]} at token {pos})"


# --- main -----------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from spec_engine import LLM, default_model_paths

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.model:
        target_dir, draft_dir = args.model, args.draft
    else:
        target_dir, default_draft = default_model_paths()
        draft_dir = args.draft or default_draft
    if not draft_dir:
        print("error: --model needs --draft", file=sys.stderr)
        return 2
    quick = args.quick
    max_tokens = args.max_tokens or (64 if quick else 128)
    repeats = args.repeats or (1 if quick else 2)
    gammas = [int(g) for g in args.gammas.split(",")] if args.gammas else ([2, 4, 6] if quick else list(range(1, 9)))
    trees = [[2, 2, 1]] if quick else [[2, 2, 1], [3, 2, 1, 1]]
    ngram_gamma = 4
    num_held, num_numpy = (3, 1) if quick else (12, 4)
    batches = [4] if quick else list(BATCHED)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    max_len = PROMPT_LEN + max_tokens + 80
    kw = dict(dtype=args.dtype, device=args.device, max_model_len=max_len, max_num_seqs=max(batches))
    notes: list[str] = []

    def llm_for(spec):
        return LLM(target_dir, speculative_config=spec, **kw)

    base_llm = llm_for(None)
    prompts, encoding = build_prompts(base_llm, num_held, num_numpy)
    ok_adaptive, why = adaptive_supported(draft_dir)
    if not ok_adaptive:
        notes.append(why)
    tmp = Path(tempfile.mkdtemp(prefix="specdec_useless_"))
    useless_dir = make_useless_draft(draft_dir, tmp / "draft")

    plan: list[tuple[str, dict | None, int | None]] = [("none", None, None)]
    plan += [(f"chain{g}", _chain(draft_dir, g), g) for g in gammas]
    plan += [(_tree_name(t), {**_chain(draft_dir, len(t)), "tree": t}, len(t)) for t in trees]
    plan.append(("ngram", {"method": "ngram", "num_speculative_tokens": ngram_gamma}, ngram_gamma))
    if ok_adaptive:
        plan.append(("adaptive", {**_chain(draft_dir, 1), "num_speculative_tokens": "auto"}, None))
        plan.append(("useless_adaptive", {**_chain(useless_dir, 1), "num_speculative_tokens": "auto"}, None))
    plan.append(("useless_chain4", _chain(useless_dir, 4), 4))
    hf_ok = not args.no_hf
    if hf_ok:
        try:
            import transformers  # noqa: F401
        except ImportError:
            hf_ok = False
            notes.append("HF peers skipped: transformers is not installed (pip install 'specdec[test]')")
    else:
        notes.append("HF peers skipped (--no-hf)")

    def groups_of(B: int, min_groups: int) -> list[tuple[list[int], list[Prompt]]]:
        idx = [i % len(prompts) for i in range(max(B, len(prompts)))]
        groups = [(idx[i : i + B], [prompts[j] for j in idx[i : i + B]]) for i in range(0, len(idx) - B + 1, B)]
        return groups * -(-min_groups // len(groups))

    batch_contenders = 2 + ok_adaptive + (1 if min(gammas) > 2 or 2 in gammas else 0)
    total = len(plan) * len(prompts) + (6 * len(prompts) if hf_ok else 0)
    total = repeats * (total + sum(batch_contenders * len(groups_of(B, 2)) for B in batches))
    bar = tqdm(total=total, desc="bench", unit="run", dynamic_ncols=True)
    t_start = time.perf_counter()

    # Round 1, "modes": every mode of ours at batch 1.
    llms, runs, costs = {}, [], {}
    for name, spec, gamma in plan:
        bar.set_postfix_str(f"load {name}")
        llms[name] = base_llm if spec is None else llm_for(spec)
        nodes = llms[name].engine.max_tree_nodes() if gamma else None
        runs.append(Run(name, "ours", 1, "modes", gamma=gamma, nodes=nodes, gamma_cap=gamma))
    none1 = runs[0]
    for r in runs:
        r.ref = none1
    bar.set_postfix_str("cost ratio c")
    sizes = [g + 1 for g in gammas] + [_tree_nodes(t) for t in trees]
    costs = measure_costs(llms[f"chain{gammas[0]}"], [1] + batches, PROMPT_LEN + max_tokens // 2, sizes,
                          10 if quick else 30)  # fmt: skip
    round_robin([Contender(r, llms[r.name]) for r in runs], groups_of(1, 1), max_tokens, bar, repeats)
    derive(runs, costs)
    chains1 = [r for r in runs if r.name.startswith("chain")]
    best_gamma = round(max(chains1, key=lambda r: r.derived["speedup"]).gamma)
    keep = {"none", f"chain{best_gamma}", "chain2", "ngram", "adaptive"}
    for name in [n for n in llms if n not in keep]:
        del llms[name]
    if "chain2" not in llms and 2 in gammas:
        llms["chain2"] = llm_for(_chain(draft_dir, 2))

    # Round 2, "peers": ours against HF transformers on the same weights, paired per prompt.
    if hf_ok:
        hf_target, hf_draft = _hf_load(target_dir), _hf_load(draft_dir)
        hf_draft.generation_config.num_assistant_tokens = best_gamma
        hf_draft.generation_config.num_assistant_tokens_schedule = "constant"
        hf_draft.generation_config.assistant_confidence_threshold = 0.0  # never stop a draft early: the same γ
        none_p = Run("none", "ours", 1, "peers")
        ours = [none_p, Run(f"chain{best_gamma}", "ours", 1, "peers", gamma_cap=best_gamma),
                Run("ngram", "ours", 1, "peers", gamma_cap=ngram_gamma)]  # fmt: skip
        contenders = [Contender(r, llms[r.name]) for r in ours]
        for name, g, kw_hf in (
            ("hf_greedy", None, {}),
            (f"hf_assisted_g{best_gamma}", best_gamma, {"assistant_model": hf_draft}),
            (f"hf_prompt_lookup_g{ngram_gamma}", ngram_gamma, {"prompt_lookup_num_tokens": ngram_gamma}),
        ):
            contenders.append(Contender(Run(name, "hf", 1, "peers", gamma=g), hf_target, kw_hf))
        for c in contenders:
            c.run.ref = none_p
        round_robin(contenders, groups_of(1, 1), max_tokens, bar, repeats)
        runs += [c.run for c in contenders]
        del hf_target, hf_draft, contenders

    # Round 3, "batch": throughput at batch 4 and 16.
    batch_modes = ["none", f"chain{best_gamma}"] + (["chain2"] if "chain2" in llms and best_gamma != 2 else [])
    batch_modes += ["adaptive"] if ok_adaptive else []
    for B in batches:
        rs = [Run(n, "ours", B, "batch", gamma_cap=int(n[5:]) if n.startswith("chain") else None) for n in batch_modes]
        for r in rs:
            r.nodes = llms[r.name].engine.max_tree_nodes() if r.gamma_cap else None
            r.ref = rs[0]
        round_robin([Contender(r, llms[r.name]) for r in rs], groups_of(B, 2), max_tokens, bar, repeats)
        runs += rs
    bar.close()

    profiles = {}
    if not args.no_profile:
        targets = [(f"chain{best_gamma}", 1)] + ([("chain2", max(batches))] if "chain2" in llms else [])
        for name, B in targets:
            print(f"[bench] profiling {name} at batch {B}")
            profiles[f"{name} B={B}"] = profile_steps(llms[name], [prompts[i % len(prompts)] for i in range(B)],
                                                      max_tokens)  # fmt: skip
    llms.clear()
    shutil.rmtree(tmp, ignore_errors=True)

    for r in runs:
        _canary(r, none1)
    derive(runs, costs)
    order = {"modes": 0, "peers": 1, "batch": 2}
    runs.sort(key=lambda r: (order[r.round], r.batch, r.kind != "ours", r.name != "none", r.name))

    title = f"{Path(target_dir).name}+{Path(draft_dir).name}, {platform.node()}, {torch.get_num_threads()} threads"
    text = table(runs)
    print()
    print(text)
    print(f"\nc (direct forward timing, 1 token/row, ctx {PROMPT_LEN + max_tokens // 2}):")
    for B, cst in costs.items():
        tms = " ".join(f"T{T}={ms:.2f}" for T, ms in cst["target_ms"].items())
        print(f"  B={B:>2}: draft {cst['draft_ms']:.2f} ms, target {tms} ms, c={cst['c']:.3f}")
    goal_rows = goals(runs, why, max(batches))
    print("\ngoals:")
    for g in goal_rows:
        met = {True: "MET", False: "NOT MET", None: "n/a"}[g["met"]]
        print(f"  {g['goal']:<45} target >= {g['target']:<4} value {_fmt(g['value'])}  {met}  ({g['detail']})")
    for key, prof in profiles.items():
        print(f"\nprofile of {key} (ms per engine step, {prof['num_steps']} steps):")
        for k, ms in prof["stage_ms_per_step"].items():
            print(f"  {ms:8.3f}  {k}")
        print("  top aten ops (self ms per step):")
        for o in prof["torch_ops"][:10]:
            print(f"  {o['self_ms_per_step']:8.3f}  {o['op']} (x{o['calls_per_step']:.1f})")
    if profiles:
        (out / "e2e_profile.txt").write_text(
            "".join(f"=== {k}\n{p['cprofile_top_tottime']}\n" for k, p in profiles.items())
        )
    for n in notes:
        print(f"note: {n}")
    pngs = plots(runs, out, title)
    report = {
        "machine": platform.node(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "loadavg_at_end": os.getloadavg(),
        "command": " ".join(["specdec bench"] + (argv if argv is not None else sys.argv[1:])),
        "target": str(target_dir),
        "draft": str(draft_dir),
        "dtype": args.dtype,
        "max_tokens": max_tokens,
        "repeats": repeats,
        "prompt_len": PROMPT_LEN,
        "prompts": [p.name for p in prompts],
        "prompt_encoding": encoding,
        "c_method": "direct timing of the engine's models (forward + logits), 1 token/row on the paged KV cache, "
        "same batch and context, interleaved medians",
        "costs": {str(B): c for B, c in costs.items()},
        "runs": [r.summary() for r in runs],
        "goals": goal_rows,
        "profiles": profiles,
        "notes": notes,
        "wall_s": time.perf_counter() - t_start,
        "plots": pngs,
        "table": text,
    }
    (out / "e2e_table.md").write_text(markdown_table(runs) + "\n")
    (out / "e2e.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    print(f"\nsaved {out / 'e2e.json'} and {', '.join(pngs) or 'no plots'} in {report['wall_s']:.0f}s")
    return 1 if any("MISMATCH" in r.canary for r in runs if r.kind == "ours") else 0
