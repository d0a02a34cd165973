"""Benchmark of compact_kv_: bytes moved per second against a plain copy of the same bytes.

Realistic shapes: one call moves every plane of a 32-layer model (N = 2 x 32), Hkv * D = 1024 per row, B in {1, 16},
trees of T = 16 nodes with accepted paths of 3-8 tokens that overlap their destinations. Only rows that really move
count (a_t != t), read + written: that is the op's memory-bound floor, and the roofline is ``Tensor.copy_`` of exactly
those bytes (the "memcpy" column). The reference (compact_kv_ref) runs on the same inputs. On CPU every timed call
starts with a flushed last-level cache: a real model's K/V are far larger than it, and a warm 8 MB memcpy would
otherwise be compared with a cold scattered copy.

Usage: python bench/bench_compact_kv.py [--quick]. Results go to bench/out/compact_kv.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from spec_kernels.compact_kv import compact_kv_
from spec_kernels.compact_kv.ref import compact_kv_ref
from spec_kernels.types import PAD_NODE

NUM_PLANES = 2 * 32
ROW = (8, 128)  # Hkv, D: 1024 elements per row
NUM_NODES = 16


def _paths(batch: int, gen: torch.Generator, reverse: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Root-first paths of 3-8 nodes through a T-node tree, as sorted node lists (a_t >= t, so rows overlap)."""
    accepted = torch.full((batch, NUM_NODES), PAD_NODE, dtype=torch.int64)  # [B, T]
    num_accepted = torch.empty(batch, dtype=torch.int64)  # [B]
    for b in range(batch):
        length = int(torch.randint(3, 9, (1,), generator=gen))
        rest = torch.randperm(NUM_NODES - 1, generator=gen)[: length - 1].sort().values + 1
        if reverse:  # not a tree path: forces the staged (buffered) copy
            rest = rest.flip(0)
        accepted[b, :length] = torch.cat([torch.zeros(1, dtype=torch.int64), rest])
        num_accepted[b] = length
    return accepted, num_accepted


_SCRATCH = None
_WARM = False  # --warm: skip the flush (a small model whose cache fits in the LLC)


def _flush_caches() -> None:
    """Evict the last-level cache (32 MiB here) so every candidate starts cold, as the K/V of a real model would."""
    global _SCRATCH
    if _SCRATCH is None:
        _SCRATCH = torch.zeros(128 << 20, dtype=torch.uint8)
    _SCRATCH.add_(1)


def _time_cpu(fns: dict, reps: int) -> dict[str, list[float]]:
    """Wall-clock times, the candidates interleaved rep by rep so a noisy shared machine hits them all alike."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():
        fn()
    for _ in range(reps):
        for k, fn in fns.items():
            if not _WARM:
                _flush_caches()
            start = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - start)
    return times


def _time_cuda(fns: dict, reps: int) -> dict[str, list[float]]:
    from triton.testing import do_bench

    return {k: [m * 1e-3 for m in do_bench(fn, warmup=25, rep=100, return_mode="all")] for k, fn in fns.items()}


def _summary(times: list[float], nbytes: int) -> dict[str, float]:
    q = statistics.quantiles(times, n=10)
    median = statistics.median(times)
    return {"median_us": median * 1e6, "p20_us": q[1] * 1e6, "p80_us": q[7] * 1e6, "gbps": nbytes / median / 1e9}


def run(device: str, quick: bool) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    timer = _time_cuda if device == "cuda" else _time_cpu
    reps = 15 if quick else 50
    configs = [(b, dt, False) for dt in (torch.float16, torch.float32) for b in (1, 16)] + [(16, torch.float16, True)]
    if quick:
        configs = [(1, torch.float16, False), (16, torch.float16, False), (16, torch.float16, True)]
    rows = []
    for batch, dtype, reverse in configs:
        accepted, num_accepted = _paths(batch, gen, reverse)
        cache_seqlens = torch.randint(0, 32, (batch,), generator=gen, dtype=torch.int64).to(torch.int32)  # [B]
        capacity = 32 + NUM_NODES
        cache = torch.randn(NUM_PLANES, batch, capacity, *ROW, device=device).to(dtype)  # [N, B, S, Hkv, D]
        steps = torch.arange(NUM_NODES)
        moved = int(((accepted != steps) & (steps < num_accepted[:, None])).sum())
        row_bytes = ROW[0] * ROW[1] * cache.element_size()
        nbytes = 2 * moved * NUM_PLANES * row_bytes  # read + write of the rows that really move
        src = torch.randn(nbytes // 2 // cache.element_size(), device=device).to(dtype)
        dst = torch.empty_like(src)
        args = (cache, cache_seqlens.to(device), accepted.to(device), num_accepted.to(device))
        fns = {
            "native": lambda a=args: compact_kv_(*a),
            "ref": lambda a=args: compact_kv_ref(*a),
            "memcpy": lambda s=src, d=dst: d.copy_(s),
        }
        results = {k: _summary(t, nbytes) for k, t in timer(fns, reps).items()}
        row = {
            "device": device,
            "B": batch,
            "dtype": str(dtype).removeprefix("torch."),
            "path_order": "reversed (staged)" if reverse else "tree",
            "moved_rows": moved,
            "MB_moved": nbytes / 1e6,
            **{f"{k}_{m}": v for k, r in results.items() for m, v in r.items()},
        }
        row["native_vs_memcpy"] = row["native_gbps"] / row["memcpy_gbps"]
        rows.append(row)
        print(
            f"{device:4s} N={NUM_PLANES} B={batch:2d} {row['dtype']:8s} {row['path_order']:17s} "
            f"moved={nbytes / 1e6:6.2f} MB | "
            + " | ".join(
                f"{k} {results[k]['median_us']:8.1f} us [{results[k]['p20_us']:.0f}-{results[k]['p80_us']:.0f}] "
                f"{results[k]['gbps']:6.2f} GB/s"
                for k in ("native", "ref", "memcpy")
            )
            + f" | native/memcpy {row['native_vs_memcpy']:.0%}",
            flush=True,
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer configs and repetitions (a minute or less)")
    parser.add_argument("--threads", type=int, default=None, help="torch/OpenMP threads (default: torch's)")
    parser.add_argument("--warm", action="store_true", help="do not flush the CPU caches between timed calls")
    args = parser.parse_args()
    global _WARM
    _WARM = args.warm
    if args.threads:
        torch.set_num_threads(args.threads)
    from spec_kernels._ext import load_ext

    load_ext()  # compile outside the timed region
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    rows = [r for d in devices for r in run(d, args.quick)]
    out = Path(__file__).resolve().parent / "out" / "compact_kv.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "machine": platform.node(),
        "caches": "warm" if args.warm else "flushed before every call",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }
    out.write_text(json.dumps({"meta": meta, "results": rows}, indent=2))
    print(f"saved {out}")


if __name__ == "__main__":
    main()
