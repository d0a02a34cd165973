"""EAGLE head vs the draft model on the default target: alpha, tau, c and speedup at depths 1..8 and on trees.

    python bench/bench_eagle.py [--quick] [--head DIR] [--draft DIR] [--max-tokens N] [--threads N] [--out DIR]

Held-out code prompts (bench/harness.py's: stdlib files the zoo never trained on, and numpy's sources),
batch 1, greedy and temperature 0.8 (unseeded: rejection sampling). Every configuration is timed on each prompt back
to back with plain decoding (``round_robin``: the machine's load drift hits all alike); speedups are paired medians.

Columns (bench/harness.py's glossary): alpha accepted / drafted; tau tokens per target pass; c one drafter
step / one target step (1 token, same context: the draft model's forward, or the head's forward + its logits);
E (1 - alpha_hat^(G+1)) / (1 - alpha_hat) and bound E / (1 + G c), for chains. Greedy runs are checked token for
token against plain decoding (the canary column). Writes ``--out``/eagle.json with the machine's name.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import torch
from tqdm import tqdm

if __package__ in (None, ""):  # run as a file: the repository root, not bench/, heads the import path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import (  # noqa: E402
    PROMPT_LEN,
    Contender,
    Run,
    build_prompts,
    expected_tokens,
    forward_step,
    paired_ratio,
    round_robin,
    time_interleaved,
)
from spec_engine import LLM, SamplingParams, default_model_paths  # noqa: E402
from spec_engine.tree import causal_mask  # noqa: E402
from spec_engine.zoo import MODELS_DIR  # noqa: E402
from spec_kernels.decoder_layers import eagle3_draft  # noqa: E402

TEMPERATURES = (0.0, 0.8)


class SampledContender(Contender):
    """A contender whose requests sample at ``temperature`` (greedy at 0), with no seed."""

    def __init__(self, run: Run, llm, temperature: float):
        super().__init__(run, llm)
        self.temperature = temperature

    def _generate(self, group, max_tokens: int) -> list:
        params = SamplingParams(max_tokens=max_tokens, temperature=self.temperature, ignore_eos=True)
        return self.llm.generate([{"prompt_token_ids": p.ids} for p in group], params, use_tqdm=False)


def head_step(drafter, ctx: int):
    """A callable drafting one token as a depth-1 greedy step does on a ``ctx``-token cached prefix (batch 1): one
    head entry and its draft token (the native ``eagle3_draft`` call where the head has one), else the entry and
    its logits."""
    kv, dev = drafter.kv, drafter.device
    table = (torch.arange(-(-(ctx + 1) // kv.data.shape[3])) + 1).int()[None].to(dev)  # [1, W]
    tokens = torch.zeros(1, 1, dtype=torch.int64, device=dev)
    feats = torch.randn(1, 1, drafter.features.shape[-1], device=dev).to(drafter.features.dtype)
    cache_seqlens = torch.full((1,), ctx, dtype=torch.int32, device=dev)
    positions = torch.full((1, 1), ctx, device=dev)
    mask = causal_mask(1, 1, dev)
    native, root = drafter.model.native, torch.zeros(1, dtype=torch.int64, device=dev)

    @torch.inference_mode()
    def once():
        if native is not None:
            eagle3_draft(native, tokens, cache_seqlens, root, drafter.features, kv.data, gamma=1, block_table=table)
        else:
            drafter.model.logits(drafter.model(tokens, feats, positions, kv.data, cache_seqlens, mask, table))

    return once


def cost_ratios(llms: dict, ctx: int, reps: int) -> dict:
    """{"draft": c, "eagle": c}: medians of ``reps`` interleaved rounds of one step each."""
    any_llm = next(iter(llms.values()))
    fns = {"target": forward_step(any_llm.engine.target, any_llm.engine.kv, 1, ctx, 1)}
    for kind, llm in llms.items():
        d = llm.engine.drafter
        fns[kind] = head_step(d, ctx) if kind == "eagle" else forward_step(d.model, d.kv, 1, ctx, 1)
    ms = time_interleaved(fns, reps)
    target = ms.pop("target")
    return {k: v / target for k, v in ms.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--head", default=str(MODELS_DIR / "eagle"), help="EAGLE head directory")
    ap.add_argument("--draft", default=None, help="draft model directory (default: the embedded draft)")
    ap.add_argument("--quick", action="store_true", help="depths 1, 4; one tree; 4 prompts; greedy only")
    ap.add_argument("--max-tokens", type=int, default=None, help="tokens per request (default 128, quick 32)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default="bench/out")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    target, draft = default_model_paths()
    draft = args.draft or draft
    quick = args.quick
    max_tokens = args.max_tokens or (32 if quick else 128)
    gammas = [1, 4] if quick else list(range(1, 9))
    trees = [[2, 2, 1]] if quick else [[2, 2, 1], [3, 2, 1, 1], [4, 2, 2, 1, 1]]
    temperatures = TEMPERATURES[:1] if quick else TEMPERATURES
    kw = dict(max_model_len=PROMPT_LEN + max_tokens + 80)
    plain = LLM(target, **kw)
    prompts, _ = build_prompts(plain, *((3, 1) if quick else (12, 4)))
    plan = []
    for kind, model in (("draft", draft), ("eagle", args.head)):
        method = "draft_model" if kind == "draft" else "eagle"
        plan += [(f"{kind}-chain{g}", {"method": method, "model": model, "num_speculative_tokens": g}, g, None)
                 for g in gammas]  # fmt: skip
        plan += [(f"{kind}-tree{t}".replace(" ", ""), {"method": method, "model": model,
                                                       "num_speculative_tokens": len(t), "tree": t}, len(t), t)
                 for t in trees]  # fmt: skip
    llms = {name: LLM(target, speculative_config=spec, **kw) for name, spec, _, _ in plan}
    costs = cost_ratios({"draft": llms[plan[0][0]], "eagle": llms[f"eagle-chain{gammas[0]}"]},
                        PROMPT_LEN + max_tokens // 2, 10 if quick else 30)  # fmt: skip
    groups = [([i], [p]) for i, p in enumerate(prompts)]
    bar = tqdm(total=len(temperatures) * (len(plan) + 1) * len(groups), desc="bench_eagle", dynamic_ncols=True)
    rows = []
    for temp in temperatures:
        none = Run("none", "ours", 1, "modes")
        runs = [Run(name, "ours", 1, "modes", gamma=g, gamma_cap=g) for name, _, g, _ in plan]
        contenders = [SampledContender(none, plain, temp)]
        contenders += [SampledContender(r, llms[r.name], temp) for r in runs]
        round_robin(contenders, groups, max_tokens, bar)
        for r, (name, _, g, tree) in zip(runs, plan):
            kind = name.split("-")[0]
            alpha = r.accepted / r.drafted if r.drafted else 0.0
            alpha_hat = r.accepted / r.tried if r.tried else 0.0
            E = expected_tokens(alpha_hat, g)
            row = {"mode": name, "temperature": temp, "gamma": g, "tree": tree, "alpha": alpha,
                   "tau": r.generated / r.steps, "c": costs[kind], "speedup": paired_ratio(r, none),
                   "tokens_per_s": r.median, "plain_tokens_per_s": none.median,
                   "E": None if tree else E, "bound": None if tree else E / (1 + g * costs[kind]),
                   "canary": "" if temp or r.outputs == none.outputs else "DIFFERENT tokens"}  # fmt: skip
            rows.append(row)
    bar.close()
    head = f"{'mode':<24} {'T':>3} {'alpha':>5} {'tau':>5} {'c':>5} {'speedup':>7} {'bound':>5} {'tok/s':>7}"
    print(head)
    for r in rows:
        bound = f"{r['bound']:.2f}" if r["bound"] is not None else "-"
        speedup = f"{r['speedup']:.2f}" if r["speedup"] is not None else "-"
        print(f"{r['mode']:<24} {r['temperature']:>3} {r['alpha']:>5.2f} {r['tau']:>5.2f} {r['c']:>5.3f} "
              f"{speedup:>7} {bound:>5} {r['tokens_per_s']:>7.1f} {r['canary']}")  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"machine": platform.node(), "processor": platform.processor(), "threads": torch.get_num_threads(),
              "max_tokens": max_tokens, "prompts": [p.name for p in prompts], "rows": rows}  # fmt: skip
    (out / "eagle.json").write_text(json.dumps(result, indent=2) + "\n")
    return 1 if any(r["canary"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
