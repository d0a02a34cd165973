"""Benchmark of spec_kernels.quant_linear (GGUF blocks multiplied as stored) against bfloat16 ``linear`` on the same
matrices dequantized, and against the reference (dequantize in torch, then F.linear).

Shapes are SmolLM2-135M's: per layer the fused qkv [960, 576], o [576, 576], fused gate_up [3072, 576] and down
[576, 1536] in Q4_1, and the tied lm_head [49152, 576] in Q8_0, at M = 1 (decode) and 2, 4, 8, 16 (verify). A
*matrix* row times one matrix alone, warm (the small ones stay in L2/L3 between calls). A *forward* row times a whole
forward's matmuls back to back, 30 layers' own weights plus the lm_head (96 MB of blocks, 270 MB in bfloat16: both
stream from DRAM, as decoding does); the roofline column is GB/s of weight bytes read. Contenders are interleaved rep
by rep so a noisy shared machine hits them alike.

Usage: python -m bench.bench_quant_linear [--quick] [--threads N] [--cpu-time]. Results go to
bench/out/bench_quant_linear.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from spec_kernels.linear import linear
from spec_kernels.quant_linear import quant_linear
from spec_kernels.quant_linear.ref import quant_linear_ref
from spec_kernels.types import QUANT_BLOCK, QUANT_BLOCK_BYTES, dequantize_ref

HIDDEN, INTER, LAYERS, VOCAB = 576, 1536, 30, 49152
LAYER = [("qkv", 960, HIDDEN), ("o", HIDDEN, HIDDEN), ("gate_up", 2 * INTER, HIDDEN), ("down", HIDDEN, INTER)]
LAYER_QTYPE, HEAD_QTYPE = "Q4_1", "Q8_0"


def _blocks(n: int, k: int, qtype: str, rng: np.random.Generator) -> torch.Tensor:
    """Random GGUF blocks [N, K / 32 * bytes] with scales ~ 1/(8 sqrt K) (gguf's quantizer is too slow for 96 MB)."""
    num = n * k // QUANT_BLOCK
    raw = rng.integers(0, 256, size=(num, QUANT_BLOCK_BYTES[qtype]), dtype=np.uint8)
    raw[:, 0:2] = np.full((num, 1), 1 / (8 * k**0.5), dtype=np.float16).view(np.uint8)
    if qtype == "Q4_1":
        raw[:, 2:4] = np.full((num, 1), -1 / k**0.5, dtype=np.float16).view(np.uint8)
    return torch.from_numpy(raw.reshape(n, -1))


CLOCK = time.perf_counter  # --cpu-time: time.thread_time


def _time(fns: dict, reps: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():
        fn()
    for _ in range(reps):
        for k, fn in fns.items():
            start = CLOCK()
            fn()
            times[k].append(CLOCK() - start)
    return times


def _summary(times: list[float], nbytes: int) -> dict[str, float]:
    q = statistics.quantiles(times, n=10) if len(times) > 1 else [times[0]] * 9
    median = statistics.median(times)
    return {"median_us": median * 1e6, "p20_us": q[1] * 1e6, "p80_us": q[7] * 1e6, "gbps": nbytes / median / 1e9}


def _line(label: str, results: dict[str, dict[str, float]]) -> str:
    parts = [f"{k} {r['median_us']:8.1f} us [{r['p20_us']:7.1f}-{r['p80_us']:7.1f}] {r['gbps']:5.1f} GB/s"
             for k, r in results.items()]  # fmt: skip
    return f"{label} | " + " | ".join(parts)


def bench_matrices(rows: list[int], reps: int, rng: np.random.Generator) -> list[dict]:
    out = []
    for name, n, k in [*LAYER, ("lm_head", VOCAB, HIDDEN)]:
        qtype = HEAD_QTYPE if name == "lm_head" else LAYER_QTYPE
        blocks = _blocks(n, k, qtype, rng)
        w16 = dequantize_ref(blocks, qtype).bfloat16()  # [N, K]
        for num_rows in rows:
            x = torch.randn(num_rows, k).bfloat16()  # [M, K]
            fns = {
                "quant": lambda x=x, b=blocks, q=qtype: quant_linear(x, b, q, backend="native"),
                "bf16": lambda x=x, w=w16: linear(x, w, backend="native"),
            }
            times = _time(fns, reps)
            if num_rows == 1:  # the reference dequantizes the whole matrix per call: one size says enough
                times["ref"] = _time({"ref": lambda x=x, b=blocks, q=qtype: quant_linear_ref(x, b, q)}, 3)["ref"]
            nbytes = {"quant": blocks.numel(), "bf16": w16.numel() * 2, "ref": blocks.numel()}
            results = {c: _summary(t, nbytes[c]) for c, t in times.items()}
            print(_line(f"{name:7s} {qtype} [{n:5d}, {k:4d}] M={num_rows:2d}", results), flush=True)
            out.append({"matrix": name, "qtype": qtype, "N": n, "K": k, "M": num_rows}
                       | {f"{c}_{m}": v for c, r in results.items() for m, v in r.items()})  # fmt: skip
    return out


def bench_forwards(rows: list[int], reps: int, rng: np.random.Generator) -> list[dict]:
    weights = [(_blocks(n, k, LAYER_QTYPE, rng), LAYER_QTYPE) for _ in range(LAYERS) for _, n, k in LAYER]
    weights.append((_blocks(VOCAB, HIDDEN, HEAD_QTYPE, rng), HEAD_QTYPE))
    dense = [dequantize_ref(b, q).bfloat16() for b, q in weights]
    quant_bytes = sum(b.numel() for b, _ in weights)
    dense_bytes = sum(w.numel() * 2 for w in dense)
    out = []
    for num_rows in rows:
        xs = {k: torch.randn(num_rows, k).bfloat16() for k in (HIDDEN, INTER)}

        def quant(xs=xs):
            for b, q in weights:
                quant_linear(xs[b.shape[1] // QUANT_BLOCK_BYTES[q] * QUANT_BLOCK], b, q, backend="native")

        def bf16(xs=xs):
            for w in dense:
                linear(xs[w.shape[1]], w, backend="native")

        times = _time({"quant": quant, "bf16": bf16}, reps)
        results = {"quant": _summary(times["quant"], quant_bytes), "bf16": _summary(times["bf16"], dense_bytes)}
        sizes = f"{quant_bytes / 1e6:.0f} / {dense_bytes / 1e6:.0f} MB"
        label = f"forward ({len(weights)} matmuls, {sizes}) M={num_rows:2d}"
        print(_line(label, results), flush=True)
        out.append({"forward": len(weights), "quant_MB": quant_bytes / 1e6, "bf16_MB": dense_bytes / 1e6,
                    "M": num_rows} | {f"{c}_{m}": v for c, r in results.items() for m, v in r.items()})  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (about a minute)")
    parser.add_argument("--threads", type=int, default=None, help="torch/OpenMP threads (default: torch's)")
    parser.add_argument("--cpu-time", action="store_true",
                        help="time calls by this thread's CPU time (one thread): on a loaded machine wall-clock counts "
                        "other processes' time slices")  # fmt: skip
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.cpu_time:
        if torch.get_num_threads() != 1:
            parser.error("--cpu-time measures one thread: pass --threads 1")
        global CLOCK
        CLOCK = time.thread_time
    rng = np.random.default_rng(0)
    rows = [1, 2, 4, 8, 16]
    load_before = os.getloadavg()
    forwards = bench_forwards(rows, 5 if args.quick else 20, rng)
    matrices = bench_matrices(rows, 20 if args.quick else 100, rng)
    out = Path(__file__).resolve().parent / "out" / "bench_quant_linear.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "machine": platform.node(),
        "processor": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "clock": "thread CPU time" if args.cpu_time else "wall",
        "loadavg_before_after": [load_before, os.getloadavg()],
        "note": "wall-clock on a shared machine: other processes add noise; compare the interleaved pairs",
    }
    out.write_text(json.dumps({"meta": meta, "forwards": forwards, "matrices": matrices}, indent=2))
    print(f"saved {out}")


if __name__ == "__main__":
    main()
