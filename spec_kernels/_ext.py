"""Loader of the C++/CUDA extension in ``csrc/`` (the native backends of ``compact_kv_`` and ``linear``).

Importing this module compiles nothing. The first :func:`load_ext` call either imports the ahead-of-time build
(``spec_kernels._C``, made by ``SPECDEC_BUILD_EXT=1 pip install -e . --no-build-isolation``) or JIT-builds the
sources with ``torch.utils.cpp_extension.load`` (ninja). JIT builds are cached on disk under
``$SPECDEC_CACHE`` (default ``~/.cache/specdec``) in a folder keyed by the sources, the torch version, the Python
version and whether CUDA is compiled, and a file lock keeps parallel processes (pytest-xdist workers) from building
the same folder at once.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import sys
import threading
from pathlib import Path
from types import ModuleType

import torch

CSRC_DIR = Path(__file__).resolve().parent.parent / "csrc"
AOT_MODULE = "spec_kernels._C"

_module: ModuleType | None = None  # the loaded extension; None until load_ext() runs
_lock = threading.Lock()


def cache_root() -> Path:
    """Where JIT builds live: ``$SPECDEC_CACHE`` or ``~/.cache/specdec``."""
    return Path(os.environ.get("SPECDEC_CACHE", Path.home() / ".cache" / "specdec"))


def with_cuda() -> bool:
    """Whether the build includes the CUDA kernels: a CUDA torch on a machine that has a GPU."""
    return torch.version.cuda is not None and torch.cuda.is_available()


def sources(cuda: bool) -> list[Path]:
    """The translation units to compile: every ``csrc/**/*.cpp``, plus every ``*.cu`` when ``cuda``."""
    files = sorted(CSRC_DIR.rglob("*.cpp"))
    if cuda:
        files += sorted(CSRC_DIR.rglob("*.cu"))
    return files


def build_flags(cuda: bool) -> dict[str, list[str]]:
    """Compiler flags shared by the JIT build and setup.py."""
    # -fopenmp: at::parallel_for is a header template that runs serially unless _OPENMP is defined.
    cflags = ["-O3", "-fopenmp"]
    if cuda:
        cflags.append("-DSPECDEC_WITH_CUDA")
    # The C++ runtime NEEDED by name: on a CUDA image with g++ 13 (Ubuntu's --as-needed default) neither the plain
    # link nor "-lstdc++" put libstdc++.so.6 among the extension's NEEDED libraries, and every exception it threw
    # (a TORCH_CHECK's ValueError) killed the process instead of reaching Python (bench/RESULTS-log.md, "The
    # device's crash on C++ errors").
    ldflags = ["-fopenmp", "-Wl,--no-as-needed", "-l:libstdc++.so.6", "-Wl,--as-needed"]
    return {"cxx": cflags, "nvcc": ["-O3"], "ldflags": ldflags}


def _build_key(cuda: bool) -> str:
    digest = hashlib.sha256()
    for path in sorted(CSRC_DIR.rglob("*")):
        if path.is_file():
            digest.update(str(path.relative_to(CSRC_DIR)).encode())
            digest.update(path.read_bytes())
    # Everything that changes the compile command: two configurations sharing a folder would rebuild it in turn.
    # The interpreter by its file, not the name it was started by: a venv's `python`, `python3` and its scripts'
    # shebangs are links to one binary, and each name used to build a copy of its own (a full build each).
    interpreter = os.path.realpath(sys.executable)
    config = (torch.__version__, torch.__file__, interpreter, cuda, build_flags(cuda), os.environ.get("CXX"))
    digest.update(repr(config).encode())
    return digest.hexdigest()[:16]


def _jit_build() -> ModuleType:
    from filelock import FileLock
    from torch.utils.cpp_extension import load

    if not CSRC_DIR.is_dir():
        raise RuntimeError(
            f"spec_kernels: C++ sources not found at {CSRC_DIR}; install from a source checkout "
            "(pip install -e .) or build ahead of time with SPECDEC_BUILD_EXT=1"
        )
    cuda = with_cuda()
    key = _build_key(cuda)
    name = f"specdec_ext_{key}"
    build_dir = cache_root() / f"ext-{key}"
    build_dir.mkdir(parents=True, exist_ok=True)
    flags = build_flags(cuda)
    with FileLock(str(build_dir / "build.lock")):  # (released by the OS if its holder dies)
        # torch's load() takes a lock file of its own in the folder, on every load, and waits while it exists; a
        # process killed in a build leaves it behind, which would stall every later load forever. Under our lock no
        # other process is in load(): any such file is stale.
        (build_dir / "lock").unlink(missing_ok=True)
        if not (build_dir / f"{name}.so").exists():
            kind = "C++/CUDA" if cuda else "C++"
            print(f"spec_kernels: compiling the {kind} extension once (~1 min) into {build_dir}", file=sys.stderr)
        return load(
            name=name,
            sources=[str(s) for s in sources(cuda)],
            extra_cflags=flags["cxx"],
            extra_cuda_cflags=flags["nvcc"],
            extra_ldflags=flags["ldflags"],
            extra_include_paths=[str(CSRC_DIR)],
            build_directory=str(build_dir),
            with_cuda=cuda,
            is_python_module=True,
            verbose=False,
        )


def load_ext() -> ModuleType:
    """Return the extension module, loading (and if needed compiling) it on first use.

    Loading registers the ``torch.ops.spec_kernels.*`` C++ ops.
    """
    global _module
    if _module is not None:
        return _module
    with _lock:
        if _module is None:
            try:
                _module = importlib.import_module(AOT_MODULE)
            except ImportError:
                _module = _jit_build()
    return _module


def is_loaded() -> bool:
    """True once :func:`load_ext` has loaded the extension in this process."""
    return _module is not None
