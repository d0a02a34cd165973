"""Verify width on a DRAM-bound model: what a T-token forward costs against a 1-token one, and which matmul pays.

Glossary:
    T      tokens in one forward (the verify width; M rows of x in each matmul)
    r(T)   time of a T-token forward / time of a 1-token forward, same model, same cached prefix
    cold   a matmul whose weight comes from DRAM: each timed pass walks enough copies of the weight (> 2x the L3) that
           no copy is still cached when its turn comes back, as a forward's 30 layers stream theirs

Two parts, each with 2 threads (torch.set_num_threads):
1. **Matmuls**: SmolLM2-135M's per-layer shapes (qkv fused 960x576, o 576x576, gate_up fused 3072x576, down
   576x1536) and its lm_head 49152x576, bfloat16, cold, through ``spec_kernels.linear`` at M = 1, 2, 4, 8, 16:
   median us per call (p20-p80), weight GB/s (the DRAM roofline) and GFLOP/s (the FMA roofline: 2 cores x 2 FMA
   ports x 8 fp32 lanes x 2 flops per cycle on AVX2, ~190 GFLOP/s at ~3 GHz).
2. **Forward**: the engine's own forward + logits of SmolLM2 (``--model``, default the pulled GGUF) in bfloat16 over a
   ``--context``-token cached prefix (default ``CTX``) at T = 1, 2, 4, 8, 16 (bench.harness.forward_step),
   interleaved round by round, and r(T) from the medians.

The machine is shared: rounds interleave every config so load drift hits all alike; medians carry the noise. With
more runnable threads than cores, a two-thread call can wait a scheduler slice for its second thread (milliseconds,
see spec_kernels/linear/cpu.py), so wall-clock figures of a loaded machine mean little. ``--clock cpu --threads 1``
times the calling thread's CPU time instead (time.thread_time): what the code costs when it runs, nearly blind to other
processes (not to their share of DRAM bandwidth and L3). To compare two builds of the kernel, run this script from
each checkout alternately (each with its own SPECDEC_CACHE).

Usage: python bench/bench_verify_width.py [--quick] [--part matmuls|forward|both] [--model DIR] [--threads N]
[--clock wall|cpu] [--context N] [--quantization gguf].
Results go to bench/out/bench_verify_width.json.
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

import torch

if __package__ in (None, ""):  # run as a file: the repository root, not bench/, heads the import path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from spec_kernels.linear import linear  # noqa: E402

CTX = 96  # committed tokens under every timed forward
WIDTHS = (1, 2, 4, 8, 16)
COLD_BYTES = 80 << 20  # weight copies walked per matmul pass: > 2x this machine's 32 MB L3
SHAPES = (  # SmolLM2-135M: hidden 576, 9 q + 3 kv heads of 64, MLP 1536, vocab 49152; (name, N, K) of weight [N, K]
    ("qkv", 960, 576),
    ("o", 576, 576),
    ("gate_up", 3072, 576),
    ("down", 576, 1536),
    ("lm_head", 49152, 576),
)


def _stats(samples_s: list[float], nbytes: int, flops: int) -> dict[str, float]:
    q = statistics.quantiles(samples_s, n=10)
    med = statistics.median(samples_s)
    return {
        "median_us": med * 1e6,
        "p20_us": q[1] * 1e6,
        "p80_us": q[7] * 1e6,
        "gbps": nbytes / med / 1e9,
        "gflops": flops / med / 1e9,
    }


def bench_matmuls(reps: int, clock) -> list[dict]:
    """Each shape cold at every M; rounds interleave the M values. A sample is one pass over all copies / copies."""
    gen = torch.Generator().manual_seed(0)
    out = []
    for name, n, k in SHAPES:
        nbytes = n * k * 2
        copies = max(2, -(-COLD_BYTES // nbytes))
        weights = [(torch.randn(n, k, generator=gen) / k**0.5).to(torch.bfloat16) for _ in range(copies)]  # [N, K]
        xs = {m: torch.randn(m, k, generator=gen).to(torch.bfloat16) for m in WIDTHS}  # [M, K]
        times: dict[int, list[float]] = {m: [] for m in WIDTHS}
        for m in WIDTHS:  # warm-up: first-call allocations
            for w in weights:
                linear(xs[m], w)
        for _ in range(reps):
            for m in WIDTHS:
                x = xs[m]
                start = clock()
                for w in weights:
                    linear(x, w)
                times[m].append((clock() - start) / copies)
        for m in WIDTHS:
            s = _stats(times[m], nbytes, 2 * m * n * k)
            out.append({"matrix": name, "N": n, "K": k, "M": m, "copies": copies} | s)
            print(
                f"{name:8s} [{n:5d}, {k:4d}] M={m:2d} {s['median_us']:8.1f} us [{s['p20_us']:8.1f}-{s['p80_us']:8.1f}]"
                f" {s['gbps']:5.1f} GB/s {s['gflops']:6.1f} GFLOP/s",
                flush=True,
            )
        del weights
    return out


def bench_forward(model_dir: str, reps: int, clock, ctx: int = CTX, quantization: str | None = None) -> dict:
    """Median ms of the bf16 forward + logits at each T over a ``ctx``-token prefix (rounds interleave the T values)
    and r(T); ``quantization="gguf"``: a GGUF file's blocks kept."""
    from bench.harness import forward_step
    from spec_engine.llm import LLM

    # (room for the prefix, the widest forward and forward_step's table, which starts at block 1)
    llm = LLM(model=model_dir, dtype="bfloat16", max_num_seqs=1, max_model_len=max(4096, ctx + 4 * max(WIDTHS)),
              quantization=quantization)  # fmt: skip
    eng = llm.engine
    fns = {t: forward_step(eng.target, eng.kv, 1, ctx, t) for t in WIDTHS}
    for fn in fns.values():  # warm-up: lazy builds, first-call allocations
        fn()
        fn()
    times: dict[int, list[float]] = {t: [] for t in WIDTHS}
    for _ in range(reps):
        for t, fn in fns.items():
            start = clock()
            fn()
            times[t].append(1e3 * (clock() - start))
    med = {t: statistics.median(v) for t, v in times.items()}
    p20 = {t: statistics.quantiles(v, n=10)[1] for t, v in times.items()}
    rows = {t: {"median_ms": med[t], "p20_ms": p20[t], "r": med[t] / med[1], "r_p20": p20[t] / p20[1]} for t in WIDTHS}
    for t, r in rows.items():
        print(
            f"forward T={t:2d} {r['median_ms']:7.2f} ms (p20 {r['p20_ms']:7.2f})"
            f" r(T) {r['r']:5.2f} (p20 {r['r_p20']:5.2f})",
            flush=True,
        )
    return {str(t): r for t, r in rows.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds (about a minute)")
    parser.add_argument("--part", choices=("matmuls", "forward", "both"), default="both")
    parser.add_argument("--model", default="smollm2", help="the target: an HF directory, a GGUF file or a pulled name")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall", help="cpu: this thread's CPU time")
    parser.add_argument("--context", type=int, default=CTX, help="the forward part's cached prefix, in tokens")
    parser.add_argument("--quantization", choices=("gguf",), help="the forward part: a GGUF file's blocks kept")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "out" / "bench_verify_width.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.clock == "cpu" and args.threads != 1:
        parser.error("--clock cpu times one thread: pass --threads 1")
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    load_before = os.getloadavg()
    result: dict = {}
    if args.part in ("matmuls", "both"):
        result["matmuls"] = bench_matmuls(7 if args.quick else 25, clock)
    if args.part in ("forward", "both"):
        if args.context < 0:
            parser.error("--context takes a count of tokens (0 or more)")
        result["forward"] = bench_forward(args.model, 15 if args.quick else 60, clock, args.context, args.quantization)
    result["meta"] = {
        "machine": platform.node(),
        "processor": platform.processor() or platform.machine(),
        "isa": os.environ.get("SPECDEC_CPU_ISA", "widest"),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "clock": args.clock,
        "loadavg_before_after": [load_before, os.getloadavg()],
        "note": "wall-clock on a shared machine: compare interleaved configs, not runs hours apart",
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"saved {out}")


if __name__ == "__main__":
    main()
