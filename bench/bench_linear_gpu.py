"""CUDA's linear: the batch-invariant Triton kernel (``spec_kernels.linear.triton``, what ``linear`` takes on CUDA)
against ``F.linear`` (cuBLAS), per matrix and M, on a GPU:

    python bench/bench_linear_gpu.py [--dtype bfloat16] [--reps 200]

Rows: SmolLM2-135M's matrices (qkv, o, gate_up, down, lm_head) and a 7B-class layer's (qkv, gate_up, down), at M 1
(plain decoding), 5 and 16 (verification), 64 and 512 (prefill chunks). Each cell is the median of ``--reps`` timed
calls (CUDA events, after warm-up) in microseconds, with the weight's bytes over the time (GB/s); the last column says
whether each row of the M-row call equals its 1-row call bit for bit (Triton: always, by construction; cuBLAS: not
promised).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from spec_kernels.linear.triton import linear_triton  # noqa: E402

SHAPES = {  # name: (N, K)
    "smollm2 qkv": (960, 576),
    "smollm2 o": (576, 576),
    "smollm2 gate_up": (3072, 576),
    "smollm2 down": (576, 1536),
    "smollm2 lm_head": (49152, 576),
    "7b qkv": (12288, 4096),
    "7b gate_up": (22016, 4096),
    "7b down": (4096, 11008),
}
ROWS = (1, 5, 16, 64, 512)


def _triton(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return linear_triton(x, w, None)


def _cublas(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x, w)


def _time_us(fn, x: torch.Tensor, w: torch.Tensor, reps: int) -> float:
    for _ in range(5):
        fn(x, w)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(x, w)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def _invariant(fn, x: torch.Tensor, w: torch.Tensor) -> bool:
    out = fn(x, w)
    return all(torch.equal(fn(x[i : i + 1], w)[0], out[i]) for i in range(0, x.shape[0], max(1, x.shape[0] // 8)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--reps", type=int, default=200)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_linear_gpu: needs a CUDA device", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype)
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, {args.dtype}; us (GB/s of weight)")
    print(f"{'matrix':16} {'M':>4} | {'triton':>16} | {'F.linear':>16} | ratio | invariant triton / cublas")
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, (N, K) in SHAPES.items():
        w = (torch.randn(N, K, device="cuda", generator=gen) / K**0.5).to(dtype)
        for M in ROWS:
            x = torch.randn(M, K, device="cuda", generator=gen).to(dtype)
            ours, cublas = _time_us(_triton, x, w, args.reps), _time_us(_cublas, x, w, args.reps)
            gbs = w.numel() * w.element_size() / 1e3
            inv = (_invariant(_triton, x, w), _invariant(_cublas, x, w))
            print(f"{name:16} {M:4d} | {ours:8.1f} ({gbs / ours:5.0f}) | {cublas:8.1f} ({gbs / cublas:5.0f}) | "
                  f"{ours / cublas:5.2f} | {inv[0]} / {inv[1]}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
