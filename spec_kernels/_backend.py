"""Backend selection shared by every public op: dispatch happens here, once."""

from __future__ import annotations

import os

import torch

BACKENDS = ("torch", "triton", "native")


def triton_interpret() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_backend(op: str, backend: str | None, device: torch.device) -> str:
    """Pick the backend for ``op`` on ``device``, or raise a clear error when the asked one cannot run.

    ``None`` means Triton (or CUDA) on CUDA tensors and the fastest CPU path ("native") on CPU tensors.
    """
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"{op}: unknown backend {backend!r}; expected None or one of {BACKENDS}")
    if backend is None:
        return "triton" if device.type == "cuda" else "native"
    if backend == "triton":
        if not triton_available():
            raise RuntimeError(f"{op}: backend='triton' needs the triton package (pip install triton)")
        if device.type != "cuda" and not triton_interpret():
            raise RuntimeError(
                f"{op}: backend='triton' on {device.type} tensors needs TRITON_INTERPRET=1 "
                "(Triton's CPU interpreter); use backend=None or 'native' for the fast CPU path"
            )
    return backend
