"""The benchmark harness: prompts, timed runs of our engine and of HF peers, the cost ratio c, a step's profile.

Shared by the bench scripts (``bench_e2e.py`` owns the end-to-end plan; ``bench_eagle.py``, ``bench_step.py``,
``bench_tp.py`` and ``bench_coupling.py`` reuse its pieces). It is tooling, not part of the shipped package: it
imports cProfile, torch.profiler and HF transformers, and wraps engine internals to time them.

The glossary of its columns (alpha, alpha_hat, tau, c, E, bound, bound_v) is in ``bench_e2e.py``'s docstring.
"""

from __future__ import annotations

import cProfile
import io
import json
import platform
import pstats
import shutil
import statistics
import sys
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
    # ... generation alone (from the prompt's last prefill chunk to the last token: what speculation can speed up);
    # ours only
    decode_tokens_per_s: list[float] = field(default_factory=list)
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


def paired_ratio(a: Run, b: Run, decode: bool = False) -> float | None:
    """Median over groups of a's tok/s / b's tok/s, both timed back to back in the same round (``decode``: of their
    generation alone, prompt processing left out)."""
    xs, ys = (a.decode_tokens_per_s, b.decode_tokens_per_s) if decode else (a.tokens_per_s, b.tokens_per_s)
    ratios = [x / y for x, y in zip(xs, ys) if y > 0]
    return statistics.median(ratios) if ratios else None


# --- prompts ------------------------------------------------------------------------------------------------------


def _evenly(items: list, n: int) -> list:
    if len(items) <= n:
        return list(items)
    return [items[(2 * i + 1) * len(items) // (2 * n)] for i in range(n)]


def _code_files(num_held: int, num_numpy: int) -> list[tuple[str, str]]:
    """(name, text): evenly spaced held-out stdlib files of the zoo's split, then numpy's own sources."""
    from spec_engine.training.train import corpus_files

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


def hf_load(model_dir: str):
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

    def time(self, group: list[Prompt], idx: list[int], max_tokens: int, record: bool) -> tuple[float, float]:
        """(tokens/s, tokens/s of generation alone: 0 for HF) of one ``generate`` on the group; ``record`` keeps its
        tokens and metrics. Generation spans the longest of the group's decodes (at batch 1, the request's)."""
        t0 = time.perf_counter()
        outs = self._generate(group, max_tokens)
        elapsed = time.perf_counter() - t0
        r = self.run
        decode_rate = 0.0
        if self.hf_kwargs is None:
            counts = [len(o.outputs[0].token_ids) for o in outs]
            num_tokens = sum(counts)
            spans = [
                n / o.metrics["decode_tokens_per_s"] for n, o in zip(counts, outs) if o.metrics["decode_tokens_per_s"]
            ]
            decode_rate = num_tokens / max(spans) if spans else 0.0
            if record:
                _absorb(r, outs)
        else:
            num_tokens = sum(len(t) for t in outs)
            if record:
                r.outputs += outs
                r.generated += num_tokens
        if record:
            r.prompt_idx += idx
        return num_tokens / elapsed, decode_rate


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
    best = [[(0.0, 0.0)] * len(groups) for _ in contenders]  # [contender][group]: (tokens/s, decode tokens/s)
    for rep in range(repeats):
        for i, (idx, group) in enumerate(groups):
            k = (i + rep) % len(contenders)
            for j in list(range(k, len(contenders))) + list(range(k)):
                c = contenders[j]
                bar.set_postfix_str(f"{c.run.name} B={c.run.batch}")
                best[j][i] = max(best[j][i], c.time(group, idx, max_tokens, record=rep == 0))
                bar.update()
    for c, tps in zip(contenders, best):
        c.run.tokens_per_s = [t for t, _ in tps]
        c.run.decode_tokens_per_s = [d for _, d in tps] if all(d > 0 for _, d in tps) else []


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
    cache_seqlens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)  # [B]
    positions = ctx + torch.arange(T, device=dev).expand(batch, T)  # [B, T]
    mask = causal_mask(batch, T, dev)

    @torch.inference_mode()
    def once():
        hidden = model(tokens, positions, kv.data, cache_seqlens, mask, table)  # [B, T, H]
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
    """Wall time per step of each stage of ``StepRunner._spec_step`` (timers around the calls), plus torch.profiler's
    top aten ops and cProfile's top Python functions for the same generate, all at batch ``len(prompts)``."""
    import spec_engine.runner as runner_mod
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

    run = eng.runner
    patches = [
        (eng, "_decode", "Engine._decode (whole step)"),
        (run, "_propose", "StepRunner._propose (drafting, whole)"),
        (run, "block_table", "StepRunner.block_table"),
        (eng, "_apply", "Engine._apply (commit)"),
        (eng, "_prefill", "Engine._prefill (prompt, amortised over the steps)"),
        (eng.target, "forward", "target forward (LlamaForCausalLM.forward)"),
        (eng.target, "logits", "target logits (lm_head)"),
        (runner_mod, "verify_tree", "verify_tree"),
        (runner_mod, "tree_step", "tree_step (greedy trees: target pass, verify, compaction)"),
        (run, "step_inputs", "StepRunner.step_inputs (host rows -> device)"),
        (run, "_read_step", "StepRunner._read_step (the one host read)"),
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


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), the label every saved result carries."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def save_same_tokens(out: str | Path, payload: dict, rows: list[dict], name: str) -> int:
    """Write a benchmark's ``payload`` as JSON to ``out``; its exit status: 1 (said on stderr) where a row's tokens
    differ from plain decoding's (a row's ``same``: the greedy contract), else 0."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=2))
    if not all(r["same"] for r in rows):
        print(f"{name}: speculative decoding emitted other tokens than plain decoding", file=sys.stderr)
        return 1
    return 0
