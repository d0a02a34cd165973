"""The types the ops share: ``verify_tree``'s result and its padding, and a weight kept as GGUF blocks.

Glossary: a GGUF *block* is 32 consecutive weights of one row, stored as a float16 scale (and, for Q4_1, a float16
minimum) plus 32 quants; *qtype* names the format ("Q8_0", "Q4_0", "Q4_1" or ggml's type id). The block format's
decoding (``dequantize_ref``) lives here with ``QuantizedWeight``, whose methods use it: this module imports no op
(an op package's ``__init__`` runs its dispatch and imports its backends), so every op can import it.
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


# GGUF block formats the quantized kernels read: ggml's type id and the bytes of one block of QUANT_BLOCK weights.
QUANT_BLOCK = 32
QUANT_TYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8}
QUANT_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}
_TYPE_NAMES = {v: k for k, v in QUANT_TYPES.items()}


def dequantize_ref(weight: torch.Tensor, qtype: str) -> torch.Tensor:
    """GGUF blocks ``uint8 [N, K / 32 * block_bytes]`` -> float32 ``[N, K]``, bit for bit gguf.quants.dequantize's
    values: Q8_0 ``q * d``; Q4_0 ``d * (q - 8)``; Q4_1 ``d * q + m`` (each product and sum rounded once). Byte j of a
    block's nibbles holds element j (low nibble) and element j + 16 (high nibble). Written into one float32 tensor in
    place: a model's whole embedding dequantizes without temporaries of its size."""
    num_rows = weight.shape[0]
    blocks = weight.reshape(num_rows, -1, QUANT_BLOCK_BYTES[qtype])  # [N, K / 32, block_bytes]
    d = blocks[..., 0:2].contiguous().view(torch.float16).float()  # [N, K / 32, 1]
    out = torch.empty(num_rows, blocks.shape[1], QUANT_BLOCK, dtype=torch.float32, device=weight.device)  # [N,K/32,32]
    if qtype == "Q8_0":
        out.copy_(blocks[..., 2:].view(torch.int8))
        return out.mul_(d).reshape(num_rows, -1)
    nibbles = blocks[..., -16:]  # [N, K / 32, 16]
    out[..., :16].copy_(nibbles & 0x0F)
    out[..., 16:].copy_(nibbles >> 4)
    if qtype == "Q4_0":
        return out.sub_(8).mul_(d).reshape(num_rows, -1)
    m = blocks[..., 2:4].contiguous().view(torch.float16).float()
    return out.mul_(d).add_(m).reshape(num_rows, -1)


def quant_type_name(qtype: str | int) -> str:
    """The format's name ("Q4_1") from a name, ggml's type id or a ``gguf.GGMLQuantizationType``; ValueError for a
    format the kernels do not read."""
    if isinstance(qtype, str):
        name = qtype.upper()
        if name in QUANT_TYPES:
            return name
    elif isinstance(qtype, int) and int(qtype) in _TYPE_NAMES:
        return _TYPE_NAMES[int(qtype)]
    supported = ", ".join(QUANT_TYPES)
    shown = getattr(qtype, "name", qtype)
    raise ValueError(f"unsupported quantization type {shown!r}; the kernels read {supported}")


@dataclass(frozen=True)
class QuantizedWeight:
    """A weight matrix ``[N, K]`` kept as GGUF blocks: ``data`` uint8 ``[N, K / 32 * block_bytes]``.

    Rows are independent, so fused projections (q/k/v, gate/up) are the row concatenation of their blocks
    (:meth:`cat`). ``linear(x, qw)`` dispatches here."""

    data: torch.Tensor
    qtype: str
    shape: tuple[int, int]

    def __post_init__(self) -> None:
        qtype = quant_type_name(self.qtype)
        object.__setattr__(self, "qtype", qtype)
        num_rows, k = self.shape
        if k % QUANT_BLOCK or self.data.dtype != torch.uint8:
            raise ValueError(f"QuantizedWeight: K = {k} must be a multiple of 32 and data uint8, got {self.data.dtype}")
        expected = (num_rows, k // QUANT_BLOCK * QUANT_BLOCK_BYTES[qtype])
        if tuple(self.data.shape) != expected:
            raise ValueError(f"QuantizedWeight: {qtype} [{num_rows}, {k}] needs data {expected}, got {self.data.shape}")

    @property
    def qtype_id(self) -> int:
        return QUANT_TYPES[self.qtype]

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
        """Row concatenation of matrices of one format and K."""
        qtype, k = parts[0].qtype, parts[0].shape[1]
        if any(p.qtype != qtype or p.shape[1] != k for p in parts):
            raise ValueError("QuantizedWeight.cat: the parts must share qtype and K")
        data = torch.cat([p.data for p in parts]).contiguous()
        return QuantizedWeight(data, qtype, (sum(p.shape[0] for p in parts), k))
