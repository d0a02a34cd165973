"""A STREAM-like probe of this machine's memory bandwidth: what a decode step that streams its weights can reach.

    python bench/bench_bandwidth.py [--threads 2] [--mib 512] [--rounds 7]

Prints read GB/s (a sum over a buffer far larger than the L3 cache: every byte crosses the memory bus once) and
copy GB/s (read + write). The decode benchmarks report their achieved weight-streaming GB/s against the read figure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def read_gbps(num_bytes: int = 512 << 20):
    """A sampler: GB/s of one ``sum`` over ``num_bytes`` of float32 allocated (and touched) once."""
    x = torch.ones(num_bytes // 4, dtype=torch.float32)

    def sample() -> float:
        t0 = time.perf_counter()
        x.sum()
        return num_bytes / (time.perf_counter() - t0) / 1e9

    return sample


def copy_gbps(num_bytes: int = 512 << 20):
    """A sampler: GB/s moved (read + write) by one ``copy_`` of ``num_bytes`` into a buffer allocated once."""
    x = torch.ones(num_bytes // 4, dtype=torch.float32)
    y = torch.zeros_like(x)

    def sample() -> float:
        t0 = time.perf_counter()
        y.copy_(x)
        return 2 * num_bytes / (time.perf_counter() - t0) / 1e9

    return sample


def probe(threads: int = 2, mib: int = 512, rounds: int = 7) -> dict:
    """{"read_gbps": best, "read_gbps_median", "copy_gbps": best, "copy_gbps_median"}: the best of ``rounds`` is
    the machine's figure (other jobs only slow a run), the median shows the noise."""
    torch.set_num_threads(threads)
    out = {}
    for name, make in (("read", read_gbps), ("copy", copy_gbps)):
        fn = make(mib << 20)
        fn()  # warm: page faults, thread pool start
        s = [fn() for _ in range(rounds)]
        out[f"{name}_gbps"], out[f"{name}_gbps_median"] = max(s), statistics.median(s)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--mib", type=int, default=512, help="buffer size (default 512 MiB: far past any L3 cache)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    r = probe(args.threads, args.mib, args.rounds)
    if args.json:
        print(json.dumps(r))
    else:
        print(f"read {r['read_gbps']:.1f} GB/s (median {r['read_gbps_median']:.1f}) | copy {r['copy_gbps']:.1f} GB/s "
              f"(median {r['copy_gbps_median']:.1f}) | {args.threads} threads, {args.mib} MiB")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
