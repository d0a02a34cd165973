"""``quant_linear_ref``: the readable spec of ``quant_linear``, with its exact signature, in both numeric modes.

- ``activations="float"``: dequantize in float32, ``F.linear``. The block format's decoding, ``dequantize_ref``,
  lives in :mod:`spec_kernels.types` with ``QuantizedWeight``, whose methods use it.
- ``activations="int8"``: x quantized per row and 32-weight block to int8 (llama.cpp's Q8_0: ``d = amax / 127``,
  ``q = round(x / d)``, half to even), integer dot products with each weight block's quants, then a float32
  epilogue per block in block order (csrc/quant_int8_cpu.h draws it). Every float operation below is one torch
  operation, rounded once, as the C++ kernels round; the integer sums are exact (float64 holds them exactly, so no
  summation order matters).

Clarity beats speed here: tests and benchmarks compare against it, and ``backend="torch"`` runs it (the CPU
fallback of last resort).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from spec_kernels.types import QUANT_FORMATS, _bits, _f16, _k_scales, check_activations, dequantize_ref

INT8_BLOCK = 32  # weights per activation block (and per integer dot product)
INT8_MAX = 127  # the int8 activations' range is symmetric: [-127, 127]
INT8_MIN_TYPES = ("Q4_1", "Q5_1", "Q2_K", "Q4_K", "Q5_K")  # formats with a minimum: the epilogue's c * S term


class IntBlocks(NamedTuple):
    """A matrix's 32-weight blocks read as integers: ``w = a * (sc_h * q) + c * mn_h`` for the block's half h (16
    weights): quants ``q`` ``[N, nb, 32]``, float scales ``a``, ``c`` ``[N, nb]`` (c zero where the format has no
    minimum), integer group scales and minima ``sc``, ``mn`` ``[N, nb, 2]`` (ones where it has none)."""

    q: torch.Tensor
    a: torch.Tensor
    c: torch.Tensor
    sc: torch.Tensor
    mn: torch.Tensor


def _halves(v: torch.Tensor, num: int) -> torch.Tensor:
    """Per-16 values ``[R, 16]`` of R super-blocks -> ``[R * 8, 2]``, one row per 32-weight sub-block."""
    return v.reshape(num * 8, 2).long()


def int_blocks(weight: torch.Tensor, qtype: str) -> IntBlocks:
    """``uint8 [N, row_bytes]`` blocks -> :class:`IntBlocks`; the layouts are drawn in csrc/quant_blocks_cpu.h."""
    f = QUANT_FORMATS[qtype]
    n = weight.shape[0]
    b = weight.reshape(-1, f.block_bytes)  # [R, block_bytes]
    num = b.shape[0]
    ones = torch.ones(num * f.block_weights // INT8_BLOCK, 2, dtype=torch.long, device=weight.device)
    zero = torch.zeros(num * f.block_weights // INT8_BLOCK, device=weight.device)
    sc = mn = ones
    c = zero
    if qtype == "Q8_0":
        q, a = b[:, 2:].view(torch.int8).long(), _f16(b[:, 0:2])[:, 0]
    elif qtype in ("Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        a, qs = _f16(b[:, 0:2])[:, 0], b[:, -16:]
        q = torch.cat([qs & 15, qs >> 4], dim=-1).long()  # [R, 32]: byte j holds elements j and j + 16
        if qtype.startswith("Q5"):
            qh = b[:, 4:8] if qtype == "Q5_1" else b[:, 2:6]
            q = q | (_bits(qh, tuple(range(8)), 1).transpose(1, 2).reshape(num, 32).long() << 4)
        if qtype.endswith("_1"):
            c = _f16(b[:, 2:4])[:, 0]
        else:
            q = q - (16 if qtype == "Q5_0" else 8)
    elif qtype == "Q2_K":
        a, c = _f16(b[:, 80:82]).expand(num, 8), -_f16(b[:, 82:84]).expand(num, 8)
        sc, mn = _halves(b[:, :16] & 15, num), _halves(b[:, :16] >> 4, num)
        q = _bits(b[:, 16:80].reshape(num, 2, 32), (0, 2, 4, 6), 3).long()
    elif qtype == "Q3_K":
        a = _f16(b[:, 108:110]).expand(num, 8)
        low = _bits(b[:, 96:104], (0, 4), 15).reshape(num, 16)
        high = _bits(b[:, 104:108], (0, 2, 4, 6), 3).reshape(num, 16)
        sc = _halves(low | (high << 4), num) - 32
        ql = _bits(b[:, 32:96].reshape(num, 2, 32), (0, 2, 4, 6), 3).long()
        q = ql - ((_bits(b[:, :32], tuple(range(8)), 1).long() ^ 1) << 2).reshape(ql.shape)
    elif qtype in ("Q4_K", "Q5_K"):
        s, m = _k_scales(b[:, 4:16])  # [R, 8]
        a, c = _f16(b[:, 0:2]) * s.float(), -(_f16(b[:, 2:4]) * m.float())
        q = _bits(b[:, -128:].reshape(num, 4, 32), (0, 4), 15).long()
        if qtype == "Q5_K":
            q = q | (_bits(b[:, 16:48], tuple(range(8)), 1).long() << 4).reshape(q.shape)
    else:  # Q6_K
        a = _f16(b[:, 208:210]).expand(num, 8)
        sc = _halves(b[:, 192:208].view(torch.int8), num)
        ql = _bits(b[:, :128].reshape(num, 2, 64), (0, 4), 15).reshape(num, 8, 32)
        qh = _bits(b[:, 128:192].reshape(num, 2, 32), (0, 2, 4, 6), 3).reshape(num, 8, 32)
        q = (ql | (qh << 4)).long() - 32
    nb = f.block_weights // INT8_BLOCK * num // n
    return IntBlocks(q.reshape(n, nb, INT8_BLOCK), a.reshape(n, nb), c.reshape(n, nb), sc.reshape(n, nb, 2),
                     mn.reshape(n, nb, 2))  # fmt: skip


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` -> integer-valued float32 ``xq [M, K / 32, 32]`` in [-127, 127] and scales ``dx [M, K / 32]``
    (0 for an all-zero block, whose quants are then 0)."""
    xf = x.float().reshape(x.shape[0], -1, INT8_BLOCK)
    dx = xf.abs().amax(-1) / INT8_MAX
    inv = torch.where(dx != 0, 1 / dx, torch.zeros_like(dx))
    return torch.round((xf * inv[..., None]).clamp(-INT8_MAX, INT8_MAX)), dx


def _quant_linear_int8(x: torch.Tensor, weight: torch.Tensor, qtype: str) -> torch.Tensor:
    """float32 ``[M, N]`` sums of the 8-bit activation path (no bias)."""
    w = int_blocks(weight, qtype)
    xq, dx = quantize_activations(x)  # [M, nb, 32], [M, nb]
    nb = xq.shape[1]
    halves = torch.einsum("nbhe,mbhe->mnbh", w.q.double().reshape(-1, nb, 2, 16), xq.double().reshape(-1, nb, 2, 16))
    dots = (halves * w.sc.double()).sum(-1)  # [M, N, nb] I: exact integers
    sums = (xq.reshape(-1, 1, nb, 2, 16).double().sum(-1) * w.mn.double()).sum(-1)  # [M, N, nb] S
    has_min = qtype in INT8_MIN_TYPES
    acc = torch.zeros(x.shape[0], weight.shape[0], device=x.device)  # [M, N]
    for b in range(nb):
        u = w.a[:, b] * dots[:, :, b].float()
        if has_min:
            u = u + w.c[:, b] * sums[:, :, b].float()
        acc = acc + dx[:, b, None] * u
    return acc


def quant_linear_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    qtype: str,
    *,
    bias: torch.Tensor | None = None,
    activations: str = "float",
    backend: str | None = None,
) -> torch.Tensor:
    """``x @ dequantize_ref(weight, qtype).T + bias`` in float32 (``activations="int8"``: x's int8 blocks and the
    integer path), cast to x's dtype. ``backend`` is ignored."""
    if check_activations(activations) == "float":
        w = dequantize_ref(weight, qtype)  # [N, K]
        out = torch.nn.functional.linear(x.float(), w, None if bias is None else bias.float())
        return out.to(x.dtype)
    rows = x.reshape(-1, x.shape[-1])  # [M, K]
    out = _quant_linear_int8(rows, weight.view(torch.uint8), qtype)  # [M, N]
    if bias is not None:
        out = out + bias.float()
    return out.reshape(*x.shape[:-1], weight.shape[0]).to(x.dtype)
