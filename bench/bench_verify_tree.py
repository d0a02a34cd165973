"""Benchmark verify_tree against one read of the logits (its memory-bound floor), for native, ref and Triton.

Each config: a chain of T nodes (the worst case: every node is visited) whose drafts the target likes (+8 on the
drafted token's logit), so most of the chain is accepted. Greedy and sampled with top-p. The floor is
``logits.amax(-1)``: one pass over B*T*V logits. GB/s counts B*T*V*itemsize bytes for every implementation.

    python bench/bench_verify_tree.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from functools import partial

import torch

from spec_kernels.reference import verify_tree_ref
from spec_kernels.verify_tree import verify_tree


def _wall(fn, reps: int) -> tuple[float, float, float]:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    q = statistics.quantiles(times, n=5) if len(times) >= 5 else [min(times)] * 4
    return statistics.median(times), q[0], q[3]


def _cuda(fn) -> tuple[float, float, float]:
    import triton

    ms = triton.testing.do_bench(fn, quantiles=[0.5, 0.2, 0.8])
    return tuple(x / 1e3 for x in ms)


def _inputs(B: int, T: int, V: int, device: str):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(B, T, V, generator=gen)
    tokens = torch.randint(0, V, (B, T), generator=gen)
    parents = torch.arange(-1, T - 1).expand(B, T).contiguous()
    logits[:, :-1].scatter_add_(2, tokens[:, 1:, None], torch.full((B, T - 1, 1), 8.0))
    return logits.to(device), tokens.to(device), parents.to(device)


def _bench_shape(B: int, T: int, V: int, modes: dict, cuda: bool) -> list[dict]:
    logits, tokens, parents = _inputs(B, T, V, "cuda" if cuda else "cpu")
    nbytes = logits.numel() * logits.element_size()
    big = B * T * V > 16 * 16 * 151936
    timer = _cuda if cuda else partial(_wall, reps=3 if big else 10)
    floor = timer(partial(torch.amax, logits, -1))
    rows = []
    for mode, kw in modes.items():
        impls = ["floor", "triton" if cuda else "native"] + (["ref"] if not big and B * T <= 256 else [])
        for impl in impls:
            if impl == "floor":
                t = floor
            elif impl == "ref":
                ref_args = (logits.cpu(), tokens.cpu(), parents.cpu())
                t = _wall(partial(verify_tree_ref, *ref_args, seed=0, **kw), reps=1)
            else:
                t = timer(partial(verify_tree, logits, tokens, parents, seed=0, backend=impl, **kw))
            row = dict(B=B, T=T, V=V, mode=mode, impl=impl, median_s=t[0], p20_s=t[1], p80_s=t[2],
                       gbps=nbytes / t[0] / 1e9, x_floor=t[0] / floor[0])  # fmt: skip
            rows.append(row)
            print(f"{B:>3} {T:>3} {V:>7} {mode:>7} {impl:>7} {t[0] * 1e3:>10.3f} {t[1] * 1e3:>8.3f} "
                  f"{t[2] * 1e3:>8.3f} {row['gbps']:>7.2f} {row['x_floor']:>8.2f}")  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="a reduced set that runs in a minute or two on a CPU")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    if args.quick:
        shapes = [(1, 5, 32000), (16, 5, 32000), (16, 16, 32000), (16, 5, 151936), (64, 16, 32000)]
    else:
        shapes = [(B, T, V) for V in (32000, 151936) for B in (1, 16, 64) for T in (5, 16, 64)]
    modes = {"greedy": dict(temperature=0.0), "top_p": dict(temperature=0.8, top_p=0.9), "plain": dict()}
    rows = []
    cols = ("B", 3), ("T", 3), ("V", 7), ("mode", 7), ("impl", 7), ("median ms", 10), ("p20", 8), ("p80", 8)
    print(" ".join(f"{c:>{w}}" for c, w in cols + (("GB/s", 7), ("x floor", 8))))
    for B, T, V in shapes:
        rows += _bench_shape(B, T, V, modes, cuda)
    os.makedirs("bench/out", exist_ok=True)
    meta = dict(machine=platform.node(), torch=torch.__version__, threads=torch.get_num_threads(), device=device)
    with open("bench/out/verify_tree.json", "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
