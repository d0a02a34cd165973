"""``linear``'s Triton path: a batch-invariant GEMM for CUDA, the custom op ``spec_kernels::linear_triton``.

Why not ``F.linear`` on CUDA: cuBLAS chooses its kernel (tile shape, split-K) by the problem's shape, M included, so
row i of a T-token verify pass and the same row in a 1-token forward are reduced in different orders. In float32 the
two agree to ~1e-6; in bfloat16 the outputs are rounded after the sum, and a different last bit now and then flips a
near-tie of the logits: greedy speculation parted from plain decoding on SmolLM2 on a GPU (bench/RESULTS.md, "On a
GPU: the second run"). Here every call of a dtype runs one compiled kernel with one tile
configuration whatever M is (M is not specialised either), and each output element is one K-loop of ``tl.dot`` steps
in a fixed order over its own row of x and column of the weight: ``linear(x)[i]`` is bitwise ``linear(x[i:i+1])[0]``.

Tiles: BLOCK_M 32 rows (decoding's M = 1-64 fits one or two row blocks; prefill chunks re-read the weight once per 32
rows, mostly from L2), BLOCK_N 32 columns (more programs for the memory-bound small-M case), BLOCK_K 64 (float32's
dot runs on CUDA cores in true fp32: TF32 would be ~1e-3 off). No configuration spills on sm_80 or sm_90a
(``bench/aot_compile.py``; BLOCK_K 128 saved 8 bytes of stack in bf16 on sm_90a). Not yet timed on a GPU:
bench/gpu.sh's ``linear`` step measures it against ``F.linear``.
"""

from __future__ import annotations

import torch

from spec_kernels._backend import triton_available, triton_interpret

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) per dtype: one configuration each, never chosen by shape.
CONFIGS = {
    torch.float32: (32, 32, 64, 4, 3),
    torch.float16: (32, 32, 64, 4, 3),
    torch.bfloat16: (32, 32, 64, 4, 3),
}

if triton_available():
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["M"])
    def _linear_kernel(
        x_ptr,
        w_ptr,
        bias_ptr,
        out_ptr,
        M,
        N,
        K,
        stride_xm,
        stride_wn,
        stride_om,
        HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        UPCAST_DOT: tl.constexpr,
        INPUT_PRECISION: tl.constexpr,
    ):
        # grid: (column blocks, row blocks). out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]), float32 accumulation in
        # K order, one tile of BLOCK_K at a time.
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = tl.program_id(1).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_k = tl.arange(0, BLOCK_K)
        m_ok = offs_m < M
        n_ok = offs_n < N
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + offs_k
            k_ok = k < K
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(
                w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn + k[:, None], mask=k_ok[:, None] & n_ok[None, :],
                other=0.0,
            )  # [BLOCK_K, BLOCK_N]  # fmt: skip
            if UPCAST_DOT:
                x = x.to(tl.float32)
                w = w.to(tl.float32)
            acc += tl.dot(x, w, input_precision=INPUT_PRECISION)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(
            out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
            mask=m_ok[:, None] & n_ok[None, :],
        )  # fmt: skip


def launch_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x [..., K] @ weight[N, K].T + bias[N]`` by the batch-invariant kernel; x's dtype one of ``CONFIGS``, the
    weight and bias in it, the weight's rows contiguous."""
    lead, K = x.shape[:-1], x.shape[-1]
    N = weight.shape[0]
    x2 = x.reshape(-1, K)  # [M, K]
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    bias = None if bias is None else bias.contiguous()  # (read with unit stride)
    # The Triton 3.9 interpreter truncates fp32 -> bf16 on store: there, store fp32 and let torch round to nearest.
    store_dtype = torch.float32 if triton_interpret() and x.dtype == torch.bfloat16 else x.dtype
    out = torch.empty((M, N), dtype=store_dtype, device=x.device)
    if M and N:
        block_m, block_n, block_k, num_warps, num_stages = CONFIGS[x.dtype]
        grid = (triton.cdiv(N, block_n), triton.cdiv(M, block_m))
        _linear_kernel[grid](
            x2, weight, weight if bias is None else bias, out, M, N, K, x2.stride(0), weight.stride(0), out.stride(0),
            HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
            # bf16 tl.dot multiplies raw bit patterns under the Triton 3.9 interpreter (triton-lang/triton#11584).
            UPCAST_DOT=triton_interpret() and x.dtype == torch.bfloat16,
            INPUT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
            num_warps=num_warps, num_stages=num_stages,
        )  # fmt: skip
    return out.to(x.dtype).reshape(*lead, N)


@torch.library.custom_op("spec_kernels::linear_triton", mutates_args=())
def linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The Triton path as a custom op (a fake output on meta tensors: the simulated GPU)."""
    return launch_linear(x, weight, bias)


@linear_triton.register_fake
def _(x, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))
