"""Tests of spec_kernels.compact_kv_: the C++/CUDA op must equal compact_kv_ref bit for bit.

Caches are filled with random *bit patterns* (NaN payloads and denormals included) and compared through an integer
view, so "equal" means the copy is bitwise for every dtype. The first native call JIT-builds the extension
(~15-60 s once, then cached under ~/.cache/specdec).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from spec_kernels.compact_kv import compact_kv_
from spec_kernels.compact_kv.ref import compact_kv_ref
from spec_kernels.types import PAD_NODE

# a CUDA parametrisation: `pytest -m cuda` (bench/gpu.sh) selects it; skipped where there is no GPU
CUDA = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int32]
ROW_SHAPES = [(2, 8), (80,), (3, 5)]  # [Hkv, D], [D]; 3*5*2 B = 30 B rows force the CUDA kernel's narrow loads
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_BITS[t.element_size()])


def _random_cache(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    int_dtype = _BITS[torch.empty((), dtype=dtype).element_size()]
    info = torch.iinfo(int_dtype)
    return torch.randint(info.min, info.max, shape, dtype=int_dtype, generator=gen).view(dtype)


def _random_path(num_nodes: int, gen: torch.Generator) -> list[int]:
    """The root-to-node path of a random node in a random tree (parents[i] < i), as accepted_nodes lists it."""
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, num_nodes)]
    node = int(torch.randint(0, num_nodes, (1,), generator=gen))
    path = []
    while node != -1:
        path.append(node)
        node = parents[node]
    return path[::-1]


def _make_inputs(
    paths: list[list[int]],
    cache_seqlens: list[int],
    num_nodes: int,
    num_planes: int,
    capacity: int,
    row: tuple[int, ...],
    dtype: torch.dtype,
    gen: torch.Generator,
    block_size: int | None = None,
):
    """Cache and index tensors; with block_size, a paged cache whose block table is a random permutation."""
    batch = len(paths)
    accepted = torch.full((batch, num_nodes), PAD_NODE, dtype=torch.int64)  # [B, T]
    for b, path in enumerate(paths):
        accepted[b, : len(path)] = torch.tensor(path)
    num_accepted = torch.tensor([len(p) for p in paths], dtype=torch.int64)  # [B]
    cache_seqlens = torch.tensor(cache_seqlens, dtype=torch.int32)  # [B]
    if block_size is None:
        cache = _random_cache((num_planes, batch, capacity, *row), dtype, gen)  # [N, B, S, *row]
        return cache, cache_seqlens, accepted, num_accepted, None
    max_blocks = -(-capacity // block_size)
    num_blocks = batch * max_blocks + 3  # spare blocks that must stay untouched
    block_table = torch.randperm(num_blocks, generator=gen)[: batch * max_blocks].view(batch, max_blocks)
    cache = _random_cache((num_planes, num_blocks, block_size, *row), dtype, gen)  # [N, num_blocks, bs, *row]
    return cache, cache_seqlens, accepted, num_accepted, block_table.to(torch.int32)


def _check_against_ref(cache, cache_seqlens, accepted, num_accepted, block_table, device: str) -> torch.Tensor:
    """Run the native op on ``device`` and the reference on CPU; assert bitwise equality. Returns the result."""
    expected = cache.clone()
    compact_kv_ref(expected, cache_seqlens, accepted, num_accepted, block_table=block_table)
    got = cache.to(device, copy=True)
    table = None if block_table is None else block_table.to(device)
    compact_kv_(got, cache_seqlens.to(device), accepted.to(device), num_accepted.to(device), block_table=table)
    assert torch.equal(_bits(got.cpu()), _bits(expected))
    return expected


def _naive(cache, cache_seqlens, accepted, num_accepted, block_table=None) -> torch.Tensor:
    """The contract's definition (docs/ARCHITECTURE.md), one row at a time."""
    old, out = cache.clone(), cache.clone()

    def slot(b: int, pos: int) -> tuple[int, int]:
        if block_table is None:
            return b, pos
        block_size = cache.shape[2]
        return int(block_table[b, pos // block_size]), pos % block_size

    for n in range(cache.shape[0]):
        for b in range(len(cache_seqlens)):
            base = int(cache_seqlens[b])
            for t in range(int(num_accepted[b])):
                out[(n, *slot(b, base + t))] = old[(n, *slot(b, base + int(accepted[b, t])))]
    return out


@pytest.mark.parametrize("block_size", [None, 4])
def test_ref_matches_naive_loop(block_size):
    gen = torch.Generator().manual_seed(0)
    paths = [[0, 1, 3, 4], [0, 2], [0], [0, 1, 2]]
    cache, cache_seqlens, accepted, num, table = _make_inputs(
        paths, [5, 0, 9, 2], 6, 2, 16, (2, 3), torch.float32, gen, block_size
    )
    expected = _naive(cache, cache_seqlens, accepted, num, table)
    compact_kv_ref(cache, cache_seqlens, accepted, num, block_table=table)
    assert torch.equal(_bits(cache), _bits(expected))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block_size", [None, 4])
@pytest.mark.parametrize("row", ROW_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_random_trees(dtype, row, block_size, device):
    gen = torch.Generator().manual_seed(hash((str(dtype), row, block_size)) % 2**31)
    num_nodes, batch = 8, 5
    paths = [_random_path(num_nodes, gen) for _ in range(batch)]
    cache_seqlens = torch.randint(0, 9, (batch,), generator=gen).tolist()
    inputs = _make_inputs(paths, cache_seqlens, num_nodes, 4, 17, row, dtype, gen, block_size)
    _check_against_ref(*inputs, device)


ADVERSARIAL = {
    "skip_one": [[0, 1, 3, 4], [0, 2, 3]],
    "deep_leaf": [[0, 5, 6, 7], [0, 7]],
    "root_only_and_full": [[0], [0, 3, 5, 6, 7]],
    # Not topological (no tree yields them), but the op is defined for any index list; these defeat an in-order
    # copy without staging, so they prove the read-before-write.
    "backwards": [[2, 0, 1], [0, 3, 1, 2]],
    "repeated_source": [[0, 4, 4, 4], [1, 1]],
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block_size", [None, 3])
@pytest.mark.parametrize("case", ADVERSARIAL)
def test_overlapping_paths(case, block_size, device):
    gen = torch.Generator().manual_seed(1)
    inputs = _make_inputs(ADVERSARIAL[case], [4, 1], 8, 3, 14, (2, 8), torch.float16, gen, block_size)
    expected = _check_against_ref(*inputs, device)
    assert torch.equal(_bits(expected), _bits(_naive(*inputs)))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block_size", [None, 4])
@pytest.mark.parametrize("paths", [[[0, 1, 2, 3], [0, 1]], [[0], [0]]], ids=["chain", "num_accepted_1"])
def test_nothing_moves(paths, block_size, device):
    gen = torch.Generator().manual_seed(2)
    inputs = _make_inputs(paths, [3, 6], 4, 2, 12, (4, 8), torch.bfloat16, gen, block_size)
    cache, cache_seqlens, accepted, num, table = inputs
    original = cache.clone()
    result = _check_against_ref(cache, cache_seqlens, accepted, num, table, device)
    assert torch.equal(_bits(result), _bits(original))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_path_crosses_blocks(dtype, device):
    gen = torch.Generator().manual_seed(3)
    # block_size 4, L = 3 and 6: sources at slots 4..10 and destinations at 3..8 straddle block boundaries.
    paths = [[0, 2, 5, 7], [0, 1, 2, 4, 5]]
    cache, cache_seqlens, accepted, num, table = _make_inputs(paths, [3, 6], 8, 2, 16, (2, 8), dtype, gen, 4)
    original = cache.clone()
    result = _check_against_ref(cache, cache_seqlens, accepted, num, table, device)
    touched = torch.zeros(cache.shape[1], dtype=torch.bool)
    touched[table.flatten().long()] = True
    assert torch.equal(_bits(result[:, ~touched]), _bits(original[:, ~touched]))  # spare blocks untouched


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("batch", [1, 3])
def test_all_planes_of_a_model(batch, device):
    """N = 2 x 32 layers in one call."""
    gen = torch.Generator().manual_seed(4)
    paths = [_random_path(8, gen) for _ in range(batch)]
    inputs = _make_inputs(paths, [7] * batch, 8, 64, 16, (2, 16), torch.float16, gen)
    _check_against_ref(*inputs, device)


@pytest.mark.parametrize("device", DEVICES)
def test_int32_indices_and_seqlens_at_the_end(device):
    gen = torch.Generator().manual_seed(5)
    cache, cache_seqlens, accepted, num, _ = _make_inputs([[0, 2, 3]], [12], 4, 2, 16, (8,), torch.float32, gen)
    _check_against_ref(cache, cache_seqlens, accepted.int(), num.int(), None, device)  # last slot S-1 = 12 + 3


def _valid_inputs():
    gen = torch.Generator().manual_seed(6)
    return _make_inputs([[0, 2], [0, 1, 3]], [2, 4], 4, 2, 10, (4,), torch.float32, gen)


def _bad_inputs(kind: str):
    cache, cache_seqlens, accepted, num, _ = _valid_inputs()
    table = None
    if kind == "batch_size":
        accepted = torch.cat([accepted, accepted[:1]])
    elif kind == "float_indices":
        accepted = accepted.float()
    elif kind == "past_the_cache":
        accepted[1, 2] = 6  # slot 4 + 6 = 10 == S
    elif kind == "past_the_block_table":
        cache = cache.view(2, 5, 4, 4)  # 5 blocks of 4 slots
        table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)  # 8 slots per sequence: 4 + 3 = 7 fits
        accepted[1, 2] = 4  # slot 8: past the block table
    elif kind == "bad_block_id":
        cache = cache.view(2, 5, 4, 4)
        table = torch.tensor([[0, 1], [2, 9]], dtype=torch.int32)
    elif kind == "device":
        cache_seqlens = cache_seqlens.to("meta")
    elif kind == "rank":
        cache = cache[0, 0]
    elif kind == "non_contiguous":
        cache = cache.transpose(2, 3)
    elif kind == "padding_inside_path":
        accepted[1, 1] = PAD_NODE
    return cache, cache_seqlens, accepted, num, table


BAD = {
    "batch_size": (ValueError, "batch"),
    "float_indices": (TypeError, "int32 or int64"),
    "past_the_cache": (ValueError, "past the cache"),
    "past_the_block_table": (ValueError, "past the cache"),
    "bad_block_id": (ValueError, "outside the cache's 5 blocks"),
    "device": (ValueError, "meta"),
    "rank": (ValueError, r"\[N, B, S, \.\.\.\]"),
    "non_contiguous": (ValueError, "contiguous"),
    "padding_inside_path": (ValueError, "padding"),
}


@pytest.mark.parametrize("backend", ["native", "torch"])
@pytest.mark.parametrize("kind", BAD)
def test_bad_inputs_raise(kind, backend):
    cache, cache_seqlens, accepted, num, table = _bad_inputs(kind)
    error, match = BAD[kind]
    with pytest.raises(error, match=match):
        compact_kv_(cache, cache_seqlens, accepted, num, block_table=table, backend=backend)


@pytest.mark.parametrize("kind", BAD)
def test_cpp_checks_raise(kind):
    """The C++ op checks on its own too, with the same error types (callers may use torch.ops directly)."""
    from spec_kernels._ext import load_ext

    load_ext()
    cache, cache_seqlens, accepted, num, table = _bad_inputs(kind)
    error, match = BAD[kind]
    with pytest.raises(error, match=match):
        torch.ops.spec_kernels.compact_kv_(cache, cache_seqlens, accepted, num, table)


def test_meta_kernel_checks_shapes_only():
    from spec_kernels._ext import load_ext

    load_ext()
    cache, cache_seqlens, accepted, num = (t.to("meta") for t in _valid_inputs()[:4])
    compact_kv_(cache, cache_seqlens, accepted, num)
    with pytest.raises(ValueError, match="batch"):
        torch.ops.spec_kernels.compact_kv_(cache, cache_seqlens[:1], accepted, num, None)


def test_backend_choices():
    cache, cache_seqlens, accepted, num, _ = _valid_inputs()
    with pytest.raises(ValueError, match="no Triton backend"):
        compact_kv_(cache, cache_seqlens, accepted, num, backend="triton")
    with pytest.raises(ValueError, match="unknown backend"):
        compact_kv_(cache, cache_seqlens, accepted, num, backend="cuda")
    expected = cache.clone()
    compact_kv_(expected, cache_seqlens, accepted, num, backend="torch")
    for backend in (None, "native"):
        got = cache.clone()
        compact_kv_(got, cache_seqlens, accepted, num, backend=backend)
        assert torch.equal(_bits(got), _bits(expected))
    assert not torch.equal(_bits(expected), _bits(cache))


def _run_python(code: str, timeout: float = 120, **env: str) -> str:
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        cwd=Path(__file__).resolve().parent.parent,  # the checkout, so `import spec_kernels` works uninstalled
        timeout=timeout,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_import_does_not_build(tmp_path):
    out = _run_python(
        """
        import sys
        import spec_kernels, spec_kernels._ext as ext
        print(ext.is_loaded(), any(m.startswith("specdec_ext_") for m in sys.modules))
        """,
        SPECDEC_CACHE=str(tmp_path),
    )
    assert out.split() == ["False", "False"]
    assert not any(tmp_path.iterdir())


def test_python_custom_op_coexists():
    """A torch.library.custom_op in the spec_kernels namespace works registered before and after the extension."""
    out = _run_python(
        """
        import torch
        from spec_kernels._ext import load_ext

        @torch.library.custom_op("spec_kernels::_probe_before", mutates_args=())
        def before(x: torch.Tensor) -> torch.Tensor:
            return x + 1

        load_ext()

        @torch.library.custom_op("spec_kernels::_probe_after", mutates_args=())
        def after(x: torch.Tensor) -> torch.Tensor:
            return x + 2

        cache = torch.arange(8.0).view(1, 1, 8, 1)
        one = torch.ones(1, dtype=torch.int64)
        torch.ops.spec_kernels.compact_kv_(cache, one, torch.tensor([[0, 2]]), 2 * one, None)
        x = torch.zeros(1)
        print(int(torch.ops.spec_kernels._probe_before(x)), int(torch.ops.spec_kernels._probe_after(x)))
        print(cache.flatten().tolist())
        """
    )
    assert out.splitlines() == ["1 2", "[0.0, 1.0, 3.0, 3.0, 4.0, 5.0, 6.0, 7.0]"]


def test_a_build_killed_midway_does_not_stall_later_loads():
    """torch's load() waits while a lock file of its own exists in the build folder; a process killed while
    building leaves it behind. The next process loads the extension anyway (the file is removed under our lock)."""
    import importlib.util

    from spec_kernels import _ext

    if importlib.util.find_spec(_ext.AOT_MODULE) is not None:
        pytest.skip("the extension is built ahead of time: no build folder is loaded")
    from filelock import FileLock

    _ext.load_ext()  # the folder exists, the module is built
    build_dir = _ext.cache_root() / f"ext-{_ext._build_key(_ext.with_cuda())}"
    stale = build_dir / "lock"
    with FileLock(str(build_dir / "build.lock")):  # (no other process is in a load while it is planted)
        stale.touch()
    try:
        out = _run_python("from spec_kernels._ext import load_ext; load_ext(); print('loaded')", timeout=60)
    finally:
        stale.unlink(missing_ok=True)
    assert out.split() == ["loaded"]


def test_one_build_per_interpreter_file(tmp_path, monkeypatch):
    """A venv's `python`, `python3` and a console script's shebang name one binary by different links: they share
    one build folder (each name built its own, a full build each); another interpreter file does not."""
    from spec_kernels import _ext

    link = tmp_path / "python-link"
    link.symlink_to(os.path.realpath(sys.executable))
    key = _ext._build_key(False)
    monkeypatch.setattr(sys, "executable", str(link))
    assert _ext._build_key(False) == key
    other = tmp_path / "python-copy"
    other.write_bytes(b"")  # another file: another interpreter
    monkeypatch.setattr(sys, "executable", str(other))
    assert _ext._build_key(False) != key
