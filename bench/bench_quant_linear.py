"""Benchmark of spec_kernels.quant_linear (GGUF blocks multiplied as stored) against bfloat16 ``linear`` on the same
matrices dequantized, and against the reference (dequantize in torch, then F.linear).

Shapes are SmolLM2-135M's by default: per layer the fused qkv [960, 576], o [576, 576], fused gate_up [3072, 576]
and down [576, 1536] in Q4_1, and the tied lm_head [49152, 576] in Q8_0, at M = 1 (decode) and 2, 4, 8, 16 (verify).
``--qtype`` / ``--head-qtype`` pick the layers' and the head's formats (any of ``QUANT_FORMATS``); the K-quants need
rows of whole 256-weight super-blocks, which SmolLM2's 576 are not: ``--shape llama-1b`` takes Llama-3.2-1B's
(hidden 2048, 16 layers). A *matrix* row times one matrix alone, warm (the small ones stay in L2/L3 between calls). A
*forward* row times a whole forward's matmuls back to back, every layer's own weights plus the lm_head (SmolLM2: 96 MB
of blocks, 270 MB in bfloat16: both stream from DRAM, as decoding does); the roofline column is GB/s of weight bytes
read. Contenders are interleaved rep by rep so a noisy shared machine hits them alike.

``--int8 Q8_0,Q4_K,Q6_K`` times only the two numeric modes against each other instead: float activations vs int8 ones
(``activations="int8"``), one [N, K] matrix per format (``--int8-shape``, default Llama-3.2-1B's gate/up rows: N =
8192, K = 2048) at M = 1, 5, 16, bfloat16 x, interleaved; results go to bench/out/bench_quant_linear_int8.json.

Usage: python -m bench.bench_quant_linear [--quick] [--threads N] [--cpu-time] [--qtype Q4_K] [--head-qtype Q6_K]
[--shape smollm2|llama-1b] [--int8 TYPES [--int8-shape N,K]]. Results go to bench/out/bench_quant_linear.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from a checkout

from bench.harness import cpu_name  # noqa: E402
from spec_kernels.linear import linear  # noqa: E402
from spec_kernels.quant_linear import quant_linear  # noqa: E402
from spec_kernels.quant_linear.ref import quant_linear_ref  # noqa: E402
from spec_kernels.types import QUANT_FORMATS, dequantize_ref, quant_row_bytes  # noqa: E402

# name -> (hidden, intermediate, layers, vocab, qkv rows)
SHAPES = {"smollm2": (576, 1536, 30, 49152, 960), "llama-1b": (2048, 8192, 16, 128256, 3072)}


def _layer(shape: str) -> list[tuple[str, int, int]]:
    hidden, inter, _, _, qkv = SHAPES[shape]
    return [("qkv", qkv, hidden), ("o", hidden, hidden), ("gate_up", 2 * inter, hidden), ("down", hidden, inter)]


def random_blocks(n: int, k: int, qtype: str, rng: np.random.Generator) -> torch.Tensor:
    """Random GGUF blocks [N, row_bytes] with fp16 scales ~ 1/(8 sqrt K) (gguf's quantizer is too slow for 96 MB and
    has none for the K-quants); a minimum (m, dmin) of -8 times that."""
    f = QUANT_FORMATS[qtype]
    num = n * k // f.block_weights
    raw = rng.integers(0, 256, size=(num, f.block_bytes), dtype=np.uint8)
    for i, off in enumerate(f.fp16_offsets):
        value = (1 if i == 0 else -8) / (8 * k**0.5 * f.block_weights / 32)
        raw[:, off : off + 2] = np.full((num, 1), value, dtype=np.float16).view(np.uint8)
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


def bench_matrices(rows: list[int], reps: int, rng: np.random.Generator, qtypes: tuple[str, str], shape: str):
    out = []
    hidden, vocab = SHAPES[shape][0], SHAPES[shape][3]
    for name, n, k in [*_layer(shape), ("lm_head", vocab, hidden)]:
        qtype = qtypes[1] if name == "lm_head" else qtypes[0]
        blocks = random_blocks(n, k, qtype, rng)
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


def bench_forwards(rows: list[int], reps: int, rng: np.random.Generator, qtypes: tuple[str, str], shape: str):
    hidden, inter, layers, vocab, _ = SHAPES[shape]
    weights = [(random_blocks(n, k, qtypes[0], rng), qtypes[0]) for _ in range(layers) for _, n, k in _layer(shape)]
    weights.append((random_blocks(vocab, hidden, qtypes[1], rng), qtypes[1]))
    dense = [dequantize_ref(b, q).bfloat16() for b, q in weights]
    width = {(q, quant_row_bytes(q, k)): k for q in qtypes for k in (hidden, inter)}  # a matrix's K by its row bytes
    quant_bytes = sum(b.numel() for b, _ in weights)
    dense_bytes = sum(w.numel() * 2 for w in dense)
    out = []
    for num_rows in rows:
        xs = {k: torch.randn(num_rows, k).bfloat16() for k in (hidden, inter)}

        def quant(xs=xs):
            for b, q in weights:
                quant_linear(xs[width[q, b.shape[1]]], b, q, backend="native")

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


def bench_int8(qtypes: list[str], reps: int, rng: np.random.Generator, n: int, k: int) -> list[dict]:
    """float vs int8 activations on one matrix per format, M = 1, 5, 16."""
    out = []
    for qtype in qtypes:
        blocks = random_blocks(n, k, qtype, rng)
        for num_rows in (1, 5, 16):
            x = torch.randn(num_rows, k).bfloat16()  # [M, K]
            fns = {mode: lambda x=x, b=blocks, q=qtype, mode=mode: quant_linear(x, b, q, activations=mode)
                   for mode in ("float", "int8")}  # fmt: skip
            results = {c: _summary(t, blocks.numel()) for c, t in _time(fns, reps).items()}
            speedup = results["float"]["median_us"] / results["int8"]["median_us"]
            print(_line(f"{qtype} [{n}, {k}] M={num_rows:2d} int8 {speedup:4.2f}x", results), flush=True)
            out.append({"qtype": qtype, "N": n, "K": k, "M": num_rows, "int8_speedup": speedup}
                       | {f"{c}_{m}": v for c, r in results.items() for m, v in r.items()})  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (about a minute)")
    parser.add_argument("--threads", type=int, default=None, help="torch/OpenMP threads (default: torch's)")
    parser.add_argument("--cpu-time", action="store_true",
                        help="time calls by this thread's CPU time (one thread): on a loaded machine wall-clock counts "
                        "other processes' time slices")  # fmt: skip
    parser.add_argument("--qtype", choices=list(QUANT_FORMATS), default="Q4_1", help="the layers' format")
    parser.add_argument("--head-qtype", choices=list(QUANT_FORMATS), default="Q8_0", help="the lm_head's format")
    parser.add_argument("--shape", choices=list(SHAPES), default="smollm2", help="the model's matrices")
    parser.add_argument("--int8", default=None, help="comma-separated formats: float vs int8 activations only")
    parser.add_argument("--int8-shape", default="8192,2048", help="N,K of --int8's matrix")
    args = parser.parse_args()
    hidden, inter = SHAPES[args.shape][:2]
    for q in (args.qtype, args.head_qtype):
        block = QUANT_FORMATS[q].block_weights
        if hidden % block or inter % block:
            parser.error(f"{q}'s {block}-weight blocks do not tile {args.shape}'s rows ({hidden}, {inter}): "
                         "pass --shape llama-1b")  # fmt: skip
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
    if args.int8:
        n, k = (int(v) for v in args.int8_shape.split(","))
        print(f"# {cpu_name()}, {torch.get_num_threads()} threads, load average {load_before[0]:.1f}", flush=True)
        rows_int8 = bench_int8(args.int8.split(","), 5 if args.quick else 30, rng, n, k)
        meta = {"cpu": cpu_name(), "threads": torch.get_num_threads(), "clock": "thread CPU time" if args.cpu_time
                else "wall", "loadavg_before_after": [load_before, os.getloadavg()]}  # fmt: skip
        out = Path(__file__).resolve().parent / "out" / "bench_quant_linear_int8.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"meta": meta, "rows": rows_int8}, indent=2))
        return print(f"saved {out}")
    qtypes = (args.qtype, args.head_qtype)
    forwards = bench_forwards(rows, 5 if args.quick else 20, rng, qtypes, args.shape)
    matrices = bench_matrices(rows, 20 if args.quick else 100, rng, qtypes, args.shape)
    out = Path(__file__).resolve().parent / "out" / "bench_quant_linear.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "machine": platform.node(),
        "processor": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "shape": args.shape,
        "qtypes": {"layers": args.qtype, "lm_head": args.head_qtype},
        "clock": "thread CPU time" if args.cpu_time else "wall",
        "loadavg_before_after": [load_before, os.getloadavg()],
        "note": "wall-clock on a shared machine: other processes add noise; compare the interleaved pairs",
    }
    out.write_text(json.dumps({"meta": meta, "forwards": forwards, "matrices": matrices}, indent=2))
    print(f"saved {out}")


if __name__ == "__main__":
    main()
