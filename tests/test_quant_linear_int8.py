"""Tests of quant_linear's 8-bit activation path (``activations="int8"``): x quantized per row and 32 weights to int8,
integer dot products with the GGUF blocks, a float32 epilogue per block (csrc/quant_int8_cpu.h).

The contract is exact: every native path (AMX-INT8, AVX512-VNNI, AVX2, scalar; SPECDEC_CPU_ISA caps it per
process) gives ``quant_linear_ref(..., activations="int8")`` bit for bit, a row's result depends on that row alone,
and a model in this mode speculates losslessly. Its distance from the float path is measured (STYLE.md 7) against
torch on the same int8 activations.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf_files import write_gguf  # noqa: E402
from test_engine_quantized import PROMPTS  # noqa: E402
from test_quant_linear import ALL_QTYPES, _x, assert_passes_under_cpu_isa, random_blocks, same_bits  # noqa: E402
from tiny_models import make_noisy_copy  # noqa: E402

import spec_kernels.quant_linear.ref as ref_module  # noqa: E402
from spec_engine import LLM, SamplingParams  # noqa: E402
from spec_engine.models import load_model  # noqa: E402
from spec_kernels.linear import linear  # noqa: E402
from spec_kernels.quant_linear import QuantizedWeight, int8_path, quant_linear  # noqa: E402
from spec_kernels.quant_linear.ref import quant_linear_ref, quantize_activations  # noqa: E402
from spec_kernels.types import QUANT_FORMATS, dequantize_ref  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16]
ROWS = [1, 5, 16, 17, 64]
# Slack on top of 2x torch's error on the same int8 activations (float32 sums of ~1e2 terms of O(1): ~1e-5).
ATOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _shapes(qtype: str) -> list[tuple[int, int]]:
    """[K, N]: a K of blocks not a multiple of 8 (or one super-block, and three), N past every tile's tail."""
    if QUANT_FORMATS[qtype].block_weights == 32:
        return [(96, 37), (1536, 16), (32, 5)]
    return [(256, 37), (768, 21)]


def _int8(x, blocks, qtype, **kw):
    return quant_linear(x, blocks, qtype, activations="int8", backend="native", **kw)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("qtype", ALL_QTYPES)
def test_matches_the_reference(qtype, threads):
    """Bit for bit the reference's integer math, every row count, one thread or two, with and without a bias."""
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for k, n in _shapes(qtype):
            blocks = random_blocks(n, k, qtype, k + n)
            bias = _x(1, n, torch.float32, 3)[0]
            for num_rows in ROWS:
                x = _x(num_rows, k, torch.float32, num_rows)
                for b in (None, bias):
                    out = _int8(x, blocks, qtype, bias=b)  # [M, N]
                    want = quant_linear_ref(x, blocks, qtype, bias=b, activations="int8")
                    assert same_bits(out, want), f"K={k} N={n} M={num_rows} bias={b is not None}"
    finally:
        torch.set_num_threads(saved)


def _decoding_x(m: int, k: int, seed: int) -> torch.Tensor:
    """x whose rows also hold an all-zero block and a block of tiny values (dx far below one, 1 / dx finite)."""
    x = _x(m, k, torch.float32, seed)
    x[:, :32] = 0
    if k >= 64:
        x[:, 32:64] *= 1e-30
    return x


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("qtype", ALL_QTYPES)
def test_decoding_rows(qtype, threads):
    """Up to 32 rows of x take the row-wise kernel, every format (AVX512-VNNI; AVX2 to 4), 8 rows a pass over each
    tile (past 8, each step's columns decoded once for all the passes), more the panel; past 8 rows, the AMX tiles
    where the CPU has them, 16 rows a pass: every M from 1 to 17
    (passes of 8, 8 and 1, or one of 16 and one of 1) and 32 gives the reference's bits, and row i of a 40-row call
    (the panel, or the tiles) is the 1-row call's on row i (the row-wise kernel), bit for bit. K of one block or
    super-block and of an odd number of them, N past every 16-row tile's tail."""
    block = QUANT_FORMATS[qtype].block_weights
    shapes = [(block, 37), (block * 3, 21)] if block == 256 else [(32, 19), (1056, 50)]
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for k, n in shapes:
            blocks = random_blocks(n, k, qtype, k + n + 1)
            x = _decoding_x(40, k, k)
            full = _int8(x, blocks, qtype)  # [40, N]
            for num_rows in [*range(1, 18), 32]:
                out = _int8(x[:num_rows], blocks, qtype)
                want = quant_linear_ref(x[:num_rows], blocks, qtype, activations="int8")
                assert same_bits(out, want), f"K={k} N={n} M={num_rows}"
                assert same_bits(out, full[:num_rows]), f"K={k} N={n} M={num_rows}: a prefix of the 40-row call"
            for i in range(40):
                assert same_bits(_int8(x[i : i + 1], blocks, qtype)[0], full[i]), f"K={k} N={n} row {i}"
    finally:
        torch.set_num_threads(saved)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K", "Q6_K", "Q2_K"])
def test_bfloat16_and_leading_dims(qtype):
    """A bfloat16 x is widened first and each output rounded once: the reference's float32 result, rounded."""
    k = 512
    blocks = random_blocks(19, k, qtype, 5)
    x = _x(6, k, torch.bfloat16, 6).reshape(2, 3, k)
    out = _int8(x, blocks, qtype)
    assert out.shape == (2, 3, 19) and out.dtype == torch.bfloat16
    assert torch.equal(out, quant_linear_ref(x, blocks, qtype, activations="int8"))


@pytest.mark.parametrize("qtype", ALL_QTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_batch_invariant(qtype, dtype):
    """Row i alone, in any prefix batch, beside other rows: the same bits (each row's int8 blocks are its own)."""
    k = 192 if QUANT_FORMATS[qtype].block_weights == 32 else 512
    blocks = random_blocks(45, k, qtype, 1)
    x = _x(64, k, dtype, 2)
    full = _int8(x[:17], blocks, qtype)  # [17, N]
    for i in range(17):
        assert torch.equal(_int8(x[i : i + 1], blocks, qtype)[0], full[i]), f"row {i}"
    for num_rows in (2, 5, 9, 16):
        assert torch.equal(_int8(x[:num_rows], blocks, qtype), full[:num_rows])
    assert torch.equal(_int8(x, blocks, qtype)[:17], full), "M = 64"
    others = torch.cat([x[:3], _x(5, k, dtype, 3)])
    assert torch.equal(_int8(others, blocks, qtype)[:3], full[:3])


def _largest_quants(n: int, k: int, qtype: str) -> torch.Tensor:
    """Blocks whose every quant takes the format's largest unsigned value (every quant bit and high bit set: Q4 15,
    Q5 31, Q6_K 63 ...; Q8_0 -128, the largest magnitude), the scales random: the largest integer sums there are."""
    f = QUANT_FORMATS[qtype]
    blocks = random_blocks(n, k, qtype, 7).view(-1, f.block_bytes).clone()
    scales = blocks[:, [off + i for off in f.fp16_offsets for i in (0, 1)]].clone()
    blocks[:] = 0x80 if qtype == "Q8_0" else 0xFF
    blocks[:, [off + i for off in f.fp16_offsets for i in (0, 1)]] = scales
    return blocks.reshape(n, -1)


@pytest.mark.parametrize("qtype", ALL_QTYPES)
def test_the_largest_integer_sums(qtype):
    """Every quant at its largest against x's at +-127 (one value per block, random in sign and size, so that
    blocks do not cancel): the AVX2 kernels add maddubs's int16 sums in int16 before widening (kInt16Sums), which
    would wrap here if they added one too many."""
    k = 512
    blocks = _largest_quants(11, k, qtype)
    per_block = _x(17, k // 32, torch.float32, 8)  # [17, K / 32]
    x = per_block.repeat_interleave(32, dim=1)  # [17, K]
    for num_rows in (1, 5, 17):
        out = _int8(x[:num_rows], blocks, qtype)
        assert same_bits(out, quant_linear_ref(x[:num_rows], blocks, qtype, activations="int8")), f"M={num_rows}"


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"])
def test_close_to_the_float_path(qtype):
    """Against float64 x @ W: the int8 path's error is at most 2x torch's on the same int8 activations (float64 on
    xq * dx) plus ATOL: only the activations' rounding moves it. The float path stays far closer."""
    k, n = 1024, 64
    blocks = random_blocks(n, k, qtype, 11)
    w = dequantize_ref(blocks, qtype).double()  # [N, K]
    x = _x(9, k, torch.float32, 12)
    exact = x.double() @ w.T  # [M, N]
    xq, dx = quantize_activations(x)
    torch_int8 = (xq.double() * dx.double()[..., None]).reshape(x.shape) @ w.T
    err = (_int8(x, blocks, qtype).double() - exact).abs().max().item()
    err_torch = (torch_int8 - exact).abs().max().item()
    assert err <= 2 * err_torch + ATOL[torch.float32], (err, err_torch)
    err_float = (quant_linear(x, blocks, qtype, backend="native").double() - exact).abs().max().item()
    assert err_float < err / 100, (err_float, err)


def test_a_wrong_block_scale_is_caught(monkeypatch):
    """The bit-equality check fails for a reference (or kernel) that reads one block's scale from the wrong place:
    here block 1's a takes block 0's in every row."""
    qtype, k = "Q4_K", 512
    blocks = random_blocks(20, k, qtype, 9)
    x = _x(5, k, torch.float32, 10)
    native = _int8(x, blocks, qtype)
    assert same_bits(native, quant_linear_ref(x, blocks, qtype, activations="int8"))
    true_blocks = ref_module.int_blocks

    def planted(weight, qt):
        b = true_blocks(weight, qt)
        a = b.a.clone()
        a[:, 1] = a[:, 0]
        return b._replace(a=a)

    monkeypatch.setattr(ref_module, "int_blocks", planted)
    assert not same_bits(native, quant_linear_ref(x, blocks, qtype, activations="int8"))


def test_errors():
    blocks = random_blocks(4, 64, "Q8_0", 0)
    x = _x(2, 64, torch.float32, 0)
    with pytest.raises(ValueError, match="activations must be one of"):
        quant_linear(x, blocks, "Q8_0", activations="int4")
    with pytest.raises(ValueError, match="activations must be one of"):
        quant_linear_ref(x, blocks, "Q8_0", activations="fp8")
    with pytest.raises(ValueError, match="activations must be one of"):
        QuantizedWeight(blocks, "Q8_0", (4, 64), activations="INT8")
    qw = QuantizedWeight(blocks, "Q8_0", (4, 64), activations="int8")
    assert qw.blocks.dtype == torch.int8  # what the native model ops take: the dtype carries the mode
    assert torch.equal(linear(x, qw), _int8(x, blocks, "Q8_0"))
    with pytest.raises(ValueError, match="share qtype, K and activations"):
        QuantizedWeight.cat([qw, QuantizedWeight(blocks, "Q8_0", (4, 64))])


# --- a model in int8 mode --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gguf_file(tied_llama_dir, tmp_path_factory) -> Path:
    return write_gguf(tmp_path_factory.mktemp("gguf") / "q4_1.gguf", tied_llama_dir, "Q4_1",
                      type_of={"model.embed_tokens.weight": "Q8_0"})  # fmt: skip


def _tokens(llm: LLM, max_tokens: int = 40, seed: int | None = None) -> list[list[int]]:
    temperature = 0.0 if seed is None else 0.8
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_speculation_is_plain_decoding(gguf_file, tied_llama_dir, tmp_path, dtype):
    """Lossless in int8 mode: n-gram and draft-model speculation emit plain decoding's tokens on the same weights,
    greedy and seeded (a seeded request's tokens are a function of prompt, parameters and seed)."""
    path = str(gguf_file)

    def int8_llm(spec=None):
        return LLM(path, dtype=dtype, quantization="gguf", quant_activations="int8", speculative_config=spec)

    llm = int8_llm()
    assert all(w.activations == "int8" for w in llm.target.quantized.values())
    assert llm.engine.runner.native_target is not None  # the native chains run the int8 blocks
    plain, seeded = _tokens(llm), _tokens(llm, seed=7)
    ngram = int8_llm({"method": "ngram", "num_speculative_tokens": 3})
    assert _tokens(ngram) == plain and _tokens(ngram, seed=7) == seeded
    draft = make_noisy_copy(tied_llama_dir, tmp_path / "draft", noise=0.3)
    model = int8_llm({"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3})
    assert _tokens(model) == plain and _tokens(model, seed=7) == seeded


def test_the_switch_reaches_the_kernels(gguf_file):
    """int8 mode's native forward runs the integer path: its logits differ from the float mode's, by little."""
    ids = torch.tensor([[5, 9, 13, 5, 9, 13, 70, 2]])
    from test_engine_quantized import _logits

    logits = {m: _logits(load_model(gguf_file, quantization="gguf", quant_activations=m).fuse(), ids)
              for m in ("float", "int8")}  # fmt: skip
    assert not torch.equal(logits["float"], logits["int8"])
    scale = logits["float"].abs().max()
    assert (logits["float"] - logits["int8"]).abs().max() < 0.05 * scale


def test_switch_errors(tied_llama_dir, gguf_file):
    with pytest.raises(ValueError, match="activations must be one of"):
        LLM(str(gguf_file), quantization="gguf", quant_activations="int4")
    with pytest.raises(ValueError, match="needs quantization='gguf'"):
        LLM(str(tied_llama_dir), quant_activations="int8")


@pytest.mark.parametrize("isa", ["avx512", "avx2", "scalar"])
def test_narrower_cpu_paths(isa):
    """SPECDEC_CPU_ISA caps the paths (chosen once per process): VNNI without AMX tiles (where this CPU has them: Zen 4,
    Intel before Sapphire Rapids), the AVX2 kernel (Zen 3, AVX-512 without VNNI) and the scalar one must pass this
    file too, in a process of their own."""
    if isa == "avx512" and int8_path() != "amx":
        pytest.skip("this process's own path is VNNI (or narrower) already")
    assert_passes_under_cpu_isa("tests/test_quant_linear_int8.py", isa)


def test_the_tiles_run_where_the_cpu_has_them():
    """A CPU with AMX-INT8 (the flag the kernel reads from CPUID, as /proc/cpuinfo lists it) multiplies on tiles."""
    flags = Path("/proc/cpuinfo").read_text().split() if Path("/proc/cpuinfo").exists() else []
    if "amx_int8" not in flags or "avx512_vnni" not in flags:
        pytest.skip("no AMX-INT8 here")
    if os.environ.get("SPECDEC_CPU_ISA") or os.environ.get("SPECDEC_LINEAR_SCALAR"):
        pytest.skip("the paths are capped in this process")
    assert int8_path() == "amx"


def test_the_kernels_prefetch():
    """Every compiled instantiation of the kernels that prefetch (the int8 row kernels rows16_vnni, rows16_passes
    and int8_rowwise_avx2, AMX's tiles16 and the panel's fill_panel; the bf16 / float32 tiles; attention's scores and
    weighted sums, AVX2's attend_avx2) holds prefetch instructions: with the row kernels' helper a plain inline
    function, GCC emitted none there (5a5ab6f): the same bits, far slower, which no test of values sees
    (bench/RESULTS-log.md, "A prefetch helper that was not inlined")."""
    import platform
    import re
    import shutil
    import subprocess

    from spec_kernels._ext import load_ext

    if platform.machine() not in ("x86_64", "AMD64") or shutil.which("objdump") is None:
        pytest.skip("the x86 kernels, read by objdump")
    library = load_ext().__file__
    listing = subprocess.run(["objdump", "-d", "-C", "--no-show-raw-insn", library], capture_output=True, text=True,
                             check=True, timeout=120).stdout  # fmt: skip
    int8 = "rows16_vnni|rows16_passes|tiles16|fill_panel|int8_rowwise_avx2"
    families = rf"::({int8}|tile_bf16|tile_f32|score_keys_avx512|weighted_sums?_avx512|attend_avx2)<"
    kernels: dict[str, int] = {}  # each instantiation of those kernels -> its prefetch instructions
    name = None
    for line in listing.splitlines():
        if m := re.match(r"^[0-9a-f]+ <(.*)>:$", line):
            name = m.group(1) if re.search(families, m.group(1)) else None
            if name is not None:
                kernels[name] = 0
        elif name is not None and "prefetch" in line:
            kernels[name] += 1
    assert len(kernels) >= 100, "the kernels were not found in the extension's listing"
    assert [k for k, n in kernels.items() if n == 0] == []
