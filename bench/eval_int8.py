"""How far the 8-bit activation path (``quant_activations="int8"``) moves a model's logits from the float path on the
same GGUF weights: top-1 agreement (the fraction of positions whose argmax token is the same) and perplexity of
held-out text under each mode.

The text is held out for SmolLM2 in the sense that matters here (nothing is tuned on it): an English paragraph and
Python's own stdlib sources (their docstrings are prose), cut into windows of ``--window`` tokens, each one causal
prefill on an empty cache. Files: GGUF paths, e.g. SmolLM2-135M-Instruct requantized by llama-quantize
(``--allow-requantize``) to Q8_0, Q4_0, Q4_K_M (SmolLM2's 576-wide rows are not whole 256-weight super-blocks, so its
Q4_K_M holds Q4_K / Q6_K only in the 1536-wide down projections, Q5_0 / Q8_0 elsewhere) and Q6_K.

``--speed``: also each mode's forward time at T = 1, 4, 16 new tokens over a 256-token context (the engine's forward
and logits on its paged cache, ``bench.harness.forward_step``), modes interleaved rep by rep; r(T) = ms(T) / ms(1).

Usage: python bench/eval_int8.py FILE.gguf [FILE.gguf ...] [--dtype float32|bfloat16] [--windows 6] [--window 512]
[--control] [--speed]. Writes bench/out/eval_int8.json, labelled with the CPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import sysconfig
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from a checkout

from bench.harness import cpu_name  # noqa: E402
from spec_engine.llm import load_tokenizer  # noqa: E402
from spec_engine.models import load_model  # noqa: E402

PARAGRAPH = (
    "The lighthouse keeper climbed the spiral stairs every evening, counting the steps as his father had taught him. "
    "At the top he trimmed the wick, polished the great lens and watched the fishing boats come home through the "
    "fog. Most nights were quiet, but in winter the storms rolled in from the west, and then he stayed awake until "
    "dawn, listening to the wind and the waves breaking on the rocks below."
)
STDLIB_FILES = ("textwrap.py", "fractions.py", "heapq.py", "bisect.py", "calendar.py", "shlex.py")


def held_out_ids(tokenizer, window: int, windows: int) -> list[torch.Tensor]:
    """Token windows ``[1, window]`` (the paragraph's own window is shorter): the paragraph, then stdlib files'."""
    out = [torch.tensor([tokenizer.encode(PARAGRAPH).ids])]
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in STDLIB_FILES:
        ids = tokenizer.encode((stdlib / name).read_text(encoding="utf-8")).ids
        out += [torch.tensor([ids[i : i + window]]) for i in range(0, len(ids) - window + 1, window)][:2]
        if len(out) > windows:
            break
    return out[: windows + 1]


def logits_of(model, ids: torch.Tensor) -> torch.Tensor:
    """Float32 logits ``[T, V]`` of one causal prefill of ``ids [1, T]`` on an empty contiguous cache."""
    cfg, T = model.config, ids.shape[1]
    cache = torch.zeros(cfg.num_hidden_layers, 2, 1, T, cfg.num_key_value_heads, cfg.head_dim,
                        dtype=model.model.norm.weight.dtype)  # fmt: skip
    mask = torch.ones(T, T, dtype=torch.bool).tril()[None]  # [1, T, T]
    hidden = model(ids, torch.arange(T)[None], cache, torch.zeros(1, dtype=torch.int32), mask)
    return model.logits(hidden)[0].float()


def evaluate(path: str, dtype: torch.dtype, windows: list[torch.Tensor], control: bool) -> dict:
    """The two modes' agreement and perplexities; ``control``: also the float path in ``dtype`` against float32 (how
    much a dtype alone moves the top-1, for scale)."""
    models = {
        m: load_model(path, dtype=dtype, quantization="gguf", quant_activations=m).fuse() for m in ("float", "int8")
    }
    if control:
        models["float32"] = load_model(path, dtype=torch.float32, quantization="gguf").fuse()
    nll = {m: 0.0 for m in models}
    agree = agree_control = total = 0
    max_diff = 0.0
    for ids in windows:
        logits = {m: logits_of(model, ids) for m, model in models.items()}  # [T, V] each
        targets = ids[0, 1:]
        for m, lg in logits.items():
            nll[m] += torch.nn.functional.cross_entropy(lg[:-1], targets, reduction="sum").item()
        agree += (logits["float"].argmax(-1) == logits["int8"].argmax(-1)).sum().item()
        if control:
            agree_control += (logits["float"].argmax(-1) == logits["float32"].argmax(-1)).sum().item()
        total += ids.shape[1]
        max_diff = max(max_diff, (logits["float"] - logits["int8"]).abs().max().item())
    predicted = sum(ids.shape[1] - 1 for ids in windows)
    types = sorted({w.qtype for w in models["int8"].quantized.values()})
    return {"file": Path(path).name, "types": types, "positions": total, "top1_agreement": agree / total,
            "ppl_float": torch.tensor(nll["float"] / predicted).exp().item(),
            "ppl_int8": torch.tensor(nll["int8"] / predicted).exp().item(), "max_abs_logit_diff": max_diff,
            "control_top1_float_vs_float32": agree_control / total if control else None}  # fmt: skip


def forward_times(path: str, dtype: str, reps: int = 7) -> dict:
    """Median ms per forward at T = 1, 4, 16 over a 256-token context, per mode, interleaved."""
    import statistics
    import time

    from bench.harness import forward_step
    from spec_engine.llm import LLM

    fns = {}
    for mode in ("float", "int8"):
        eng = LLM(model=path, dtype=dtype, quantization="gguf", quant_activations=mode, max_num_seqs=1,
                  max_model_len=512).engine  # fmt: skip
        fns |= {(mode, t): forward_step(eng.target, eng.kv, 1, 256, t) for t in (1, 4, 16)}
    times: dict = {k: [] for k in fns}
    for fn in fns.values():
        fn()
    for _ in range(reps):
        for k, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[k].append(1e3 * (time.perf_counter() - start))
    return {f"{mode}_T{t}_ms": statistics.median(v) for (mode, t), v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", help="GGUF files (one model, several quantizations)")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--windows", type=int, default=6, help="stdlib windows, after the paragraph")
    ap.add_argument("--window", type=int, default=512, help="tokens per window")
    ap.add_argument("--control", action="store_true", help="also the float path's top-1 agreement with float32")
    ap.add_argument("--speed", action="store_true", help="also each mode's forward ms at T = 1, 4, 16")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    windows = held_out_ids(load_tokenizer(args.files[0]), args.window, args.windows)
    rows = []
    print(f"| file | types | positions | top-1 agreement | ppl float | ppl int8 | max abs logit diff |  ({cpu_name()},"
          f" {args.dtype})")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for path in args.files:
        r = evaluate(path, dtype, windows, args.control)
        print(f"| {r['file']} | {', '.join(r['types'])} | {r['positions']} | {r['top1_agreement']:.4f} | "
              f"{r['ppl_float']:.3f} | {r['ppl_int8']:.3f} | {r['max_abs_logit_diff']:.3f} |"
              + (f" control: float vs float32 top-1 {r['control_top1_float_vs_float32']:.4f}" if args.control else ""),
              flush=True)  # fmt: skip
        if args.speed:
            r |= forward_times(path, args.dtype)
            print("  forward ms T=1/4/16: " + "; ".join(
                f"{m} {r[f'{m}_T1_ms']:.1f} / {r[f'{m}_T4_ms']:.1f} / {r[f'{m}_T16_ms']:.1f} (r(16) "
                f"{r[f'{m}_T16_ms'] / r[f'{m}_T1_ms']:.2f})" for m in ("float", "int8")), flush=True)  # fmt: skip
        rows.append(r)
    out = Path(__file__).resolve().parent / "out" / "eval_int8.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"cpu": cpu_name(), "dtype": args.dtype, "window": args.window, "windows": len(windows)}
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(f"saved {out}")


if __name__ == "__main__":
    main()
