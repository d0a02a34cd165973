"""Backend selection shared by every public op: dispatch happens here, once.

Glossary:
- *device path*: the GPU code path (Triton or CUDA launcher, then a custom op). CUDA tensors take it, and so do
  ``meta`` tensors: they stand in for a GPU on machines without one (every op and view works, any read of data
  raises), so an op that completes on meta tensors is free of host syncs on CUDA. Custom ops dispatch to their fake
  implementations there.
- *value checks*: input checks that read tensor data (index ranges, parameter ranges). Free on CPU tensors; on the
  device path each is either queued with ``torch._assert_async`` (no host sync) or run only when
  ``SPECDEC_DEBUG_CHECKS=1``, as each op's docstring says.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch

BACKENDS = ("torch", "triton", "native")
DEVICE_PATH_TYPES = ("cuda", "meta")  # device types that take the GPU path


def triton_interpret() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def on_device_path(device: torch.device) -> bool:
    """True for CUDA tensors and their host-free stand-in, ``meta`` tensors."""
    return device.type in DEVICE_PATH_TYPES


def debug_checks() -> bool:
    """True when ``SPECDEC_DEBUG_CHECKS=1``: the device path also runs the value checks that cost a host sync."""
    return os.environ.get("SPECDEC_DEBUG_CHECKS", "0") not in ("", "0")


def host_value_checks(device: torch.device) -> bool:
    """Whether value checks that read data on the host run: always on CPU tensors (no sync to pay), on the device
    path only with ``SPECDEC_DEBUG_CHECKS=1``."""
    return device.type == "cpu" or debug_checks()


@functools.cache
def cpu_supports_native_bf16() -> bool:
    """Whether this CPU runs the native bfloat16 kernels on a vector path: AVX-512 F/BW/VL with AVX512-BF16 dot
    products, or AVX2 + FMA (bfloat16 widened to float32 in registers; the default pair on a 2-core AMD EPYC without
    AVX-512 decoded faster than in float32, the weights' bytes halved: bench/RESULTS-log.md, "A CPU without AVX-512"),
    from the kernel's CPU flags (Linux); False where they cannot be read or ``SPECDEC_CPU_ISA=scalar`` forces the scalar
    kernels (csrc/cpu_simd.h)."""
    if os.environ.get("SPECDEC_CPU_ISA") == "scalar" or os.environ.get("SPECDEC_LINEAR_SCALAR"):
        return False
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return False
    have = set(flags.split(":", 1)[1].split())
    return {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"} <= have or {"avx2", "fma"} <= have


def resolve_backend(op: str, backend: str | None, device: torch.device, *, has_triton: bool = True) -> str:
    """Pick the backend for ``op`` on ``device``, or raise a clear error when the asked one cannot run.

    ``None`` means the device path on CUDA and meta tensors (Triton, or the CUDA extension ("native") for ops with
    ``has_triton=False``) and the fastest CPU path ("native") on CPU tensors. An explicit "triton" runs on CUDA and
    meta tensors, and on CPU tensors under ``TRITON_INTERPRET=1``.
    """
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"{op}: unknown backend {backend!r}; expected None or one of {BACKENDS}")
    if backend is None:
        return "triton" if has_triton and on_device_path(device) else "native"
    if backend == "triton":
        if not has_triton:
            raise ValueError(
                f"{op}: there is no Triton backend (the op is C++/CUDA, see docs/ARCHITECTURE.md); use backend=None, "
                "'native' or 'torch'"
            )
        if not triton_available():
            raise RuntimeError(f"{op}: backend='triton' needs the triton package (pip install triton)")
        if not on_device_path(device) and not triton_interpret():
            raise RuntimeError(
                f"{op}: backend='triton' on {device.type} tensors needs TRITON_INTERPRET=1 "
                "(Triton's CPU interpreter); use backend=None or 'native' for the fast CPU path"
            )
    return backend
