"""Optional ahead-of-time build of the C++/CUDA extension (``spec_kernels._C``).

Metadata lives in pyproject.toml; this file only adds ``ext_modules``, and only when ``SPECDEC_BUILD_EXT=1``:

    SPECDEC_BUILD_EXT=1 pip install -e . --no-build-isolation

(``--no-build-isolation`` so the build sees the installed torch.) Without the switch ``pip install -e .`` stays
fast and torch-free, and the extension is JIT-built on first use instead (spec_kernels/_ext.py).
"""

import os
import sys
from pathlib import Path

from setuptools import setup


def _ext_modules_and_cmdclass() -> dict:
    import torch
    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

    sys.path.insert(0, str(Path(__file__).resolve().parent / "spec_kernels"))
    from _ext import build_flags  # the JIT loader's flags: one source of truth, and no package import

    root = Path(__file__).resolve().parent
    cuda = torch.version.cuda is not None and CUDA_HOME is not None
    csrc = root / "csrc"
    sources = sorted(csrc.rglob("*.cpp")) + (sorted(csrc.rglob("*.cu")) if cuda else [])
    flags = build_flags(cuda)
    ext_cls = CUDAExtension if cuda else CppExtension
    ext = ext_cls(
        name="spec_kernels._C",
        sources=[str(s.relative_to(root)) for s in sources],
        include_dirs=[str(csrc)],
        extra_compile_args={"cxx": flags["cxx"], "nvcc": flags["nvcc"]} if cuda else flags["cxx"],
        extra_link_args=flags["ldflags"],
    )
    return {"ext_modules": [ext], "cmdclass": {"build_ext": BuildExtension}}


setup(**(_ext_modules_and_cmdclass() if os.environ.get("SPECDEC_BUILD_EXT") == "1" else {}))
