"""Tests of spec_kernels.quant_linear: GGUF blocks multiplied as stored. The blocks are made by gguf's own quantizer
where it has one (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1), else they are random bytes with random finite fp16 scales (every
type; gguf-py only dequantizes the K-quants).

The kernel's contract is exact: in float32 it is ``linear`` on the dequantized weights bit for bit (so batch-invariant
like it), and its dequantization is gguf.quants.dequantize's. Against the float64 reference the tolerance is measured
(STYLE.md 7): err(kernel) <= 2 * err(torch, same dtype) + ATOL[dtype]. With ``SPECDEC_QUANT_TILES=1`` on a CPU with
AMX, bfloat16 x times a K-quant runs on tiles instead, which sums each group's products before its scale: there it is
held to that tolerance and to batch invariance, not to linear's bits (test_narrower_cpu_paths runs this file so).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize, quantize  # noqa: E402

from spec_kernels.linear import linear  # noqa: E402
from spec_kernels.linear.cpu import native_path  # noqa: E402
from spec_kernels.quant_linear import QuantizedWeight, quant_linear, quant_type_name  # noqa: E402
from spec_kernels.quant_linear.ref import quant_linear_ref  # noqa: E402
from spec_kernels.types import QUANT_FORMATS, dequantize_ref  # noqa: E402

QTYPES = ["Q8_0", "Q4_0", "Q4_1"]  # the first types: the full grid of shapes and row counts below
NEW_QTYPES = ["Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]
ALL_QTYPES = QTYPES + NEW_QTYPES
DTYPES = [torch.float32, torch.bfloat16]
# Slack on top of 2x torch's own error, as in tests/test_linear.py (float32: ~1e-7 on outputs ~3; bfloat16: the
# output's rounding dominates both).
ATOL = {torch.float32: 1e-6, torch.bfloat16: 1e-3}
# [K, N]: odd N, SmolLM2's K (576 and 1536), one block, tails of rows past every tile width.
SHAPES = [(96, 111), (576, 192), (1536, 57), (32, 5), (64, 17)]
ROWS = [1, 2, 5, 8, 9, 16, 64]


def _quantized(n: int, k: int, qtype: str, seed: int) -> tuple[torch.Tensor, np.ndarray]:
    """gguf's blocks of a random [N, K] matrix (outputs ~ N(0, 1) for unit x), and the matrix."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, k)) / k**0.5).astype(np.float32)
    if qtype == "Q4_1":
        w += 0.02  # a nonzero block minimum
    return torch.from_numpy(quantize(w, gguf.GGMLQuantizationType[qtype])), w


def random_blocks(n: int, k: int, qtype: str, seed: int) -> torch.Tensor:
    """Random blocks ``uint8 [N, row_bytes]`` of a [N, K] matrix: every quant and sub-block scale bit random, the fp16
    fields random finite values of either sign from subnormal to ~8 (scaled by 1 / sqrt K so outputs stay O(1))."""
    f = QUANT_FORMATS[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n * k // f.block_weights, f.block_bytes), dtype=np.uint8)
    for off in f.fp16_offsets:
        magnitude = 2.0 ** rng.uniform(-26, 3, raw.shape[0]) / (k**0.5 * f.block_weights / 32)
        value = (magnitude * rng.choice([-1.0, 1.0], raw.shape[0])).astype(np.float16)
        raw[:, off : off + 2] = value.view(np.uint8).reshape(-1, 2)
    return torch.from_numpy(raw.reshape(n, -1))


def gguf_dequantized(blocks: torch.Tensor, qtype: str) -> torch.Tensor:
    return torch.from_numpy(dequantize(blocks.numpy(), gguf.GGMLQuantizationType[qtype]))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (signed zeros apart, NaN payloads alike), not merely ==."""
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


def on_tiles(qtype: str, dtype: torch.dtype) -> bool:
    """Whether this process multiplies bfloat16 x by K-quant blocks on AMX tiles (SPECDEC_QUANT_TILES=1 with AMX)."""
    if dtype is not torch.bfloat16 or QUANT_FORMATS[qtype].block_weights != 256:
        return False
    return os.environ.get("SPECDEC_QUANT_TILES") == "1" and native_path(torch.bfloat16)[0] == "amx"


def assert_close_to_float64(out, x, blocks, qtype, bias=None) -> None:
    """err(kernel) <= 2 err(torch, same dtype) + ATOL against float64 on the dequantized weights."""
    w = dequantize_ref(blocks, qtype).double()
    ref64 = F.linear(x.double(), w, None if bias is None else bias.double())
    err_kernel = (out.double() - ref64).abs().max().item()
    err_torch = (quant_linear_ref(x, blocks, qtype, bias=bias).double() - ref64).abs().max().item()
    assert err_kernel <= 2 * err_torch + ATOL[out.dtype], f"kernel {err_kernel:.3g} vs torch {err_torch:.3g}"


def _x(m: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("qtype", QTYPES + ["Q5_0", "Q5_1"])
def test_dequantize_matches_gguf(qtype):
    blocks, _ = _quantized(37, 160, qtype, 0)
    ref = gguf_dequantized(blocks, qtype)  # [N, K] float32
    assert same_bits(dequantize_ref(blocks, qtype), ref)
    qw = QuantizedWeight(blocks, qtype, (37, 160))
    assert torch.equal(qw.dequantize(), ref)
    idx = torch.tensor([[3, 0], [36, 3]])
    assert torch.equal(qw.rows(idx), ref[idx])


@pytest.mark.parametrize("qtype", ALL_QTYPES)
def test_dequantize_matches_gguf_on_random_blocks(qtype):
    """Every bit pattern of quants and sub-block scales, fp16 scales from subnormal up: gguf's float32 values bit for
    bit, from the reference and from the native kernel (a one-hot x reads one weight column exactly)."""
    k = QUANT_FORMATS[qtype].block_weights * 3
    for seed in range(3):
        blocks = random_blocks(41, k, qtype, seed)
        ref = gguf_dequantized(blocks, qtype)  # [N, K]
        assert torch.isfinite(ref).all()
        assert same_bits(dequantize_ref(blocks, qtype), ref), f"seed {seed}"
    columns = quant_linear(torch.eye(k), blocks, qtype, backend="native")  # [K, N]: column j is W[:, j]
    assert torch.equal(columns.T, ref)
    qw = QuantizedWeight(blocks, qtype, (41, k))
    assert qw.blocks.shape == (41, 3, QUANT_FORMATS[qtype].block_bytes)
    assert torch.equal(qw.rows(torch.tensor([40, 0, 7])), ref[[40, 0, 7]])


def _swap_scales(blocks: torch.Tensor, qtype: str) -> torch.Tensor:
    """A planted bug: the blocks a decoder that read two sub-blocks' scales the wrong way round would see (bytes 0 and
    1 of Q4_K's 6-bit scales, Q6_K's first two int8 group scales, Q2_K's first two scale bytes)."""
    f = QUANT_FORMATS[qtype]
    first = {"Q4_K": 4, "Q6_K": 192, "Q2_K": 0}[qtype]
    swapped = blocks.reshape(-1, f.block_bytes).clone()
    swapped[:, [first, first + 1]] = swapped[:, [first + 1, first]]
    return swapped.reshape(blocks.shape)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q2_K"])
def test_a_swapped_scale_is_caught(qtype):
    """The bit-equality checks above fail for a decoder that swaps two sub-block scales: the reference on the
    swapped blocks differs from gguf's values, and so does the kernel's product, from linear on the true ones."""
    k = QUANT_FORMATS[qtype].block_weights * 2
    blocks = random_blocks(33, k, qtype, 7)
    planted = _swap_scales(blocks, qtype)
    assert not same_bits(dequantize_ref(planted, qtype), gguf_dequantized(blocks, qtype))
    x = _x(3, k, torch.float32, 8)
    exact = linear(x, dequantize_ref(blocks, qtype), backend="native")
    assert not torch.equal(quant_linear(x, planted, qtype, backend="native"), exact)
    assert torch.equal(quant_linear(x, blocks, qtype, backend="native"), exact)


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_rows", ROWS)
@pytest.mark.parametrize("k,n", SHAPES)
def test_is_linear_on_dequantized_weights(qtype, dtype, num_rows, k, n):
    """Bitwise ``linear`` (float32) on gguf's dequantized weights, bias last, one rounding; close to float64."""
    blocks, _ = _quantized(n, k, qtype, k + n)
    x = _x(num_rows, k, dtype, num_rows)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(dtype) if num_rows % 2 else None
    out = quant_linear(x, blocks, qtype, bias=bias, backend="native")  # [M, N]
    assert out.shape == (num_rows, n) and out.dtype == dtype
    w = dequantize_ref(blocks, qtype)  # [N, K] float32
    exact = linear(x.float(), w, None if bias is None else bias.float(), backend="native").to(dtype)
    assert torch.equal(out, exact)
    ref64 = F.linear(x.double(), w.double(), None if bias is None else bias.double())
    err_kernel = (out.double() - ref64).abs().max().item()
    err_torch = (quant_linear_ref(x, blocks, qtype, bias=bias).double() - ref64).abs().max().item()
    assert err_kernel <= 2 * err_torch + ATOL[dtype], f"kernel {err_kernel:.3g} vs torch {err_torch:.3g}"


@pytest.mark.parametrize("qtype", NEW_QTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_rows", [1, 3, 9, 17, 40])  # fused 1-8, two fused chunks 9-16, the panel beyond
def test_new_types_are_linear_on_dequantized_weights(qtype, dtype, num_rows):
    """As above for the formats added later, on random blocks: K of one block and of several (SmolLM2's 1536 is 6
    K-quant super-blocks), N with tails past every tile width."""
    block = QUANT_FORMATS[qtype].block_weights
    for k, n in [(block, 37), (1536 if block == 256 else 96, 19)]:
        blocks = random_blocks(n, k, qtype, k + n)
        x = _x(num_rows, k, dtype, num_rows)
        bias = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(dtype) if num_rows % 2 else None
        out = quant_linear(x, blocks, qtype, bias=bias, backend="native")  # [M, N]
        if on_tiles(qtype, dtype):
            assert_close_to_float64(out, x, blocks, qtype, bias)
            continue
        w = dequantize_ref(blocks, qtype)  # [N, K]
        exact = linear(x.float(), w, None if bias is None else bias.float(), backend="native").to(dtype)
        assert torch.equal(out, exact), f"K = {k}"


@pytest.mark.parametrize("qtype", ALL_QTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_batch_invariant(qtype, dtype):
    """Row i alone, in any prefix batch, beside other rows, on one thread or several: the same bits."""
    k, n = (192 if QUANT_FORMATS[qtype].block_weights == 32 else 512), 200
    blocks = random_blocks(n, k, qtype, 1)
    x = _x(64, k, dtype, 2)
    full = quant_linear(x[:16], blocks, qtype, backend="native")  # [16, N]
    for i in range(16):
        assert torch.equal(quant_linear(x[i : i + 1], blocks, qtype, backend="native")[0], full[i]), f"row {i}"
    for num_rows in range(1, 16):
        assert torch.equal(quant_linear(x[:num_rows], blocks, qtype, backend="native"), full[:num_rows])
    assert torch.equal(quant_linear(x, blocks, qtype, backend="native")[:16], full), "M = 64"
    others = torch.cat([x[:3], _x(5, k, dtype, 3)])
    assert torch.equal(quant_linear(others, blocks, qtype, backend="native")[:3], full[:3])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(quant_linear(x[:16], blocks, qtype, backend="native"), full), "one thread"
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q5_K", "Q2_K", "Q3_K"])
def test_verify_and_prompt_rows_are_batch_invariant(qtype):
    """bfloat16 x (the engine's dtype) at a verify pass's and a prompt chunk's row counts, on whichever path this
    process takes (tiles or the float path): every prefix of the rows gives the same bits as the whole call, on one
    thread too, N with a tail past every 16-row block, and each result close to float64; a decoder that swapped two
    sub-block scales would miss the tolerance. On the float path 300 rows of K = 2048 take the panel path in three
    chunks of x rows, and are linear's bits."""
    k, n = 2048, 200
    blocks = random_blocks(n, k, qtype, 11)
    x = _x(300, k, torch.bfloat16, 12)
    full = quant_linear(x, blocks, qtype, backend="native")  # [300, N]
    assert_close_to_float64(full, x, blocks, qtype)
    if not on_tiles(qtype, torch.bfloat16):
        exact = linear(x.float(), dequantize_ref(blocks, qtype), backend="native").to(torch.bfloat16)
        assert torch.equal(full, exact)
    for num_rows in (1, 2, 5, 8, 9, 16, 17, 33):
        assert torch.equal(quant_linear(x[:num_rows], blocks, qtype, backend="native"), full[:num_rows]), num_rows
    assert torch.equal(quant_linear(x[290:], blocks, qtype, backend="native"), full[290:]), "rows apart from the rest"
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(quant_linear(x[:17], blocks, qtype, backend="native"), full[:17]), "one thread"
    finally:
        torch.set_num_threads(threads)
    if qtype in ("Q4_K", "Q6_K", "Q2_K"):
        planted = quant_linear(x[:17], _swap_scales(blocks, qtype), qtype, backend="native")
        with pytest.raises(AssertionError):
            assert_close_to_float64(planted, x[:17], blocks, qtype)


def test_dispatch_and_quantized_weight():
    blocks, _ = _quantized(40, 64, "Q4_1", 4)
    x = _x(3, 64, torch.float32, 5)
    native = quant_linear(x, blocks, "Q4_1", backend="native")
    assert torch.equal(quant_linear(x, blocks, "q4_1"), native)  # None on CPU: native; names any case
    assert torch.equal(quant_linear(x, blocks, gguf.GGMLQuantizationType.Q4_1), native)  # ggml's ids
    assert torch.equal(quant_linear(x, blocks, "Q4_1", backend="torch"), quant_linear_ref(x, blocks, "Q4_1"))
    qw = QuantizedWeight(blocks, "Q4_1", (40, 64))
    assert torch.equal(linear(x, qw), native)  # linear dispatches on the weight's format
    x64 = x.double()  # no native float64: the reference
    assert torch.equal(quant_linear(x64, blocks, "Q4_1"), quant_linear_ref(x64, blocks, "Q4_1"))
    batched = x.reshape(1, 3, 64)  # [B, T, K]
    assert torch.equal(quant_linear(batched, blocks, "Q4_1").reshape(3, 40), native)
    top, bottom = QuantizedWeight(blocks[:10], "Q4_1", (10, 64)), QuantizedWeight(blocks[10:], "Q4_1", (30, 64))
    assert torch.equal(QuantizedWeight.cat([top, bottom]).data, blocks)
    meta = torch.ops.spec_kernels.quant_linear(x.to("meta"), blocks.to("meta"), 3, None)
    assert meta.shape == (3, 40)
    # the device path (meta stands in for CUDA): dequantized on the weight's device (a CPU buffer failed a CUDA
    # weight), then the batch-invariant Triton GEMM
    device = quant_linear(x.to("meta", torch.bfloat16), blocks.to("meta"), "Q4_1")
    assert device.shape == (3, 40) and device.device.type == "meta" and device.dtype == torch.bfloat16
    assert dequantize_ref(blocks.to("meta"), "Q4_1").device.type == "meta"
    k_blocks = torch.zeros(40, 2 * 144, dtype=torch.uint8, device="meta")  # Q4_K [40, 512]
    assert quant_linear(torch.randn(3, 512, device="meta"), k_blocks, "Q4_K").shape == (3, 40)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_quant_linear_is_the_reference_and_batch_invariant():
    blocks, _ = _quantized(40, 64, "Q4_1", 4)
    x = _x(33, 64, torch.float32, 5).to("cuda", torch.bfloat16)
    out = quant_linear(x, blocks.cuda(), "Q4_1")  # [33, 40]
    ref = quant_linear_ref(x.cpu(), blocks, "Q4_1").float()
    assert (out.cpu().float() - ref).abs().max().item() < 0.05
    assert all(torch.equal(quant_linear(x[i : i + 1], blocks.cuda(), "Q4_1")[0], out[i]) for i in (0, 17, 32))


@pytest.mark.parametrize(
    "case,error,match",
    [
        ("qtype", ValueError, "unsupported quantization type"),
        ("k_not_blocks", ValueError, "multiple of Q4_1's 32-weight block"),
        ("k_not_super_blocks", ValueError, "multiple of Q4_K's 256-weight block"),
        ("width", ValueError, r"must be \[N, 40\]"),
        ("weight_dtype", TypeError, "uint8"),
        ("bias_shape", ValueError, "bias must be"),
        ("x_dtype", TypeError, "float32 or bfloat16"),
        ("meta", ValueError, "CPU kernel"),
    ],
)
def test_errors(case, error, match):
    x, w, qtype, bias = torch.randn(2, 64), torch.zeros(5, 40, dtype=torch.uint8), "Q4_1", None
    if case == "qtype":
        qtype = "IQ4_NL"
    elif case == "k_not_blocks":
        x = torch.randn(2, 48)
    elif case == "k_not_super_blocks":
        x, qtype = torch.randn(2, 288), "Q4_K"  # 9 blocks of 32
    elif case == "width":
        w = torch.zeros(5, 41, dtype=torch.uint8)
    elif case == "weight_dtype":
        w = torch.zeros(5, 40, dtype=torch.int8)
    elif case == "bias_shape":
        bias = torch.randn(4)
    elif case == "x_dtype":
        x = x.double()
    elif case == "meta":
        x, w = x.to("meta"), w.to("meta")
    with pytest.raises(error, match=match):
        quant_linear(x, w, qtype, bias=bias, backend="native")
    with pytest.raises(ValueError, match="unsupported.*Q4_K, Q5_K, Q6_K"):
        quant_type_name(20)  # IQ4_NL: the error names what is taken
    assert quant_type_name(14) == quant_type_name(gguf.GGMLQuantizationType.Q6_K) == "Q6_K"
    with pytest.raises(ValueError, match="Q5_K's 256-weight block"):
        QuantizedWeight(torch.zeros(2, 88, dtype=torch.uint8), "Q5_K", (2, 128))
    from spec_kernels._ext import load_ext

    load_ext()  # the op itself: the checks above may raise before anything loads it (this test run alone)
    native = torch.ops.spec_kernels.quant_linear
    with pytest.raises(ValueError, match=r"unsupported GGML type id 20.*Q6_K \(14\)"):
        native(torch.randn(2, 64), torch.zeros(5, 36, dtype=torch.uint8), 20, None)
    with pytest.raises(ValueError, match="Q4_K|256-weight block"):
        native(torch.randn(2, 288), torch.zeros(5, 162, dtype=torch.uint8), 12, None)


def test_fake_tensor():
    blocks, _ = _quantized(24, 64, "Q8_0", 6)
    x = torch.randn(3, 64)
    checks = ("test_schema", "test_faketensor")
    torch.library.opcheck(torch.ops.spec_kernels.quant_linear.default, (x, blocks, 8, None), test_utils=checks)


@pytest.mark.parametrize("isa", ["avx2", "scalar", "tiles"])
def test_narrower_cpu_paths(isa):
    """SPECDEC_CPU_ISA caps the vector paths (chosen once per process): this file must pass on each, in a process of
    its own. On a CPU without AVX-512 the avx2 run repeats the suite's own path. "tiles" is the opt-in AMX path of
    the K-quants (SPECDEC_QUANT_TILES=1; the float path again on a CPU without AMX)."""
    if isa == "tiles":
        assert_passes_under_cpu_isa("tests/test_quant_linear.py", "", {"SPECDEC_QUANT_TILES": "1"})
    else:
        assert_passes_under_cpu_isa("tests/test_quant_linear.py", isa)


def assert_passes_under_cpu_isa(test_file: str, isa: str, env_extra: dict | None = None) -> None:
    """``test_file`` (all but its narrower_cpu_paths tests) passes in a process of its own whose vector paths
    ``SPECDEC_CPU_ISA`` caps at ``isa`` (no cap: ""), with ``env_extra`` set."""
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "SPECDEC_CPU_ISA": isa, **(env_extra or {})}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file,
           "-k", "not narrower_cpu_paths"]  # fmt: skip
    result = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert " passed" in result.stdout.splitlines()[-1], result.stdout[-500:]
