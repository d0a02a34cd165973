"""Benchmark verify_tree against one read of the logits (its memory-bound floor), for native, ref and Triton.

Each config: a chain of T nodes (the worst case: every node is visited) whose drafts the target likes (+8 on the
drafted token's logit), so most of the chain is accepted. Greedy and sampled with top-p. The floor is
``logits.amax(-1)``: one pass over B*T*V logits. GB/s counts B*T*V*itemsize bytes for every implementation.

The coupled modes (seeded requests: the position-keyed Gumbel coupling, every row coupled, without and with top-p)
also time "unfused", the engine's path before the noise moved into the kernels: a [B, T, V] perturbed-logits tensor
(filtered logits / T + rng.position_gumbel) built in torch, then a greedy verify_tree on it.

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

from spec_kernels._sampling import RowParams, keep_threshold
from spec_kernels.rng import position_gumbel
from spec_kernels.verify_tree import verify_tree
from spec_kernels.verify_tree.ref import verify_tree_ref


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


def _inputs(B: int, T: int, V: int, device: str, boost: float = 8.0):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(B, T, V, generator=gen)
    tokens = torch.randint(0, V, (B, T), generator=gen)
    parents = torch.arange(-1, T - 1).expand(B, T).contiguous()
    logits[:, :-1].scatter_add_(2, tokens[:, 1:, None], torch.full((B, T - 1, 1), boost))
    return logits.to(device), tokens.to(device), parents.to(device)


def _unfused_coupled(logits, tokens, parents, *, temperature, noise_seeds, positions, top_p=1.0, **kw):
    """The coupled rows as the engine verified them before: perturbed logits in memory, then a greedy verify."""
    B, T, V = logits.shape
    z = logits.float() / temperature  # [B, T, V]
    if top_p < 1:
        full = torch.full((B * T,), 1.0, device=z.device)
        prm = RowParams(full, torch.zeros(B * T, dtype=torch.int64, device=z.device), full * top_p, full * 0.0)
        thr = keep_threshold(z.view(B * T, V), prm).view(B, T, 1)
        z = torch.where(z >= thr, z, -torch.inf)
    z = z + position_gumbel(noise_seeds, positions, V)  # the [B, T, V] noise tensor
    return verify_tree(z, tokens, parents, temperature=0.0, **kw)


def _bench_shape(B: int, T: int, V: int, modes: dict, cuda: bool) -> list[dict]:
    logits, tokens, parents = _inputs(B, T, V, "cuda" if cuda else "cpu")
    # the coupled modes' Gumbel noise (max over V ~ log V) would reject a +8 draft: +40 keeps their chains accepted
    coupled_logits = _inputs(B, T, V, logits.device.type, boost=40.0)[0]
    coupling = dict(noise_seeds=torch.arange(B, device=logits.device) + 7,
                    positions=torch.arange(T, device=logits.device).expand(B, T) + 100)  # fmt: skip
    nbytes = logits.numel() * logits.element_size()
    big = B * T * V > 16 * 16 * 151936
    timer = _cuda if cuda else partial(_wall, reps=3 if big else 10)
    floor = timer(partial(torch.amax, logits, -1))
    rows = []
    for mode, kw in modes.items():
        impls = ["floor", "triton" if cuda else "native"] + (["ref"] if not big and B * T <= 256 else [])
        x = logits
        if mode.startswith("coupled"):
            x, kw = coupled_logits, {**kw, **coupling}
            impls.insert(1, "unfused")
        for impl in impls:
            if impl == "floor":
                t = floor
            elif impl == "unfused":
                t = timer(partial(_unfused_coupled, x, tokens, parents, backend="triton" if cuda else "native", **kw))
            elif impl == "ref":
                ref_args = (x.cpu(), tokens.cpu(), parents.cpu())
                ref_kw = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
                t = _wall(partial(verify_tree_ref, *ref_args, seed=0, **ref_kw), reps=1)
            else:
                t = timer(partial(verify_tree, x, tokens, parents, seed=0, backend=impl, **kw))
            row = dict(B=B, T=T, V=V, mode=mode, impl=impl, median_s=t[0], p20_s=t[1], p80_s=t[2],
                       gbps=nbytes / t[0] / 1e9, x_floor=t[0] / floor[0])  # fmt: skip
            rows.append(row)
            print(f"{B:>3} {T:>3} {V:>7} {mode:>13} {impl:>7} {t[0] * 1e3:>10.3f} {t[1] * 1e3:>8.3f} "
                  f"{t[2] * 1e3:>8.3f} {row['gbps']:>7.2f} {row['x_floor']:>8.2f}")  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="a reduced set that runs in a minute or two on a CPU")
    ap.add_argument("--modes", default="greedy,top_p,plain,coupled,coupled_top_p", help="comma-separated subset")
    ap.add_argument("--shapes", default=None, help="B,T,V;B,T,V... instead of the built-in list")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    if args.quick:
        shapes = [(1, 5, 32000), (16, 5, 32000), (16, 16, 32000), (16, 5, 151936), (64, 16, 32000)]
    else:
        shapes = [(B, T, V) for V in (32000, 151936) for B in (1, 16, 64) for T in (5, 16, 64)]
    if args.shapes:
        shapes = [tuple(int(x) for x in shape.split(",")) for shape in args.shapes.split(";")]
    modes = {
        "greedy": dict(temperature=0.0),
        "top_p": dict(temperature=0.8, top_p=0.9),
        "plain": dict(),
        "coupled": dict(temperature=0.8),
        "coupled_top_p": dict(temperature=0.8, top_p=0.9),
    }
    modes = {m: modes[m] for m in args.modes.split(",")}
    rows = []
    cols = ("B", 3), ("T", 3), ("V", 7), ("mode", 13), ("impl", 7), ("median ms", 10), ("p20", 8), ("p80", 8)
    print(" ".join(f"{c:>{w}}" for c, w in cols + (("GB/s", 7), ("x floor", 8))))
    for B, T, V in shapes:
        rows += _bench_shape(B, T, V, modes, cuda)
    os.makedirs("bench/out", exist_ok=True)
    meta = dict(machine=platform.node(), torch=torch.__version__, threads=torch.get_num_threads(), device=device)
    with open("bench/out/verify_tree.json", "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
