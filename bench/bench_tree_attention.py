"""Benchmark tree_attention on decode-like shapes against its reference and against dense SDPA with a mask.

The op is memory bound on GPUs: each step reads the whole K/V prefix once. The roofline is therefore the K/V
bytes (plus q and the output) over the machine's copy bandwidth, measured here with a large ``clone``.

    python bench/bench_tree_attention.py            # B in {1,8,32} x L in {512,4096} x T in {1,8,32,64}
    python bench/bench_tree_attention.py --quick    # a reduced set that runs in a minute or two on a CPU

Columns: median time with [p20, p80] in ms, effective GB/s of the K/V read, and the copy-bandwidth floor. ``op``
is one call as a lone caller makes it (it prepares the lengths, mask and length check itself); ``planned`` is one
layer's call inside a forward, which shares a plan (``plan_tree_attention``, made once, not timed).
``sdpa`` is ``F.scaled_dot_product_attention`` over K/V already repeated to Hq heads with an explicit [T, L+T]
mask (preparation not timed): the unfused dense baseline. JSON goes to bench/out/tree_attention.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from spec_kernels.tree_attention import plan_tree_attention, tree_attention
from spec_kernels.tree_attention.ref import tree_attention_ref

HQ, HKV, D = 32, 8, 128
FULL = list(itertools.product([1, 8, 32], [512, 4096], [1, 8, 32, 64]))
QUICK = [(1, 512, 1), (1, 512, 8), (1, 4096, 8), (1, 4096, 64), (8, 512, 8), (8, 4096, 1), (8, 4096, 8)]


def timeit(fn, device: torch.device, reps: int) -> tuple[float, float, float]:
    """(median, p20, p80) in ms: Triton's do_bench on CUDA, wall clock on CPU."""
    if device.type == "cuda":
        import triton

        return tuple(triton.testing.do_bench(fn, quantiles=[0.5, 0.2, 0.8]))
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    q = statistics.quantiles(times, n=10, method="inclusive") if len(times) > 1 else times * 9
    return statistics.median(times), q[1], q[7]


def copy_bandwidth_gbs(device: torch.device) -> float:
    """Read + write bandwidth of a 256 MiB clone: the practical memory roofline of this machine."""
    x = torch.empty(64 * 2**20, dtype=torch.float32, device=device).uniform_()
    median, _, _ = timeit(lambda: x.clone(), device, reps=5)
    return 2 * x.numel() * x.element_size() / median / 1e6


def make_inputs(B: int, L: int, T: int, dtype: torch.dtype, device: torch.device):
    q = torch.randn(B, T, HQ, D, dtype=dtype, device=device)
    k = torch.randn(B, L + T, HKV, D, dtype=dtype, device=device)
    v = torch.randn(B, L + T, HKV, D, dtype=dtype, device=device)
    cache_seqlens = torch.full((B,), L, dtype=torch.int32, device=device)
    parents = torch.tensor([-1] + [(i - 1) // 2 for i in range(1, T)])  # a binary tree of T nodes
    mask = torch.eye(T, dtype=torch.bool)
    for i in range(1, T):
        mask[i] |= mask[parents[i]]
    return q, k, v, cache_seqlens, mask.expand(B, T, T).contiguous().to(device)


def dense_sdpa(q, k, v, cache_seqlens, tree_mask):
    """The unfused baseline's inputs: K/V repeated to Hq heads, a [B, 1, T, L+T] mask."""
    B, T = q.shape[:2]
    L = k.shape[1] - T
    k_rep = k.repeat_interleave(HQ // HKV, dim=2).transpose(1, 2)  # [B, Hq, L+T, D]
    v_rep = v.repeat_interleave(HQ // HKV, dim=2).transpose(1, 2)
    prefix = torch.ones(B, T, L, dtype=torch.bool, device=q.device)
    mask = torch.cat([prefix, tree_mask], dim=2)[:, None]  # [B, 1, T, L+T]
    q_t = q.transpose(1, 2)
    return lambda: F.scaled_dot_product_attention(q_t, k_rep, v_rep, attn_mask=mask)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="reduced set of shapes (about 1-2 minutes on a CPU)")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions on CPU")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--no-ref", action="store_true", help="skip the slow per-sequence reference")
    args = parser.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    bandwidth = copy_bandwidth_gbs(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    print(f"# {name} ({platform.node()}), torch {torch.__version__}, threads {torch.get_num_threads()}, {dtype}")
    print(f"# Hq/Hkv={HQ}/{HKV} D={D}; copy bandwidth {bandwidth:.1f} GB/s; times in ms as median [p20, p80]")
    header = (
        f"{'B':>3} {'L':>5} {'T':>3} | {'op':>31} {'GB/s':>7} | {'planned':>31} | {'ref':>31} | {'sdpa':>31} | "
        f"{'floor':>7} {'vs ref':>7}"
    )
    print(header)
    rows = []
    for B, L, T in QUICK if args.quick else FULL:
        q, k, v, cache_seqlens, mask = make_inputs(B, L, T, dtype, device)
        bytes_read = (k.numel() + v.numel() + 2 * q.numel()) * q.element_size()  # K/V + q in, output out
        op = timeit(lambda: tree_attention(q, k, v, cache_seqlens, mask), device, args.reps)  # noqa: B023
        plan = plan_tree_attention(k, cache_seqlens, mask, num_q_heads=HQ)
        planned = timeit(lambda: tree_attention(q, k, v, cache_seqlens, mask, plan=plan), device, args.reps)  # noqa: B023
        ref_call = lambda: tree_attention_ref(q, k, v, cache_seqlens, mask)  # noqa: B023, E731
        ref = None if args.no_ref else timeit(ref_call, device, args.reps)
        sdpa = timeit(dense_sdpa(q, k, v, cache_seqlens, mask), device, args.reps)
        gbs = bytes_read / op[0] / 1e6
        floor_ms = bytes_read / bandwidth / 1e6

        def fmt(t):
            return f"{t[0]:9.3f} [{t[1]:9.3f},{t[2]:9.3f}]" if t else f"{'-':>31}"

        speedup = f"{ref[0] / op[0]:6.1f}x" if ref else f"{'-':>7}"
        print(f"{B:>3} {L:>5} {T:>3} | {fmt(op)} {gbs:7.1f} | {fmt(planned)} | {fmt(ref)} | {fmt(sdpa)} | "
              f"{floor_ms:7.3f} {speedup}")  # fmt: skip
        rows.append({"B": B, "L": L, "T": T, "op_ms": op, "planned_ms": planned, "ref_ms": ref, "sdpa_ms": sdpa,
                     "gbs": gbs, "floor_ms": floor_ms})  # fmt: skip

    out = Path(__file__).parent / "out" / "tree_attention.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "machine": platform.node(),
        "device": name,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "dtype": args.dtype,
        "heads": [HQ, HKV, D],
        "copy_bandwidth_gbs": bandwidth,
    }
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"# saved {out}")


if __name__ == "__main__":
    main()
