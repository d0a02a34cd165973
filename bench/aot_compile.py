"""Compile every Triton kernel configuration the ops can launch, for sm_80 and sm_90a, on a machine without a GPU.

Triton compiles for any NVIDIA target with its own ptxas; only launching needs a GPU. So each launcher runs here on
CPU tensors of representative shapes with its kernels replaced by recorders: that captures the exact arguments,
constexprs and ``num_warps`` the launcher picks by default (there is no autotuning). Triton's own JIT binder then
turns the captured arguments into the signature, constexprs and specialisation attributes (pointer and integer
divisibility, integers equal to 1) a GPU launch would compile, and ``triton.compile`` builds the cubin for each
architecture. ptxas's own report (``-v``, which Triton runs) gives registers, stack frame and spill bytes (stores
plus loads; ``cuobjdump -res-usage`` shows the same registers and stack), and the compiled metadata gives shared
memory.

    python bench/aot_compile.py           # every configuration; JSON in bench/out/aot_compile.json
    python bench/aot_compile.py --quick   # a representative subset, for CI

Exits non-zero when a configuration fails to compile, or spills (stack > 0 or spill bytes > 0): every
configuration here is one the launchers pick by default.

Configurations (the full set; ``--quick`` keeps fp32 and bf16, D = 128, paged, T 4 and 16, no combine kernel, and
three verify variants with a draft and filters at V = 32000, one of them coupled). The full set still has one 8-byte
call-site spill (fp32, head dim 64, paged, split, sm_90a) and 8-76 bytes in five coupled verify variants that also
carry a draft and filters (bench/RESULTS.md), so it exits 1; the quick set guards the launchers' tile choices in CI:
- ``_tree_attention_kernel``: dtype (fp32/fp16/bf16) x head dim (64, 80, 128, 256: BLOCK_D 64/128/256) x
  paged/contiguous x T 4, 8, 16 (the tiles follow the group of query heads per KV head, never T: since the kernel
  became batch-invariant the T rows compile to one kernel, kept as a check that they do). Also the flash-decoding
  epilogue (IS_SPLIT, paged and contiguous) and T = 1, plain decoding. Head dims 80 and 128 compile to the same
  kernel (D is a runtime argument, both divisible by 16): duplicates are compiled once.
- ``_combine_splits_kernel``: output dtype x BLOCK_D at 2 and 64 splits (BLOCK_S is 64 at both: duplicates).
- ``_linear_kernel`` (``spec_kernels.linear.triton``, CUDA's batch-invariant linear): dtype x bias, one tile
  configuration each.
- ``_add_rms_norm_kernel``, ``_silu_mul_kernel``, ``_rope_qk_kernel`` (``spec_kernels.fused_elementwise.triton``):
  dtype x the layer shapes of SmolLM2-135M, Llama-3-8B and Qwen2.5-7B (``LAYER_SHAPES``).
- ``_verify_tree_kernel``: logits dtype x draft (none / iid / without replacement) x HAS_FILTERS x BLOCK_V 128 and
  1024 (V = 111 and 32000: the smallest common tile and the cap) x HAS_COUPLING (the in-kernel Gumbel noise).

Tested with Triton 3.9 (it uses the JIT's binder, ``create_function_from_signature`` and ``JITFunction._pack_args``).
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "0"  # the kernels must be JIT functions, not interpreted ones
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, stated (silences its warning)
os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"  # Triton prints ptxas -v: registers, stack frame, spill stores and loads

import argparse  # noqa: E402
import contextlib  # noqa: E402
import importlib  # noqa: E402
import io  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from concurrent.futures import ProcessPoolExecutor  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import create_function_from_signature  # noqa: E402

# The package attributes spec_kernels.tree_attention / .verify_tree are the functions; these are the Triton modules.
TA = importlib.import_module("spec_kernels.tree_attention.triton")
VT = importlib.import_module("spec_kernels.verify_tree.triton")
LT = importlib.import_module("spec_kernels.linear.triton")
FE = importlib.import_module("spec_kernels.fused_elementwise.triton")

ARCHS = {"sm_80": 80, "sm_90a": 90}  # Triton targets sm_90a for capability 90 (wgmma needs the 'a' features)
OUT = Path(__file__).resolve().parent / "out" / "aot_compile.json"
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
QUICK_DTYPES = ("fp32", "bf16")  # fp16 compiles like bf16
HQ, HKV = 32, 8  # GQA group 4, as the Llama-family models the engine serves
HEAD_DIMS = (64, 80, 128, 256)
ROW_SHAPES = {"T4": 4, "T8": 8, "T16": 16}  # T * 4 rows: BLOCK_M 16, 32, 64 (fp32: 16, 32, 32)
VOCABS = (111, 32000)  # BLOCK_V 128 and 1024, the smallest common tile and the largest
# (hidden, intermediate, Hq, Hkv, D) for the fused elementwise kernels: SmolLM2-135M (group 3, D 64), Llama-3-8B
# (group 4, D 128), Qwen2.5-7B (group 7)
LAYER_SHAPES = {"smollm2": (576, 1536, 9, 3, 64), "llama3-8b": (4096, 14336, 32, 8, 128),
                "qwen2.5-7b": (3584, 18944, 28, 4, 128)}  # fmt: skip
FUSED_KERNELS = ("_add_rms_norm_kernel", "_silu_mul_kernel", "_rope_qk_kernel")


class _Recorder:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](*args, **kwargs)`` records instead of launching."""

    def __init__(self, name: str):
        self.name, self.calls = name, []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((self.name, args, kwargs))


def _capture(module, names: tuple[str, ...], launch) -> list[tuple[str, tuple, dict]]:
    saved = {n: getattr(module, n) for n in names}
    recorders = {n: _Recorder(n) for n in names}
    try:
        for n, r in recorders.items():
            setattr(module, n, r)
        launch()
    finally:
        for n, fn in saved.items():
            setattr(module, n, fn)
    return [call for r in recorders.values() for call in r.calls]


def _plan_tensors(k, cache_seqlens, mask, table) -> tuple:
    """The Triton launcher's int32 inputs, as a forward's plan holds them."""
    p = TA._device_plan(k, cache_seqlens, mask, table, HQ // HKV)
    return p.cache_seqlens, p.tree_keys, p.tree_lens, p.tile_shared, p.tile_lens, p.block_table


def _tree_attention_launches(dtype_name: str, D: int, paged: bool, rows: str, split: bool):
    dtype, T = DTYPES[dtype_name], {"T1": 1, **ROW_SHAPES}[rows]
    B, L, block_size = 4, 1024, 16
    q = torch.empty(B, T, HQ, D, dtype=dtype)
    if paged:
        max_blocks = (L + T) // block_size + 1
        k = torch.empty(B * max_blocks, block_size, HKV, D, dtype=dtype)
        table = torch.zeros(B, max_blocks, dtype=torch.int32)
    else:
        k, table = torch.empty(B, L + T, HKV, D, dtype=dtype), None
    cache_seqlens = torch.full((B,), L, dtype=torch.int32)
    mask = torch.ones(B, T, T, dtype=torch.bool).tril()
    num_splits = 8 if split else 1
    return _capture(
        TA,
        ("_tree_attention_kernel", "_combine_splits_kernel"),
        lambda: TA._launch_tree_attention(q, k, k, *_plan_tensors(k, cache_seqlens, mask, table), D**-0.5, num_splits),
    )


def _combine_launches(dtype_name: str, D: int, num_splits: int):
    """The combine kernel alone, at a split count the launcher can reach (BLOCK_S is MAX_SPLITS at any count: the
    combine reduces the same lanes whatever the split count, for batch invariance)."""
    dtype, B, T = DTYPES[dtype_name], 1, 1
    q = torch.empty(B, T, HQ, D, dtype=dtype)
    k = torch.empty(B, 64 * 64 * 4, HKV, D, dtype=dtype)
    calls = _capture(
        TA,
        ("_tree_attention_kernel", "_combine_splits_kernel"),
        lambda: TA._launch_tree_attention(
            q,
            k,
            k,
            *_plan_tensors(k, torch.zeros(B, dtype=torch.int32), torch.ones(B, T, T, dtype=torch.bool), None),
            1.0,
            num_splits,
        ),
    )
    return [c for c in calls if c[0] == "_combine_splits_kernel"]


def _verify_launches(dtype_name: str, draft: str, filters: bool, V: int, coupled: bool):
    B, T = 4, 8
    logits = torch.empty(B, T, V, dtype=DTYPES[dtype_name])
    probs = None if draft == "none" else torch.empty(B, T, V, dtype=torch.float32)
    ints = torch.zeros(B, T, dtype=torch.int64)
    row = torch.ones(B)
    coupling = (torch.zeros(B, dtype=torch.int64), ints, torch.ones(B, dtype=torch.bool)) if coupled else (None,) * 3
    return _capture(
        VT,
        ("_verify_tree_kernel",),
        lambda: VT._verify_tree_triton(
            logits, ints, ints, probs, draft == "without_replacement", row, torch.zeros(B, dtype=torch.int64), row,
            torch.zeros(B), torch.zeros(B, dtype=torch.int64), filters, *coupling,
        ),
    )  # fmt: skip


def _linear_launches(dtype_name: str, bias: bool):
    dtype = DTYPES[dtype_name]
    x, w = torch.empty(5, 576, dtype=dtype), torch.empty(1536, 576, dtype=dtype)
    b = torch.empty(1536, dtype=dtype) if bias else None
    return _capture(LT, ("_linear_kernel",), lambda: LT.launch_linear(x, w, b))


def _fused_launches(dtype_name: str, shape: str):
    dtype = DTYPES[dtype_name]
    H, inter, Hq, Hkv, D = LAYER_SHAPES[shape]
    x, w = torch.empty(5, H, dtype=dtype), torch.empty(H, dtype=dtype)
    q, k, rope = (
        torch.empty(1, 5, Hq, D, dtype=dtype),
        torch.empty(1, 5, Hkv, D, dtype=dtype),
        torch.empty(1, 5, D, dtype=dtype),
    )

    def launch():
        FE.launch_add_rms_norm(x, x, w, 1e-5)
        FE.launch_silu_mul(torch.empty(5, 2 * inter, dtype=dtype))
        FE.launch_rope_qk(q, k, rope, rope)

    return _capture(FE, FUSED_KERNELS, launch)


def configurations(quick: bool) -> list[tuple[str, str, tuple]]:
    """(kernel, config, captured launch) for every configuration; the captured launch is (kernel, args, kwargs).

    The tree-attention grid is dtype x head dim x paged/contiguous x row block (T 4, 8, 16: BLOCK_M 16, 32, 64).
    Two switches change only the code around the main loop and are compiled at BLOCK_M 16, the decode shape: the
    flash-decoding epilogue (IS_SPLIT) and the T = 1 specialisation of plain decoding.
    """
    tree = []  # (dtype, D, paged, rows, split)
    for dt, D in itertools.product(QUICK_DTYPES if quick else DTYPES, (128,) if quick else HEAD_DIMS):
        pagings, row_shapes = ((True,), ("T4", "T16")) if quick else ((False, True), tuple(ROW_SHAPES))
        tree += [(dt, D, paged, rows, False) for paged, rows in itertools.product(pagings, row_shapes)]
        if not quick:
            tree += [(dt, D, paged, "T4", True) for paged in (False, True)] + [(dt, D, True, "T1", False)]
    out = []
    for dt, D, paged, rows, split in tree:
        for name, args, kwargs in _tree_attention_launches(dt, D, paged, rows, split):
            if name == "_tree_attention_kernel":
                cfg = f"{dt} D={D} {'paged' if paged else 'contig'} {rows}{' split' if split else ''}"
                out.append((name, cfg, (name, args, kwargs)))
    for dt, D, splits in itertools.product(DTYPES, () if quick else HEAD_DIMS, (2, 64)):
        for call in _combine_launches(dt, D, splits):
            out.append((call[0], f"{dt} D={D} splits={splits}", call))
    for dt, bias in itertools.product(QUICK_DTYPES if quick else DTYPES, (False,) if quick else (False, True)):
        for call in _linear_launches(dt, bias):
            out.append((call[0], f"{dt}{' bias' if bias else ''}", call))
    for dt, shape in itertools.product(QUICK_DTYPES if quick else DTYPES, LAYER_SHAPES):
        for call in _fused_launches(dt, shape):
            out.append((call[0], f"{dt} {shape}", call))
    verify = itertools.product(DTYPES, ("none", "iid", "without_replacement"), (False, True), VOCABS, (False, True))
    if quick:  # the heaviest variants: a draft and every filter, the widest tile; with the coupling's noise
        verify = [("fp32", "without_replacement", True, VOCABS[-1], False), ("bf16", "iid", True, VOCABS[-1], False),
                  ("fp32", "iid", True, VOCABS[-1], True)]  # fmt: skip
    for dt, draft, filters, V, coupled in verify:
        for call in _verify_launches(dt, draft, filters, V, coupled):
            cfg = f"{dt} draft={draft} filters={int(filters)} V={V}{' coupled' if coupled else ''}"
            out.append((call[0], cfg, call))
    return out


def _constexpr_summary(kwargs: dict) -> str:
    keys = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "BLOCK_D", "BLOCK_S", "BLOCK_V", "num_warps")
    return " ".join(f"{k}={kwargs[k]}" for k in keys if k in kwargs)


def _specialise(kernel_name: str, args: tuple, kwargs: dict, arch: int):
    """What ``kernel[grid](*args, **kwargs)`` would compile on a GPU of ``arch``: Triton's own binder and packer."""
    module = next(m for m in (TA, VT, LT, FE) if hasattr(m, kernel_name))
    fn = getattr(module, kernel_name)
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    kwargs = dict(kwargs, debug=False)
    bound_args, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound_args, specialization, options)
    return fn, target, signature, constexprs, attrs, options


def _light(args: tuple) -> tuple:
    """The binder reads only a pointer argument's dtype and alignment: send the workers small aligned tensors of
    the same dtypes instead of the representative caches (tens of MB)."""
    return tuple(torch.empty(16, dtype=a.dtype) if isinstance(a, torch.Tensor) else a for a in args)


PTXAS_USAGE = re.compile(r"Used (\d+) registers")
PTXAS_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def _ptxas_log(compiled, capture: io.StringIO, arch: int) -> str:
    """ptxas's own ``-v`` report of this kernel: the one Triton printed while compiling (TRITON_DUMP_PTXAS_LOG), or,
    when the cubin came from Triton's cache, a second ptxas run over the cached PTX with Triton's flags."""
    log = capture.getvalue()
    if PTXAS_USAGE.search(log):
        return log
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "k.ptx"
        ptx.write_text(compiled.asm["ptx"])
        cmd = [
            get_ptxas(arch).path,
            "-lineinfo",
            "-v",
            "--regAllocOptLevel=2",
            f"--gpu-name={sm_arch_from_capability(arch)}",
        ]
        return subprocess.run(
            [*cmd, str(ptx), "-o", str(ptx) + ".o"], capture_output=True, text=True, check=True
        ).stderr


def _compile_one(job: tuple) -> dict:
    kernel_name, cfg, arch_name, args, kwargs = job
    row = {"kernel": kernel_name, "config": cfg, "arch": arch_name, "tiles": _constexpr_summary(kwargs)}
    start = time.perf_counter()
    try:
        arch = ARCHS[arch_name]
        fn, target, signature, constexprs, attrs, options = _specialise(kernel_name, args, kwargs, arch)
        capture = io.StringIO()
        with contextlib.redirect_stdout(capture):
            compiled = triton.compile(
                ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__
            )
        log = _ptxas_log(compiled, capture, arch)
        frame = PTXAS_FRAME.search(log)
        row.update(
            regs=int(PTXAS_USAGE.search(log).group(1)),
            stack=int(frame.group(1)),
            shared=int(compiled.metadata.shared),
            spills=int(frame.group(2)) + int(frame.group(3)),  # bytes of spill stores + loads
            ok=True,
        )
    except Exception as exc:  # reported per configuration; the exit status fails the run
        row.update(regs=None, stack=None, shared=None, spills=None, ok=False, error=f"{type(exc).__name__}: {exc}")
    row["seconds"] = round(time.perf_counter() - start, 2)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a representative subset (CI)")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--kernels", default=None, help="comma-separated kernel names: compile only these")
    cli = parser.parse_args()

    start = time.perf_counter()
    configs = configurations(cli.quick)
    if cli.kernels:
        configs = [c for c in configs if c[0] in cli.kernels.split(",")]
    jobs, seen, dupes = [], {}, []
    for kernel_name, cfg, (_, args, kwargs) in configs:
        for arch_name, arch in ARCHS.items():
            _, _, signature, constexprs, attrs, options = _specialise(kernel_name, args, kwargs, arch)
            key = repr((kernel_name, arch, signature, sorted(constexprs.items()), sorted(attrs.items()), options))
            if key in seen:
                dupes.append((kernel_name, cfg, arch_name, seen[key]))
                continue
            seen[key] = cfg
            jobs.append((kernel_name, cfg, arch_name, _light(args), kwargs))
    print(
        f"{len(configs)} configurations x {len(ARCHS)} archs: {len(jobs)} distinct compiles "
        f"({len(dupes)} duplicates), {cli.workers} workers",
        flush=True,
    )
    order = sorted(range(len(jobs)), key=lambda i: "fp32" not in jobs[i][1])  # the slow fp32 compiles first
    rows = [None] * len(jobs)
    with ProcessPoolExecutor(max_workers=cli.workers) as pool:
        for n, (i, row) in enumerate(zip(order, pool.map(_compile_one, [jobs[i] for i in order])), 1):
            rows[i] = row
            if n % 25 == 0:
                print(f"  {n}/{len(jobs)} compiled, {time.perf_counter() - start:.0f} s", flush=True)
    elapsed = time.perf_counter() - start

    header = f"{'kernel':<24} | {'config':<44} | {'tiles':<48} | {'arch':<6} | regs | stack | shared | spills"
    print(header)
    print("-" * len(header))
    bad = []
    for r in rows:
        if not r["ok"]:
            print(f"{r['kernel']:<24} | {r['config']:<44} | {r['tiles']:<48} | {r['arch']:<6} | FAILED: {r['error']}")
            bad.append(r)
            continue
        flag = "  <- SPILLS" if r["stack"] > 0 or r["spills"] > 0 else ""
        print(
            f"{r['kernel']:<24} | {r['config']:<44} | {r['tiles']:<48} | {r['arch']:<6} | {r['regs']:>4} | "
            f"{r['stack']:>5} | {r['shared']:>6} | {r['spills']:>6}{flag}"
        )
        if flag:
            bad.append(r)
    print(f"\n{len(rows)} compiles in {elapsed:.0f} s; {len(bad)} failing or spilling")
    cli.out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "machine": platform.node(),
        "triton": triton.__version__,
        "quick": cli.quick,
        "seconds": round(elapsed, 1),
        "rows": rows,
        "duplicates": [dict(zip(("kernel", "config", "arch", "same_as"), d)) for d in dupes],
    }
    cli.out.write_text(json.dumps(report, indent=1))
    print(f"wrote {cli.out}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
