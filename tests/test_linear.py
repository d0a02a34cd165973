"""Tests of spec_kernels.linear: the native small-M CPU kernel against F.linear and a float64 reference.

Tolerances are measured (docs/ARCHITECTURE.md, conventions): err(kernel) <= 2 * err(torch, same dtype) + ATOL[dtype],
both against float64.
Batch invariance is exact: a row's output must not depend on M or on the other rows. The first native call JIT-builds
the extension (~15-60 s once, then cached under ~/.cache/specdec).
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from spec_kernels.linear import linear, native_path
from spec_kernels.linear import native_path as linear_native_path
from spec_kernels.linear.ref import linear_ref

DTYPES = [torch.float32, torch.bfloat16]
# Slack on top of 2x torch's own error. Measured over test_matches_reference's cases: err(kernel) - 2 * err(torch) is
# at most -2e-8 in fp32 (both ~1e-7 on outputs ~3) and -4e-3 in bf16 (both dominated by the output's rounding).
ATOL = {torch.float32: 1e-6, torch.bfloat16: 1e-3}
# [K, N]: the default target's matrices (qkv, o, down, lm_head), odd sizes, K below one vector, an odd K; K a multiple
# of 32 with N = 64 + 2 x 16 + 4 and 2 x 16 + 8 (the AMX path's 64-row, 16-row and shorter tiles).
SHAPES = [(320, 448), (864, 320), (200, 111), (320, 4096), (33, 1728), (7, 17), (96, 100), (64, 40)]
ROWS = [1, 2, 5, 16, 17, 64]


def _inputs(num_rows: int, k: int, n: int, dtype: torch.dtype, bias: bool, gen: torch.Generator):
    x = torch.randn(num_rows, k, generator=gen).to(dtype)  # [M, K]
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)  # [N, K]: outputs ~ N(0, 1)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None  # [N]
    return x, w, b


def _assert_close_to_ref(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    err_kernel = (out.double() - ref).abs().max().item()
    err_torch = (F.linear(x, w, b).double() - ref).abs().max().item()
    assert err_kernel <= 2 * err_torch + ATOL[x.dtype], f"kernel {err_kernel:.3g} vs torch {err_torch:.3g}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_rows", ROWS)
@pytest.mark.parametrize("k,n", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_matches_reference(dtype, num_rows, k, n, bias):
    gen = torch.Generator().manual_seed(num_rows * 1000 + k + n)
    x, w, b = _inputs(num_rows, k, n, dtype, bias, gen)
    out = linear(x, w, b, backend="native")  # [M, N]
    assert out.shape == (num_rows, n) and out.dtype == dtype
    _assert_close_to_ref(out, x, w, b)


@pytest.mark.parametrize("dtype", DTYPES)
# SmolLM2-135M's qkv [960, 576] and down [576, 1536] too: every M from 1 to 16 cuts x into different chunks of rows
@pytest.mark.parametrize("k,n", [(320, 448), (864, 1728), (200, 111), (320, 4096), (33, 17), (576, 960), (1536, 576),
                                 (96, 100)])  # fmt: skip
def test_batch_invariant(dtype, k, n):
    """Row i's output is bitwise the same alone, in any prefix batch, beside other rows (M <= 64, and a prompt's 300
    rows: the widening path's panels of 128), on any threads."""
    gen = torch.Generator().manual_seed(k + n)
    x, w, b = _inputs(300, k, n, dtype, True, gen)
    full = linear(x[:16], w, b, backend="native")  # [16, N]
    for i in range(16):
        assert torch.equal(linear(x[i : i + 1], w, b, backend="native")[0], full[i]), f"row {i} alone"
    for num_rows in range(1, 16):
        assert torch.equal(linear(x[:num_rows], w, b, backend="native"), full[:num_rows]), f"M = {num_rows}"
    assert torch.equal(linear(x[:64], w, b, backend="native")[:16], full), "M = 64"
    prompt = linear(x, w, b, backend="native")  # [300, N]
    assert torch.equal(prompt[:16], full), "M = 300"
    assert torch.equal(prompt[290], linear(x[290:291], w, b, backend="native")[0]), "row 290 alone"
    others = torch.cat([x[:3], torch.randn(5, k, generator=gen).to(dtype)])  # row 0-2 beside different rows
    assert torch.equal(linear(others, w, b, backend="native")[:3], full[:3])
    threads = torch.get_num_threads()  # how N is split across threads changes nothing either
    try:
        torch.set_num_threads(1)
        assert torch.equal(linear(x[:16], w, b, backend="native"), full), "one thread"
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_and_batched_x(dtype):
    gen = torch.Generator().manual_seed(1)
    base, w, b = _inputs(6, 400, 111, dtype, True, gen)
    sliced = base[:, 50:250]  # [6, 200], row stride 400: read in place
    w = w[:, :200].contiguous()
    _assert_close_to_ref(linear(sliced, w, b, backend="native"), sliced, w, b)
    transposed = torch.randn(200, 5, generator=gen).to(dtype).t()  # [5, 200], inner stride 5: copied
    _assert_close_to_ref(linear(transposed, w, b, backend="native"), transposed, w, b)
    batched = torch.randn(2, 3, 200, generator=gen).to(dtype)  # [B, T, K]
    out = linear(batched, w, b, backend="native")  # [B, T, N]
    assert out.shape == (2, 3, 111)
    assert torch.equal(out, linear(batched.reshape(6, 200), w, b, backend="native").reshape(2, 3, 111))
    _assert_close_to_ref(out, batched, w, b)
    prefill = torch.randn(130, 200, generator=gen).to(dtype)  # M > 64 runs when asked for explicitly
    _assert_close_to_ref(linear(prefill, w, b, backend="native"), prefill, w, b)


def test_dispatch():
    gen = torch.Generator().manual_seed(2)
    x, w, b = _inputs(4, 64, 40, torch.float32, True, gen)
    assert torch.equal(linear(x, w, b), linear(x, w, b, backend="native"))  # small M on CPU: native
    assert torch.equal(linear(x, w, b, backend="torch"), linear_ref(x, w, b))
    big = torch.randn(130, 64, generator=gen)  # prefill-sized M: native in float32 (faster, batch-invariant)
    assert torch.equal(linear(big, w, b), linear(big, w, b, backend="native"))
    big16, w16, b16 = big.bfloat16(), w.bfloat16(), b.bfloat16()  # bfloat16 past 64 rows: torch's GEMM
    assert torch.equal(linear(big16, w16, b16), F.linear(big16, w16, b16))
    x64, w64 = x.double(), w.double()  # other dtypes: F.linear
    assert torch.equal(linear(x64, w64), F.linear(x64, w64))
    w_t = w.t().contiguous().t()  # a non-contiguous weight: F.linear
    assert torch.equal(linear(x, w_t, b), F.linear(x, w_t, b))
    out = linear(x.to("meta"), w.to("meta"), b.to("meta"))  # meta: F.linear, which only computes shapes
    assert out.device.type == "meta" and out.shape == (4, 40)
    native_meta = torch.ops.spec_kernels.linear(x.to("meta"), w.to("meta"), None)  # the op's Meta kernel
    assert native_meta.shape == (4, 40) and native_meta.dtype == torch.float32


@pytest.mark.parametrize(
    "case,error,match",
    [
        ("float64", TypeError, "float32 or bfloat16"),
        ("int32", TypeError, "float32 or bfloat16"),
        ("mixed_dtype", TypeError, "weight is"),
        ("bias_dtype", TypeError, "bias is"),
        ("k_mismatch", ValueError, "has K = "),
        ("weight_rank", ValueError, "weight must be"),
        ("bias_shape", ValueError, "bias must be"),
        ("weight_strided", ValueError, "contiguous"),
        ("meta", ValueError, "CPU kernel"),
        ("scalar_x", ValueError, "0-d"),
    ],
)
def test_native_errors(case, error, match):
    x, w, b = torch.randn(3, 8), torch.randn(5, 8), torch.randn(5)
    if case == "float64":
        x, w, b = x.double(), w.double(), b.double()
    elif case == "int32":
        x, w, b = x.int(), w.int(), b.int()
    elif case == "mixed_dtype":
        w = w.bfloat16()
    elif case == "bias_dtype":
        b = b.bfloat16()
    elif case == "k_mismatch":
        w = torch.randn(5, 9)
    elif case == "weight_rank":
        w = w[None]
    elif case == "bias_shape":
        b = torch.randn(4)
    elif case == "weight_strided":
        w = torch.randn(8, 5).t()
    elif case == "meta":
        x, w, b = x.to("meta"), w.to("meta"), b.to("meta")
    elif case == "scalar_x":
        x = torch.tensor(1.0)
    with pytest.raises(error, match=match):
        linear(x, w, b, backend="native")


def test_unknown_backends():
    x, w = torch.randn(2, 8), torch.randn(3, 8)
    with pytest.raises(ValueError, match="backend='triton' takes"):
        linear(x.double(), w.double(), backend="triton")
    with pytest.raises(ValueError, match="unknown backend"):
        linear(x, w, backend="cuda")


def test_fake_tensor_and_compile():
    """The op traces: its Meta kernel serves fake tensors, and torch.compile keeps it in one graph."""
    x, w, b = torch.randn(3, 40), torch.randn(24, 40), torch.randn(24)
    checks = ("test_schema", "test_faketensor")
    torch.library.opcheck(torch.ops.spec_kernels.linear.default, (x, w, b), test_utils=checks)
    compiled = torch.compile(lambda x, w, b: linear(x, w, b).relu(), backend="eager", fullgraph=True)
    assert torch.equal(compiled(x, w, b), linear(x, w, b).relu())
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:  # eager calls take the extension's direct entry, which still dispatches
        out = linear(mode.from_tensor(x), mode.from_tensor(w), mode.from_tensor(b))
    assert out.shape == (3, 24) and out.dtype == torch.float32


# --- the Triton kernel (CUDA's path): under the interpreter here, on a GPU in bench/gpu.sh ---------------------------

CUDA = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _interpreted() -> bool:
    """True when the Triton kernel was decorated under TRITON_INTERPRET=1 (CPU tensors can run it)."""
    lt = importlib.import_module("spec_kernels.linear.triton")  # the package's name is the function

    if not lt.triton_available():
        return False
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(lt._linear_kernel, InterpretedFunction)


INTERPRETED = pytest.mark.skipif(not _interpreted(), reason="needs Triton's interpreter (TRITON_INTERPRET=1)")
TRITON_DEVICES = [pytest.param("cpu", marks=INTERPRETED), pytest.param("cuda", marks=CUDA)]
TRITON_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("dtype", TRITON_DTYPES)
@pytest.mark.parametrize("k,n", [(200, 111), (64, 40), (320, 448)])
def test_triton_matches_reference_and_is_batch_invariant(device, dtype, k, n):
    """The Triton kernel against float64 (2x torch's own error), and batch-invariant bit for bit: each row of an
    M-row call (M across one, two and three row blocks) is the 1-row call's."""
    gen = torch.Generator().manual_seed(k + n)
    x, w, b = (t.to(device) for t in _inputs(70, k, n, torch.float32, True, gen))
    x, w, b = x.to(dtype), w.to(dtype), b.to(dtype)
    out = linear(x, w, b, backend="triton")  # [70, N]
    assert out.shape == (70, n) and out.dtype == dtype
    ref = F.linear(x.double(), w.double(), b.double())
    err_torch = (F.linear(x.float(), w.float(), b.float()).to(dtype).double() - ref).abs().max().item()
    assert (out.double() - ref).abs().max().item() <= 2 * err_torch + {torch.float32: 1e-5}.get(dtype, 2e-3)
    for rows in (slice(0, 1), slice(3, 8), slice(30, 63)):
        assert torch.equal(linear(x[rows], w, b, backend="triton"), out[rows])
    for i in (0, 33, 69):
        assert torch.equal(linear(x[i : i + 1], w, b, backend="triton")[0], out[i])


@INTERPRETED
def test_triton_planted_config_by_m_is_caught(monkeypatch):
    """The invariance check has teeth: a kernel whose K tile changes with M (as cuBLAS's choice does) parts rows."""
    lt = importlib.import_module("spec_kernels.linear.triton")  # the package's name is the function

    gen = torch.Generator().manual_seed(3)
    x, w, b = _inputs(40, 200, 111, torch.float32, True, gen)
    out = linear(x, w, b, backend="triton")
    monkeypatch.setitem(lt.CONFIGS, torch.float32, (32, 32, 32, 4, 3))
    assert not torch.equal(linear(x[:1], w, b, backend="triton")[0], out[0])


def test_cuda_default_is_the_triton_kernel_and_meta_shapes():
    """backend=None on device tensors takes the Triton custom op: on meta (the simulated GPU) its fake output."""
    x = torch.empty(5, 64, device="meta", dtype=torch.bfloat16)
    out = linear(x, torch.empty(40, 64, device="meta", dtype=torch.bfloat16))
    assert out.shape == (5, 40) and out.device.type == "meta" and out.dtype == torch.bfloat16


@pytest.mark.parametrize(
    "setting",
    [{"SPECDEC_CPU_ISA": "avx512", "SPECDEC_BF16_LINEAR": "dot"},
     {"SPECDEC_CPU_ISA": "avx512", "SPECDEC_BF16_LINEAR": "widen"},
     {"SPECDEC_CPU_ISA": "avx2"}, {"SPECDEC_CPU_ISA": "scalar"}],
    ids=["avx512-dot", "avx512-widen", "avx2", "scalar"],
)  # fmt: skip
def test_narrower_cpu_paths(setting):
    """SPECDEC_CPU_ISA caps the kernels' vector paths at AVX-512 without AMX tiles (Intel before Sapphire Rapids, AMD
    Zen 4-5), at AVX2 (CPUs without AVX-512: AMD Zen 1-3, older Intel) or at the scalar one (no AVX2, other
    architectures); SPECDEC_BF16_LINEAR picks the AVX-512 bfloat16 path that vdpbf16ps's speed would pick on another
    CPU (dot products, or bfloat16 widened to float32 FMAs). The native kernels' tests (float64 references, batch
    invariance, tree nodes bitwise equal to plain decoding, greedy acceptance) must pass on each, in a process of its
    own (the path is chosen once per process). A run capped above this CPU's own path repeats the suite's."""
    root = Path(__file__).resolve().parent.parent
    files = ["tests/test_linear.py", "tests/test_decoder_layers.py", "tests/test_verify_tree.py",
             "tests/test_gemma_layers.py"]  # fmt: skip
    env = {**os.environ, **setting}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files,
           "-k", "not triton and not interpret and not narrower_cpu_paths"]  # fmt: skip
    result = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert " passed" in result.stdout.splitlines()[-1], result.stdout[-500:]


def test_bfloat16_outputs_round_as_torch_rounds():
    """A bfloat16 output is its float32 sum rounded to nearest even, as torch converts (NaN: c10::BFloat16's 0x7FC0,
    where torch's vector conversion writes 0xFFFF): sums whose low 16 bits sit just below, at and just above halfway,
    each the exact sum of three bfloat16 parts. The rounding is simd::round_bf16, which the layer stack's activation
    and norms also store through."""
    gen = torch.Generator().manual_seed(0)
    high = torch.randint(0x3C00, 0x4400, (48,), generator=gen, dtype=torch.int32) << 16
    low = torch.tensor([0x7FFF, 0x8000, 0x8001, 0x0000, 0xFFFF, 0x0001], dtype=torch.int32).repeat(8)
    sign = torch.randint(0, 2, (48,), generator=gen) * 2 - 1
    sums = (high | low).view(torch.float32) * sign  # [48] float32, exactly

    def truncated(v):  # the top 16 bits: a bfloat16 value, exactly
        return (v.view(torch.int32) & -65536).view(torch.float32)

    hi = truncated(sums)
    mid = truncated(sums - hi)
    lo = sums - hi - mid
    x = torch.stack([hi, mid, lo], dim=1)  # [48, 3]
    x = torch.cat([x, torch.tensor([[float("nan"), 0.0, 0.0]])]).to(torch.bfloat16)  # [49, 3]
    assert torch.equal(x.float().sum(1)[:48], sums)  # the parts are exact
    out = linear(x, torch.ones(1, 3, dtype=torch.bfloat16))[:, 0]  # [49]
    assert torch.equal(out[:48].view(torch.int16), sums.to(torch.bfloat16).view(torch.int16))
    assert int(out[48:].view(torch.int16)) == 0x7FC0


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return {f for line in text.splitlines() if line.startswith("flags") for f in line.split(":", 1)[1].split()}


@pytest.mark.skipif(not {"amx_bf16", "amx_tile", "avx512_bf16"} <= _cpu_flags(), reason="no AMX-BF16 on this CPU")
@pytest.mark.skipif("SPECDEC_CPU_ISA" in os.environ, reason="the vector paths are capped in this process")
def test_amx_path_taken():
    """On a CPU with AMX-BF16 the bfloat16 kernel runs on the tiles: the process chose them (``native_path``; were they
    refused, by the OS or a wrong CPUID bit, it would name an AVX-512 path), and their sums are not vdpbf16ps's (which
    rounds each pair's sum inside the instruction: about one output in 10^4 apart). The widening path can sum as the
    tiles do, bit for bit (seen on a KVM Xeon), so it cannot tell them apart."""
    assert native_path(torch.bfloat16, 1536)[0] == "amx"
    gen = torch.Generator().manual_seed(0)
    x, w, b = _inputs(64, 1536, 3072, torch.bfloat16, True, gen)
    ours = linear(x, w, b, backend="native")
    dot = _native_linear_in_process(x, w, b, {"SPECDEC_CPU_ISA": "avx512", "SPECDEC_BF16_LINEAR": "dot"})
    _assert_close_to_ref(ours, x, w, b)
    _assert_close_to_ref(dot, x, w, b)
    assert not torch.equal(ours, dot), "the default path summed exactly as the dot products do: AMX tiles not used"


@pytest.mark.skipif("avx512_bf16" not in _cpu_flags(), reason="no AVX512-BF16 on this CPU")
def test_bf16_widening_path_taken():
    """SPECDEC_BF16_LINEAR=widen runs the AVX-512 bfloat16 kernel as float32 FMAs on widened values, =dot as
    vdpbf16ps: both close to the float64 reference, and not bitwise equal (the two products of a pair rounded into
    the sum one by one, against one instruction's own rounding: about one output in 10^4 rounds apart), so each setting
    really takes its own path. A K that is not a multiple of 32 and M = 1, 2 and 11 (two chunks of x rows) cover the
    tails and every tile shape; the last case holds ~200,000 outputs."""
    gen = torch.Generator().manual_seed(0)
    for m, k, n in ((1, 100, 40), (2, 576, 24), (11, 1536, 37), (64, 1536, 3072)):
        x, w, b = _inputs(m, k, n, torch.bfloat16, True, gen)
        dot, widen = (_native_linear_in_process(x, w, b, {"SPECDEC_CPU_ISA": "avx512", "SPECDEC_BF16_LINEAR": mode})
                      for mode in ("dot", "widen"))  # fmt: skip
        _assert_close_to_ref(dot, x, w, b)
        _assert_close_to_ref(widen, x, w, b)
    assert not torch.equal(dot, widen), "SPECDEC_BF16_LINEAR chose nothing: both settings summed alike"


@pytest.mark.skipif("avx512_bf16" not in _cpu_flags(), reason="no AVX512-BF16 on this CPU")
def test_bf16_path_follows_the_measured_issue_rates():
    """Without SPECDEC_BF16_LINEAR (AMX turned off), the AVX-512 bfloat16 path is the widening one exactly where
    vdpbf16ps took over 2.5x the FMAs' time for as many instructions; the setting overrides the measurement both ways.
    The ratio is a real measurement: sixteen independent chains of each instruction, which no CPU with AVX512-BF16
    runs more than 8x apart (16 chains folded into one by the compiler timed one chain's latency instead, and chose
    the dot products on a CPU that issues them at a quarter of the FMAs' rate)."""
    code = "from spec_kernels.linear import native_path\nprint(*native_path())"
    for setting, want in (({}, None), ({"SPECDEC_BF16_LINEAR": "widen"}, "avx512-widen"),
                          ({"SPECDEC_BF16_LINEAR": "dot"}, "avx512-dot")):  # fmt: skip
        env = {k: v for k, v in os.environ.items() if k != "SPECDEC_BF16_LINEAR"} | {"SPECDEC_CPU_ISA": "avx512"}
        result = subprocess.run([sys.executable, "-c", code], env=env | setting, capture_output=True, text=True)
        assert result.returncode == 0, result.stderr[-2000:]
        path, ratio = result.stdout.split()
        assert 0.2 < float(ratio) < 8.0, ratio
        assert path == (want or ("avx512-widen" if float(ratio) > 2.5 else "avx512-dot")), (setting, path, ratio)


def test_native_path_names_a_path():
    path, ratio = linear_native_path(torch.float32)
    assert path in ("avx512", "avx2", "scalar") and ratio >= 0.0
    with pytest.raises(ValueError, match="dtype"):
        linear_native_path(torch.float16)


def _native_linear_in_process(x, w, b, setting: dict) -> torch.Tensor:
    """linear(x, w, b, backend='native') in a fresh process under the environment ``setting`` (kernel paths are
    chosen once per process)."""
    code = (
        "import sys, torch\nfrom spec_kernels.linear import linear\n"
        "x, w, b = torch.load(sys.argv[1])\ntorch.save(linear(x, w, b, backend='native'), sys.argv[2])\n"
    )
    with tempfile.TemporaryDirectory() as tmp:
        torch.save((x, w, b), f"{tmp}/in.pt")
        result = subprocess.run([sys.executable, "-c", code, f"{tmp}/in.pt", f"{tmp}/out.pt"],
                                env={**os.environ, **setting}, capture_output=True, text=True)  # fmt: skip
        assert result.returncode == 0, result.stderr[-2000:]
        return torch.load(f"{tmp}/out.pt")
