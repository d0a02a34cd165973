"""The fused elementwise ops' Triton kernels for CUDA, each a custom op (``spec_kernels::add_rms_norm_triton``,
``rms_norm_triton``, ``silu_mul_triton``, ``rope_qk_triton``) with a fake output on meta tensors.

Why: a decoder layer's eager forward on a GPU is launch-bound, and outside its four matmuls and its attention every
torch op of the layer is a small kernel (the norm's casts, mean and scale; the residual add; RoPE's slices, negation,
cat, products and sum; SiLU and the product with up). Each kernel here is one launch for what was several.

Batch invariance: one program per row (a token's hidden state, its heads), so rows never share a reduction. The
norm sums its row's squares per column lane tile by tile, then across the lanes, the tile fixed by the row length
alone (``row_tile``); nothing depends on the number of rows, so row i of any call is bitwise the 1-row call's.

Rounding: float32 arithmetic, rounded to the model's dtype exactly where the references' torch ops round (the sum
``x + residual``, the normed row before the weight, each product of RoPE), so outputs match the references bit for
bit wherever no reduction or transcendental function is involved. The Triton 3.9 interpreter truncates float32 to
bfloat16 on casts and stores; there each rounding is done on the bits (``EMULATE_BF16_RNE``), round to nearest even.
"""

from __future__ import annotations

import torch

from spec_kernels._backend import triton_available, triton_interpret

MAX_ROW_TILE = 4096  # the norm's widest tile: a longer row is reduced in tiles of this many columns, in order


def row_tile(n: int) -> int:
    """The norm's tile for rows of ``n`` columns: a function of n alone (batch invariance rests on it)."""
    return min(1 << max(n - 1, 0).bit_length(), MAX_ROW_TILE)


if triton_available():
    import triton
    import triton.language as tl

    @triton.jit
    def _round(x, dtype: tl.constexpr, EMULATE_BF16_RNE: tl.constexpr):
        """float32 x rounded to ``dtype`` to nearest even, kept in float32."""
        if EMULATE_BF16_RNE:
            if dtype == tl.bfloat16:
                bits = x.to(tl.uint32, bitcast=True)
                bits = bits + 0x7FFF + ((bits >> 16) & 1)
                return ((bits >> 16) << 16).to(tl.float32, bitcast=True)
        return x.to(dtype).to(tl.float32)

    @triton.jit
    def _add_rms_norm_kernel(
        x_ptr, res_ptr, w_ptr, out_ptr, h_ptr, N, eps, stride_x, stride_res, stride_out, stride_h,
        HAS_RESIDUAL: tl.constexpr, TILE: tl.constexpr, EMULATE_BF16_RNE: tl.constexpr,
    ):  # fmt: skip
        # grid: (rows,). Pass 1: h = x + residual (stored), h^2 summed per column lane tile by tile, then across the
        # lanes; pass 2: h again (recomputed, not re-read: no barrier between another thread's store and this load),
        # normed, times the weight.
        row = tl.program_id(0).to(tl.int64)
        acc = tl.zeros([TILE], dtype=tl.float32)
        for n0 in range(0, N, TILE):
            offs = n0 + tl.arange(0, TILE)
            ok = offs < N
            h = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
            if HAS_RESIDUAL:
                r = tl.load(res_ptr + row * stride_res + offs, mask=ok, other=0.0).to(tl.float32)
                h = _round(h + r, x_ptr.dtype.element_ty, EMULATE_BF16_RNE)
                tl.store(h_ptr + row * stride_h + offs, h.to(x_ptr.dtype.element_ty), mask=ok)
            acc += h * h
        rstd = 1.0 / tl.sqrt(tl.sum(acc, axis=0) / N + eps)
        for n0 in range(0, N, TILE):
            offs = n0 + tl.arange(0, TILE)
            ok = offs < N
            h = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
            if HAS_RESIDUAL:
                r = tl.load(res_ptr + row * stride_res + offs, mask=ok, other=0.0).to(tl.float32)
                h = _round(h + r, x_ptr.dtype.element_ty, EMULATE_BF16_RNE)
            normed = _round(h * rstd, x_ptr.dtype.element_ty, EMULATE_BF16_RNE)
            w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
            out = _round(normed * w, out_ptr.dtype.element_ty, EMULATE_BF16_RNE)
            tl.store(out_ptr + row * stride_out + offs, out.to(out_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _silu_mul_kernel(gu_ptr, out_ptr, N, stride_gu, stride_out, BLOCK: tl.constexpr,
                         EMULATE_BF16_RNE: tl.constexpr):  # fmt: skip
        # grid: (rows, column blocks). out = silu(gate) * up, each rounded to the dtype as torch's two ops round.
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < N
        gate = tl.load(gu_ptr + row * stride_gu + offs, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(gu_ptr + row * stride_gu + N + offs, mask=ok, other=0.0).to(tl.float32)
        silu = _round(gate / (1.0 + tl.exp(-gate)), out_ptr.dtype.element_ty, EMULATE_BF16_RNE)
        out = _round(silu * up, out_ptr.dtype.element_ty, EMULATE_BF16_RNE)
        tl.store(out_ptr + row * stride_out + offs, out.to(out_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _rope_heads(src_ptr, dst_ptr, row, stride_src, stride_src_h, stride_dst, num_heads, cos, sin, offs_d, partner,
                    sign, D, BLOCK_H: tl.constexpr, EMULATE_BF16_RNE: tl.constexpr):  # fmt: skip
        """One token's heads [num_heads, D]: x * cos + rotate_half(x) * sin, each product and the sum rounded."""
        offs_h = tl.arange(0, BLOCK_H)[:, None]
        ok = (offs_h < num_heads) & (offs_d < D)
        src = src_ptr + row * stride_src + offs_h * stride_src_h
        x = tl.load(src + offs_d, mask=ok, other=0.0).to(tl.float32)  # [BLOCK_H, BLOCK_D]
        rotated = sign * tl.load(src + partner, mask=ok, other=0.0).to(tl.float32)
        a = _round(x * cos, dst_ptr.dtype.element_ty, EMULATE_BF16_RNE)
        b = _round(rotated * sin, dst_ptr.dtype.element_ty, EMULATE_BF16_RNE)
        out = _round(a + b, dst_ptr.dtype.element_ty, EMULATE_BF16_RNE)
        tl.store(dst_ptr + row * stride_dst + offs_h * D + offs_d, out.to(dst_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _rope_qk_kernel(
        q_ptr, k_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr, Hq, Hkv, D, stride_q, stride_qh, stride_k, stride_kh,
        stride_rope, BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr, BLOCK_D: tl.constexpr,
        EMULATE_BF16_RNE: tl.constexpr,
    ):  # fmt: skip
        # grid: (tokens,). One token's q and k heads with its cos and sin row: rotate-half pairs column d with
        # d + D/2 (negated) in the first half and d - D/2 in the second.
        row = tl.program_id(0).to(tl.int64)
        offs_d = tl.arange(0, BLOCK_D)[None, :]
        half = D // 2
        first = offs_d < half
        partner = tl.where(first, offs_d + half, offs_d - half)
        sign = tl.where(first, -1.0, 1.0)
        d_ok = offs_d < D
        cos = tl.load(cos_ptr + row * stride_rope + offs_d, mask=d_ok, other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + row * stride_rope + offs_d, mask=d_ok, other=0.0).to(tl.float32)
        _rope_heads(q_ptr, q_out_ptr, row, stride_q, stride_qh, Hq * D, Hq, cos, sin, offs_d, partner, sign, D,
                    BLOCK_HQ, EMULATE_BF16_RNE)  # fmt: skip
        _rope_heads(k_ptr, k_out_ptr, row, stride_k, stride_kh, Hkv * D, Hkv, cos, sin, offs_d, partner, sign, D,
                    BLOCK_HKV, EMULATE_BF16_RNE)  # fmt: skip


def _emulate_rne(*dtypes: torch.dtype) -> bool:
    """Whether the kernels round to bfloat16 on the bits: under the interpreter, which truncates instead, where a
    rounding goes to bfloat16."""
    return triton_interpret() and torch.bfloat16 in dtypes


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x ``[..., N]`` as ``[M, N]`` rows with unit column stride (a view where it can be)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def launch_add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """``(rms_norm(x + residual) * weight, x + residual)``; the second None without a residual. x, residual
    ``[..., N]`` in one dtype; weight ``[N]``; the output in ``result_type(weight, x)``."""
    N = x.shape[-1]
    x2 = _rows(x)  # [M, N]
    M = x2.shape[0]
    out = torch.empty((M, N), dtype=torch.result_type(weight, x), device=x.device)
    h = None if residual is None else torch.empty((M, N), dtype=x.dtype, device=x.device)
    r2 = None if residual is None else _rows(residual)
    if M and N:
        _add_rms_norm_kernel[(M,)](
            x2, x2 if r2 is None else r2, weight.contiguous(), out, out if h is None else h, N, float(eps),
            x2.stride(0), 0 if r2 is None else r2.stride(0), out.stride(0), 0 if h is None else h.stride(0),
            HAS_RESIDUAL=r2 is not None, TILE=row_tile(N), EMULATE_BF16_RNE=_emulate_rne(x.dtype, out.dtype),
            num_warps=4 if N <= 1024 else 8,
        )  # fmt: skip
    lead = x.shape[:-1]
    return out.reshape(*lead, N), None if h is None else h.reshape(*lead, N)


def launch_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of gate_up ``[..., 2 I]``: ``[..., I]``."""
    n = gate_up.shape[-1] // 2
    gu = _rows(gate_up)  # [M, 2 I]
    M = gu.shape[0]
    out = torch.empty((M, n), dtype=gate_up.dtype, device=gate_up.device)
    if M and n:
        block = min(triton.next_power_of_2(n), 1024)
        _silu_mul_kernel[(M, triton.cdiv(n, block))](
            gu, out, n, gu.stride(0), out.stride(0), BLOCK=block, EMULATE_BF16_RNE=_emulate_rne(gate_up.dtype),
            num_warps=4,
        )  # fmt: skip
    return out.reshape(*gate_up.shape[:-1], n)


def _heads(x: torch.Tensor) -> torch.Tensor:
    """x ``[B, T, H, D]`` as ``[M, H, D]`` with unit column stride (q and k are views of the qkv matmul's rows)."""
    x3 = x.reshape(-1, *x.shape[-2:])
    return x3 if x3.stride(-1) == 1 else x3.contiguous()


def launch_rope_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Rotate-half RoPE of q ``[B, T, Hq, D]`` and k ``[B, T, Hkv, D]`` (one dtype) by cos, sin ``[B, T, D]``:
    new contiguous tensors."""
    Hq, D = q.shape[-2:]
    Hkv = k.shape[-2]
    q3, k3 = _heads(q), _heads(k)  # [M, Hq, D], [M, Hkv, D]
    cos2, sin2 = cos.reshape(-1, D).contiguous(), sin.reshape(-1, D).contiguous()  # [M, D]
    M = q3.shape[0]
    q_out, k_out = (
        torch.empty_like(q, memory_format=torch.contiguous_format),
        torch.empty_like(k, memory_format=torch.contiguous_format),
    )
    if M and D:
        _rope_qk_kernel[(M,)](
            q3, k3, cos2, sin2, q_out, k_out, Hq, Hkv, D, q3.stride(0), q3.stride(1), k3.stride(0), k3.stride(1),
            cos2.stride(0), BLOCK_HQ=triton.next_power_of_2(Hq), BLOCK_HKV=triton.next_power_of_2(Hkv),
            BLOCK_D=triton.next_power_of_2(D), EMULATE_BF16_RNE=_emulate_rne(q.dtype), num_warps=4,
        )  # fmt: skip
    return q_out, k_out


@torch.library.custom_op("spec_kernels::add_rms_norm_triton", mutates_args=())
def add_rms_norm_triton(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The residual add and the norm in one launch (a fake output on meta tensors: the simulated GPU)."""
    return launch_add_rms_norm(x, residual, weight, eps)


@add_rms_norm_triton.register_fake
def _(x, residual, weight, eps):
    return x.new_empty(x.shape, dtype=torch.result_type(weight, x)), torch.empty_like(x)


@torch.library.custom_op("spec_kernels::rms_norm_triton", mutates_args=())
def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The norm alone (no residual): one launch."""
    return launch_add_rms_norm(x, None, weight, eps)[0]


@rms_norm_triton.register_fake
def _(x, weight, eps):
    return x.new_empty(x.shape, dtype=torch.result_type(weight, x))


@torch.library.custom_op("spec_kernels::silu_mul_triton", mutates_args=())
def silu_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    return launch_silu_mul(gate_up)


@silu_mul_triton.register_fake
def _(gate_up):
    return gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))


@torch.library.custom_op("spec_kernels::rope_qk_triton", mutates_args=())
def rope_qk_triton(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    return launch_rope_qk(q, k, cos, sin)


@rope_qk_triton.register_fake
def _(q, k, cos, sin):
    return torch.empty_like(q, memory_format=torch.contiguous_format), torch.empty_like(
        k, memory_format=torch.contiguous_format
    )
