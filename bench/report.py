"""The end-to-end benchmark's report: derived columns, the table, the goals, the plots (matplotlib) and the
correctness canary."""

from __future__ import annotations

import math
from pathlib import Path

from bench.harness import Run, expected_tokens, paired_ratio

# --- report -----------------------------------------------------------------------------------------------------------


def fmt(x, spec: str = ".2f", none: str = "-") -> str:
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
        return format(fmt(value, spec), f">{width}")

    head = " ".join(format(h, f"{'<' if i in (0, len(TABLE_COLUMNS) - 1) else '>'}{w}")
                    for i, (h, w, _, _) in enumerate(TABLE_COLUMNS))  # fmt: skip
    lines = [head, "-" * len(head)]
    lines += [" ".join(cell(get(r), w, spec) for _, w, get, spec in TABLE_COLUMNS) for r in runs]
    return "\n".join(lines)


def markdown_table(runs: list[Run]) -> str:
    """The table as GitHub markdown, for bench/RESULTS.md."""

    def cell(value, spec: str) -> str:
        return str(value) if spec in "<>" else fmt(value, spec)

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


def canary(run: Run, batch1: Run | None) -> None:
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
