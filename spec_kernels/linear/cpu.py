"""``linear``'s native CPU backend: the C++ kernel's entry (``_native_op``) and its path on this CPU
(``native_path``).

The native backend is a C++ kernel (``csrc/linear_cpu.cpp``, ``torch.ops.spec_kernels.linear``; AVX-512 fp32 and
AVX512-BF16) built on first use by :mod:`spec_kernels._ext`. On this 2-core CPU, per matrix of the default pair, it
is faster than ``F.linear`` in both dtypes at M = 4-16; in fp32 at M = 1 it is slower on a small matrix (the [64, 192] v
projection: more fixed cost than MKL's gemv) and faster on a large one (lm_head) (bench/bench_linear.py;
bench/RESULTS-log.md, "Figures moved from code comments (2026-11-26)"). It is batch-invariant: each output element is
reduced in one fixed order whatever M is, so ``linear(x)[i]`` is bitwise ``linear(x[i:i+1])[0]``, and a tree node's
logits in a T-token verify pass equal plain decoding's bit for bit.

Threads: the kernel uses ``torch.get_num_threads()`` OpenMP threads (a second one only for calls with enough work
to repay the hand-off). On a machine with more runnable threads than cores, any two-thread OpenMP region (this
kernel's, torch's own ops') can wait a scheduler slice for its second thread: the default target's fp32 matmuls at
M=1 ran two orders of magnitude slower during busy stretches, where one thread throughout stayed within a few times
its quiet speed (bench/RESULTS-log.md, "Figures moved out of code comments (2026-11-25)"; spec_engine/threads.py
chooses). Results never depend on the thread count.
"""

from __future__ import annotations

import torch

NATIVE_DTYPES = (torch.float32, torch.bfloat16)

_op = None  # the extension's direct entry of spec_kernels::linear, once loaded (skips torch.ops' boxed dispatch)


def _native_op():
    """The native op: torch.ops' entry while torch.compile traces (it sees the custom op), the direct one otherwise."""
    global _op
    if torch.compiler.is_compiling():
        return torch.ops.spec_kernels.linear.default
    if _op is None:
        from spec_kernels._ext import load_ext

        _op = load_ext().linear
    return _op


def native_path(dtype: torch.dtype = torch.bfloat16, k: int = 576) -> tuple[str, float]:
    """The native kernel's path on this CPU for ``dtype`` weights of reduction length ``k`` (chosen once per process),
    and vdpbf16ps's time over the float32 FMAs' for as many instructions, as this process measured it (0.0 without
    AVX512-BF16): ``("amx" | "avx512-widen" | "avx512-dot" | "avx512" | "avx2" | "scalar", ratio)``. Benchmarks
    print it beside their figures. Builds the extension on first use."""
    if dtype not in NATIVE_DTYPES:
        raise ValueError(f"native_path: dtype must be one of {NATIVE_DTYPES}, got {dtype}")
    from spec_kernels._ext import load_ext

    load_ext()
    path, ratio = torch.ops.spec_kernels.linear_path(dtype is torch.bfloat16, int(k))
    return path, ratio
