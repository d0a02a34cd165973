"""End-to-end benchmark: our engine in every speculation mode, side by side with HF transformers on the same weights.

    python bench/bench_e2e.py [--quick] [--model DIR --draft DIR] [--max-tokens N] [--threads N] [--out DIR]
    python -m bench.bench_e2e [same flags]

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
import json
import math
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file: the repository root, not bench/, heads the import path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from bench.harness import (  # noqa: E402
    BATCHED,
    PROMPT_LEN,
    Contender,
    Prompt,
    Run,
    build_prompts,
    hf_load,
    make_useless_draft,
    measure_costs,
    profile_steps,
    round_robin,
)
from bench.report import canary, derive, fmt, goals, markdown_table, plots, table  # noqa: E402

# --- the plan -------------------------------------------------------------------------------------------------------


def adaptive_supported(draft_dir: str) -> tuple[bool, str]:
    from spec_engine.config import parse_speculative_config

    try:
        parse_speculative_config({"method": "draft_model", "model": draft_dir, "num_speculative_tokens": "auto"})
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
    ap = argparse.ArgumentParser(prog="python -m bench.bench_e2e", description=__doc__.split("\n\n")[0])
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
    return ap.parse_args(argv)


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
        hf_target, hf_draft = hf_load(target_dir), hf_load(draft_dir)
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
        canary(r, none1)
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
        print(f"  {g['goal']:<45} target >= {g['target']:<4} value {fmt(g['value'])}  {met}  ({g['detail']})")
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
        "command": " ".join(["python -m bench.bench_e2e"] + (argv if argv is not None else sys.argv[1:])),
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


if __name__ == "__main__":
    sys.exit(main())
