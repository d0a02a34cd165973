"""The types the ops share: ``verify_tree``'s result and its padding, and a weight kept as GGUF blocks.

Glossary: a GGUF *block* is a run of consecutive weights of one row with its scales: 32 weights for Q8_0, Q4_0, Q4_1,
Q5_0 and Q5_1 (a float16 scale d, for the _1 types a float16 minimum m, then the quants), 256 for the K-quants Q2_K,
Q3_K, Q4_K, Q5_K and Q6_K (a *super-block*: float16 d (and dmin) times small integer scales per 16 or 32 weights).
*qtype* names the format ("Q4_K" or ggml's type id); ``QUANT_FORMATS`` holds each one's facts. The block formats'
decoding (``dequantize_ref``) lives here with ``QuantizedWeight``, whose methods use it: this module imports no op (an
op package's ``__init__`` runs its dispatch and imports its backends), so every op can import it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

PAD_NODE = -1  # padding in parents / accepted_nodes / output_tokens


class VerifyResult(NamedTuple):
    accepted_nodes: torch.Tensor  # [B, T] int64: the accepted path from the root, padded with PAD_NODE
    output_tokens: torch.Tensor  # [B, T] int64: accepted drafts, then the recovered/bonus token, padded with -1
    num_accepted: torch.Tensor  # [B] int64: path length including the root == number of emitted tokens


class QuantFormat(NamedTuple):
    """One GGUF block format: ggml's type id, the weights of one block, its bytes, and the byte offsets of its fp16
    scales (d, and m or dmin; random bytes there can be inf or NaN)."""

    type_id: int
    block_weights: int
    block_bytes: int
    fp16_offsets: tuple[int, ...]


# The GGUF block formats the quantized kernels read; csrc/quant_blocks_cpu.h's kFormats holds the same facts for C++.
QUANT_FORMATS = {
    "Q4_0": QuantFormat(2, 32, 18, (0,)),
    "Q4_1": QuantFormat(3, 32, 20, (0, 2)),
    "Q5_0": QuantFormat(6, 32, 22, (0,)),
    "Q5_1": QuantFormat(7, 32, 24, (0, 2)),
    "Q8_0": QuantFormat(8, 32, 34, (0,)),
    "Q2_K": QuantFormat(10, 256, 84, (80, 82)),
    "Q3_K": QuantFormat(11, 256, 110, (108,)),
    "Q4_K": QuantFormat(12, 256, 144, (0, 2)),
    "Q5_K": QuantFormat(13, 256, 176, (0, 2)),
    "Q6_K": QuantFormat(14, 256, 210, (208,)),
}
_TYPE_NAMES = {f.type_id: name for name, f in QUANT_FORMATS.items()}
# How a quantized matrix multiplies its activations: "float" (as linear on the dequantized matrix) or "int8" (x in
# int8 blocks and integer dot products, llama.cpp's way: spec_kernels/quant_linear/ref.py).
QUANT_ACTIVATIONS = ("float", "int8")


def check_activations(activations: str) -> str:
    if activations not in QUANT_ACTIVATIONS:
        raise ValueError(f"quant activations must be one of {QUANT_ACTIVATIONS}, got {activations!r}")
    return activations


def quant_row_bytes(qtype: str, k: int) -> int:
    """Bytes of one row of K weights in ``qtype``; ValueError naming the block when K is not a multiple of it."""
    f = QUANT_FORMATS[qtype]
    if k <= 0 or k % f.block_weights:
        raise ValueError(f"K = {k} is not a positive multiple of {qtype}'s {f.block_weights}-weight block")
    return k // f.block_weights * f.block_bytes


def _f16(b: torch.Tensor) -> torch.Tensor:
    """Little-endian fp16 bytes ``[..., 2]`` -> float32 ``[..., 1]``."""
    return b.contiguous().view(torch.float16).float()


def _bits(b: torch.Tensor, shifts: tuple[int, ...], mask: int) -> torch.Tensor:
    """``(b >> s) & mask`` for each shift s: ``[..., n]`` -> ``[..., len(shifts), n]`` (the shift the slower axis)."""
    s = torch.tensor(shifts, dtype=torch.uint8, device=b.device).reshape(-1, 1)
    return (b.unsqueeze(-2) >> s) & mask


def _k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's 12 scale bytes -> the 8 sub-blocks' 6-bit scales and minima ``[..., 8]``: bytes 0-3 / 4-7 hold
    sub-blocks 0-3's scale / minimum in their low 6 bits, their top 2 bits the high bits of sub-blocks 4-7's, whose
    low 4 bits are the low (scale) and high (minimum) nibbles of bytes 8-11."""
    lo, mid, hi = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = torch.cat([lo & 63, (hi & 15) | ((lo >> 2) & 48)], dim=-1)
    mn = torch.cat([mid & 63, (hi >> 4) | ((mid >> 2) & 48)], dim=-1)
    return sc, mn


def _dequantize_blocks(b: torch.Tensor, qtype: str) -> torch.Tensor:
    """Blocks ``uint8 [R, block_bytes]`` -> float32 ``[R, block_weights]`` with gguf.quants' float operations in its
    order: a product and a sum each rounded once (the products d * scale * q are exact in float32). The layouts are
    drawn in csrc/quant_blocks_cpu.h."""
    num = b.shape[0]
    if qtype == "Q8_0":
        return b[:, 2:].view(torch.int8).float() * _f16(b[:, 0:2])
    if qtype in ("Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        d, has_min = _f16(b[:, 0:2]), qtype.endswith("_1")
        qs = b[:, -16:]
        q = torch.cat([qs & 15, qs >> 4], dim=-1)  # [R, 32]: byte j holds elements j and j + 16
        if qtype.startswith("Q5"):  # 4 bytes, a little-endian uint32 whose bit i is element i's fifth bit
            qh = b[:, 4:8] if has_min else b[:, 2:6]
            q = q | (_bits(qh, tuple(range(8)), 1).transpose(1, 2).reshape(num, 32) << 4)
        w = q.float()
        if has_min:
            return w.mul_(d).add_(_f16(b[:, 2:4]))
        return w.sub_(16 if qtype == "Q5_0" else 8).mul_(d)
    if qtype == "Q2_K":  # 16 scale bytes (low nibble scale, high nibble minimum), 64 bytes of 2-bit q, d, dmin
        dl = _f16(b[:, 80:82]) * (b[:, :16] & 15).float()  # [R, 16]: one scale and minimum per 16 weights
        ml = _f16(b[:, 82:84]) * (b[:, :16] >> 4).float()
        q = _bits(b[:, 16:80].reshape(num, 2, 32), (0, 2, 4, 6), 3).reshape(num, 16, 16)
        return (dl.unsqueeze(-1) * q.float() - ml.unsqueeze(-1)).reshape(num, 256)
    if qtype == "Q3_K":  # 32 bytes of high bits, 64 of 2-bit q, 12 of 6-bit scales, d
        scales = b[:, 96:108]
        low = _bits(scales[:, :8], (0, 4), 15).reshape(num, 16)
        high = _bits(scales[:, 8:12], (0, 2, 4, 6), 3).reshape(num, 16)
        dl = _f16(b[:, 108:110]) * ((low | (high << 4)).float() - 32)  # [R, 16]
        ql = _bits(b[:, 32:96].reshape(num, 2, 32), (0, 2, 4, 6), 3).reshape(num, 16, 16)
        qh = _bits(b[:, :32], tuple(range(8)), 1).reshape(num, 16, 16)
        q = ql.to(torch.int8) - ((qh ^ 1) << 2).to(torch.int8)  # a clear high bit subtracts 4
        return (dl.unsqueeze(-1) * q.float()).reshape(num, 256)
    if qtype in ("Q4_K", "Q5_K"):  # d, dmin, 12 bytes of 6-bit scales and minima, (Q5_K: 32 of high bits,) nibbles
        sc, mn = _k_scales(b[:, 4:16])
        dl = _f16(b[:, 0:2]) * sc.float()  # [R, 8]: one scale and minimum per 32 weights
        ml = _f16(b[:, 2:4]) * mn.float()
        q = _bits(b[:, -128:].reshape(num, 4, 32), (0, 4), 15).reshape(num, 8, 32)
        if qtype == "Q5_K":
            q = q | (_bits(b[:, 16:48], tuple(range(8)), 1) << 4)
        return (dl.unsqueeze(-1) * q.float() - ml.unsqueeze(-1)).reshape(num, 256)
    # Q6_K: 128 bytes of low nibbles, 64 of 2-bit highs, 16 int8 scales, d
    dl = _f16(b[:, 208:210]) * b[:, 192:208].view(torch.int8).float()  # [R, 16]
    ql = _bits(b[:, :128].reshape(num, 2, 64), (0, 4), 15).reshape(num, 8, 32)
    qh = _bits(b[:, 128:192].reshape(num, 2, 32), (0, 2, 4, 6), 3).reshape(num, 8, 32)
    q = (ql | (qh << 4)).to(torch.int8) - 32
    return (dl.unsqueeze(-1) * q.reshape(num, 16, 16).float()).reshape(num, 256)


_DEQUANT_CHUNK_WEIGHTS = 1 << 21  # bounds dequantize_ref's temporaries (a few bytes per weight) on a whole embedding


def dequantize_ref(weight: torch.Tensor, qtype: str) -> torch.Tensor:
    """GGUF blocks ``uint8 [N, K / block_weights * block_bytes]`` -> float32 ``[N, K]``, bit for bit
    gguf.quants.dequantize's values, written chunk by chunk into one float32 tensor: a model's whole embedding
    dequantizes without temporaries of its size."""
    name = quant_type_name(qtype)
    f = QUANT_FORMATS[name]
    blocks = weight.reshape(-1, f.block_bytes)  # [N * K / block_weights, block_bytes]
    out = torch.empty(blocks.shape[0], f.block_weights, dtype=torch.float32, device=weight.device)
    step = _DEQUANT_CHUNK_WEIGHTS // f.block_weights
    for start in range(0, blocks.shape[0], step):
        out[start : start + step] = _dequantize_blocks(blocks[start : start + step], name)
    return out.reshape(weight.shape[0], -1)


def quant_type_name(qtype: str | int) -> str:
    """The format's name ("Q4_K") from a name, ggml's type id or a ``gguf.GGMLQuantizationType``; ValueError for a
    format the kernels do not read."""
    if isinstance(qtype, str):
        name = qtype.upper()
        if name in QUANT_FORMATS:
            return name
    elif isinstance(qtype, int) and int(qtype) in _TYPE_NAMES:
        return _TYPE_NAMES[int(qtype)]
    supported = ", ".join(QUANT_FORMATS)
    shown = getattr(qtype, "name", qtype)
    raise ValueError(f"unsupported quantization type {shown!r}; the kernels read {supported}")


@dataclass(frozen=True)
class QuantizedWeight:
    """A weight matrix ``[N, K]`` kept as GGUF blocks: ``data`` uint8 ``[N, K / block_weights * block_bytes]``.

    Rows are independent, so fused projections (q/k/v, gate/up) are the row concatenation of their blocks
    (:meth:`cat`). ``linear(x, qw)`` dispatches here. ``activations``: the numeric mode its products run in
    (``QUANT_ACTIVATIONS``)."""

    data: torch.Tensor
    qtype: str
    shape: tuple[int, int]
    activations: str = "float"

    def __post_init__(self) -> None:
        check_activations(self.activations)
        qtype = quant_type_name(self.qtype)
        object.__setattr__(self, "qtype", qtype)
        num_rows, k = self.shape
        if self.data.dtype != torch.uint8:
            raise ValueError(f"QuantizedWeight: data must be uint8 GGUF blocks, got {self.data.dtype}")
        expected = (num_rows, quant_row_bytes(qtype, k))
        if tuple(self.data.shape) != expected:
            raise ValueError(f"QuantizedWeight: {qtype} [{num_rows}, {k}] needs data {expected}, got {self.data.shape}")

    @property
    def qtype_id(self) -> int:
        return QUANT_FORMATS[self.qtype].type_id

    @property
    def blocks(self) -> torch.Tensor:
        """``data`` viewed as ``[N, K / block_weights, block_bytes]``: what the native model ops take, which tell the
        format by its block (a Q4_K row is as wide as a Q4_0 row of the same K, but its blocks are not) and the
        numeric mode by its dtype (uint8: float activations, int8: 8-bit ones; csrc/quant_linear_cpu.h)."""
        f = QUANT_FORMATS[self.qtype]
        blocks = self.data.view(self.shape[0], self.shape[1] // f.block_weights, f.block_bytes)
        return blocks.view(torch.int8) if self.activations == "int8" else blocks

    @property
    def device(self) -> torch.device:
        return self.data.device

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``[N, K]`` in ``dtype``: gguf's float32 values, then one rounding."""
        return dequantize_ref(self.data, self.qtype).to(dtype)

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """Dequantized float32 rows ``[..., K]`` of ``index`` (an embedding lookup that reads only those rows)."""
        picked = self.data[index.reshape(-1)]  # [R, row_bytes]
        return dequantize_ref(picked, self.qtype).reshape(*index.shape, self.shape[1])

    @staticmethod
    def cat(parts: list[QuantizedWeight]) -> QuantizedWeight:
        """Row concatenation of matrices of one format, K and numeric mode."""
        qtype, k, mode = parts[0].qtype, parts[0].shape[1], parts[0].activations
        if any(p.qtype != qtype or p.shape[1] != k or p.activations != mode for p in parts):
            raise ValueError("QuantizedWeight.cat: the parts must share qtype, K and activations")
        data = torch.cat([p.data for p in parts]).contiguous()
        return QuantizedWeight(data, qtype, (sum(p.shape[0] for p in parts), k), mode)
