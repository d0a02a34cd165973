"""Benchmark of spec_kernels.linear (native small-M CPU kernel) against F.linear, same dtype, same inputs.

Shapes are the default pair's matrices at M = 1 (decode) and M = 4, 8, 16 (verify): the target (hidden 320,
intermediate 864, 5 q heads / 1 kv head of dim 64, vocab 4096) and the draft (hidden 192, intermediate 512, 3 q heads).
Each matrix alone is timed warm (its weight stays in L2/L3 between calls); the roofline column is GB/s of weight bytes
streamed. A *forward* times all of one forward's matmuls back to back, every layer with its own weights, as a model
runs them: 8 x (qkv, o, gate_up, down) + lm_head = 33 fused matmuls, or 8 x (q, k, v, o, gate, up, down) + lm_head = 57
unfused. The two contenders are interleaved rep by rep so a noisy shared machine hits both alike.

The machine is shared: medians carry other processes' noise, p20 is closer to the quiet figure. With two threads on a
loaded machine, whole stretches of forwards wait a scheduler slice per call for the second thread (both contenders;
see spec_kernels/linear/cpu.py): --threads 1 gives the steadier comparison.

Usage: python bench/bench_linear.py [--quick] [--threads N]. Results go to bench/out/bench_linear.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from spec_kernels.linear import linear

HEAD_DIM = 64


def _matrices(
    hidden: int, inter: int, q_heads: int, kv_heads: int, vocab: int, fused: bool
) -> list[tuple[str, int, int]]:
    """One layer's matmuls as (name, N, K), then the lm_head: weight [N, K]."""
    q, kv = q_heads * HEAD_DIM, kv_heads * HEAD_DIM
    if fused:
        layer = [("qkv", q + 2 * kv, hidden), ("o", hidden, q), ("gate_up", 2 * inter, hidden), ("down", hidden, inter)]
    else:
        layer = [("q", q, hidden), ("k", kv, hidden), ("v", kv, hidden), ("o", hidden, q)]
        layer += [("gate", inter, hidden), ("up", inter, hidden), ("down", hidden, inter)]
    return layer + [("lm_head", vocab, hidden)]


MODELS = {  # name: (hidden, intermediate, q heads, kv heads, vocab, layers)
    "target": (320, 864, 5, 1, 4096, 8),
    "draft": (192, 512, 3, 1, 4096, 2),
}
CONTENDERS = {  # backend=None: the call a model makes, which takes the native kernel at these shapes (checked in main)
    "native": linear,
    "torch": F.linear,
}


def _time(fns: dict, reps: int) -> dict[str, list[float]]:
    """Wall-clock seconds per call of each function, interleaved rep by rep."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():
        fn()
        fn()
    for _ in range(reps):
        for k, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - start)
    return times


def _summary(times: list[float], nbytes: int) -> dict[str, float]:
    q = statistics.quantiles(times, n=10)
    median = statistics.median(times)
    return {"median_us": median * 1e6, "p20_us": q[1] * 1e6, "p80_us": q[7] * 1e6, "gbps": nbytes / median / 1e9}


def _line(label: str, results: dict[str, dict[str, float]]) -> str:
    parts = [
        f"{k} {r['median_us']:8.1f} us [{r['p20_us']:7.1f}-{r['p80_us']:7.1f}] {r['gbps']:5.1f} GB/s"
        for k, r in results.items()
    ]
    speedup = results["torch"]["median_us"] / results["native"]["median_us"]
    return f"{label} | " + " | ".join(parts) + f" | torch/native {speedup:4.2f}x"


def bench_matrices(dtypes: list[torch.dtype], rows: list[int], reps: int) -> list[dict]:
    out = []
    gen = torch.Generator().manual_seed(0)
    for model, (hidden, inter, q_heads, kv_heads, vocab, _) in MODELS.items():
        names = {}
        for fused in (True, False):
            names.update({(n, k): name for name, n, k in _matrices(hidden, inter, q_heads, kv_heads, vocab, fused)})
        for (n, k), name in names.items():
            for dtype in dtypes:
                w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)  # [N, K]
                for num_rows in rows:
                    x = torch.randn(num_rows, k, generator=gen).to(dtype)  # [M, K]
                    fns = {c: (lambda f=f, x=x, w=w: f(x, w)) for c, f in CONTENDERS.items()}
                    nbytes = w.numel() * w.element_size()
                    results = {c: _summary(t, nbytes) for c, t in _time(fns, reps).items()}
                    dt = str(dtype).removeprefix("torch.")
                    label = f"{model:6s} {name:7s} [{n:4d}, {k:3d}] {dt:8s} M={num_rows:2d}"
                    print(_line(label, results), flush=True)
                    row = {"model": model, "matrix": name, "N": n, "K": k, "dtype": dt, "M": num_rows}
                    out.append(row | {f"{c}_{m}": v for c, r in results.items() for m, v in r.items()})
    return out


def bench_forwards(dtypes: list[torch.dtype], rows: list[int], reps: int) -> list[dict]:
    out = []
    gen = torch.Generator().manual_seed(1)
    for model, (hidden, inter, q_heads, kv_heads, vocab, layers) in MODELS.items():
        for fused in (True, False):
            mats = _matrices(hidden, inter, q_heads, kv_heads, vocab, fused)
            per_layer, lm_head = mats[:-1], mats[-1]
            for dtype in dtypes:
                weights = [(torch.randn(n, k, generator=gen) / k**0.5).to(dtype) for _ in range(layers)
                           for _, n, k in per_layer]  # fmt: skip
                weights.append((torch.randn(lm_head[1], lm_head[2], generator=gen) / hidden**0.5).to(dtype))
                nbytes = sum(w.numel() * w.element_size() for w in weights)
                for num_rows in rows:
                    xs = {k: torch.randn(num_rows, k, generator=gen).to(dtype) for _, _, k in mats}  # [M, K] per K

                    def forward(f, weights=weights, xs=xs):
                        for w in weights:
                            f(xs[w.shape[1]], w)

                    fns = {c: (lambda f=f: forward(f)) for c, f in CONTENDERS.items()}
                    results = {c: _summary(t, nbytes) for c, t in _time(fns, reps).items()}
                    dt = str(dtype).removeprefix("torch.")
                    kind = "fused" if fused else "unfused"
                    size = f"({len(weights):2d} matmuls, {nbytes / 1e6:4.1f} MB)"
                    label = f"{model:6s} forward {kind:7s} {size} {dt:8s} M={num_rows:2d}"
                    print(_line(label, results), flush=True)
                    row = {"model": model, "forward": kind, "num_matmuls": len(weights), "weight_MB": nbytes / 1e6}
                    row |= {"dtype": dt, "M": num_rows}
                    out.append(row | {f"{c}_{m}": v for c, r in results.items() for m, v in r.items()})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (a minute or less)")
    parser.add_argument("--threads", type=int, default=None, help="torch/OpenMP threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    linear(torch.zeros(1, 8), torch.zeros(8, 8), backend="native")  # compile/load the extension outside the timing
    probe = torch.randn(16, 320), torch.randn(448, 320)
    assert torch.equal(linear(*probe), linear(*probe, backend="native")), "backend=None no longer picks the kernel"
    dtypes, rows = [torch.float32, torch.bfloat16], [1, 4, 8, 16]
    load_before = os.getloadavg()
    forwards = bench_forwards(dtypes, rows, reps=15 if args.quick else 50)
    matrices = bench_matrices(dtypes, rows, reps=30 if args.quick else 200)
    out = Path(__file__).resolve().parent / "out" / "bench_linear.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "machine": platform.node(),
        "processor": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "loadavg_before_after": [load_before, os.getloadavg()],
        "note": "wall-clock on a shared machine: other processes add noise; compare the interleaved pairs",
    }
    out.write_text(json.dumps({"meta": meta, "forwards": forwards, "matrices": matrices}, indent=2))
    print(f"saved {out}")


if __name__ == "__main__":
    main()
