"""Reading GGUF checkpoints (llama.cpp's single-file format) into our Llama-family model.

Glossary:

- **GGUF**: one file holding metadata (key -> value: the config, the tokenizer, the chat template) and tensors, each
  in a **ggml type**: a float type (F32, F16, BF16) or a block-quantized one. A block holds consecutive weights of
  one row: 32 for Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 (an fp16 scale d, for the _1 types an fp16 minimum m, then the quants;
  Q4_0: 18 bytes, w = d * (q - 8)), 256 for the K-quants Q2_K, Q3_K, Q4_K, Q5_K, Q6_K (super-blocks with small
  integer scales per 16 or 32 weights). llama.cpp's _S/_M/_L files mix these types per tensor.
  ``spec_kernels.types.QUANT_FORMATS`` holds each type's sizes; csrc/quant_blocks_cpu.h draws the layouts.
- **Q/K permutation**: llama.cpp's converter reorders the rows of q_proj and k_proj in each head from HF's
  "half-split" RoPE layout (x[:D/2], x[D/2:]) to interleaved pairs (x0, x1), ... We undo it at load, so the
  weights are HF's and the model runs HF's rotary embedding.
- Tensor shapes: GGUF lists dimensions innermost first (``[K, N]`` for a weight of N output rows of K inputs);
  here every shape is in torch order, ``(N, K)``.

The file is parsed with the ``gguf`` package (llama.cpp's own Python reader). Our dequantization (torch, float32) is
bit-for-bit ``gguf.quants.dequantize``'s, which is what transformers uses, only faster.
"""

from __future__ import annotations

import functools
import logging
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from spec_engine.models.config import ModelConfig
from spec_engine.models.families import split_fused, weight_dtype
from spec_engine.models.gguf_arch import GGUF_ARCHITECTURES, ROPE_FREQS, gguf_config, hf_name
from spec_kernels.types import QUANT_FORMATS, dequantize_ref

log = logging.getLogger("spec_engine.models.gguf")

FLOAT_TYPES = ("F32", "F16", "BF16")
SUPPORTED_TYPES = FLOAT_TYPES + tuple(QUANT_FORMATS)


@dataclass
class RawTensor:
    """One checkpoint tensor as the file stores it, under its HF name.

    Attributes
    ----------
    data : quantized types: ``torch.uint8 [N, K // block_weights * block_bytes]``, row n holding the blocks of output
        feature n in input order (``QUANT_FORMATS``: Q8_0 34 bytes per 32 weights, Q4_K 144 per 256, ...); float
        types: the stored dtype (float32, float16, bfloat16) in the logical shape.
        q_proj / k_proj rows are already un-permuted (HF's order), whatever the type.
    type_name : the ggml type: "F32", "F16", "BF16" or a key of ``QUANT_FORMATS`` ("Q8_0", "Q4_K", ...).
    shape : the logical shape in torch order, ``(N, K)`` for a weight (N output features, K inputs).
    """

    data: torch.Tensor
    type_name: str
    shape: tuple[int, ...]

    @property
    def quantized(self) -> bool:
        return self.type_name in QUANT_FORMATS

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weights in ``dtype``, computed in float32 exactly as ``gguf.quants.dequantize``. Shape: ``shape``."""
        if not self.quantized:
            return self.data.to(dtype)
        return dequantize_ref(self.data, self.type_name).reshape(self.shape).to(dtype)


def unpermute_qk_rows(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (``convert_hf_to_gguf``'s ``permute``) on the rows of ``w``.

    llama.cpp stores head h's rows as interleaved pairs (row 2i, 2i+1 = HF rows i, i + D/2); HF keeps the two
    halves apart. Works on float weights and on rows of quantized blocks alike: only rows move.

    Shapes: ``w [num_heads * D, ...]`` -> same.
    """
    d = w.shape[0] // num_heads
    return w.reshape(num_heads, d // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def permute_qk_rows(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp's Q/K row permutation (HF -> GGUF order), the inverse of ``unpermute_qk_rows``; for writers."""
    d = w.shape[0] // num_heads
    return w.reshape(num_heads, 2, d // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


class GGUFFile:
    """A parsed GGUF file: ``metadata`` (key -> Python value) and its tensors, read lazily (memory-mapped).

    Parsing takes seconds on a real vocabulary (the reader walks every token string), so ``open_gguf`` caches
    the parse per file: the config, the weights, the tokenizer and the chat template all come from one read. The
    reader itself is dropped once read: its fields hold a few numpy views per token string (~500,000 objects on a
    49,152-token vocabulary), which every full garbage collection of the process then walked (~0.2 s each).
    """

    def __init__(self, path: str | Path):
        import gguf

        self.path = Path(path)
        try:
            reader = gguf.GGUFReader(str(self.path))
        except (ValueError, OSError, struct.error) as e:
            raise ValueError(f"corrupt or unreadable GGUF file {self.path}: {e}") from e
        self.metadata = {k: self._value(f) for k, f in reader.fields.items()}
        self.tensors = {t.name: t for t in reader.tensors}
        self._mapped = reader.data  # the file's memory map (the tensors' data are views of it)

    @staticmethod
    def _value(field):
        try:
            return field.contents()
        except Exception:  # a value type the reader cannot render (never one we read)
            return None

    def get(self, key: str, default=None):
        value = self.metadata.get(key)
        return default if value is None else value

    def release_pages(self) -> None:
        """Drop the file's pages from this process's resident memory once its tensors are copied out: the parse stays
        cached (``open_gguf``), and the mapping with it, so every page read stayed resident beside its copy, twice
        a quantized model's size. A later read pages them back in from the file."""
        mapped = getattr(self._mapped, "_mmap", None)  # (numpy's memmap keeps its mmap.mmap there)
        if mapped is not None and hasattr(mmap, "MADV_DONTNEED"):
            mapped.madvise(mmap.MADV_DONTNEED)


@functools.lru_cache(maxsize=2)
def _open_cached(path: str, mtime_ns: int, size: int) -> GGUFFile:
    return GGUFFile(path)


def open_gguf(path: str | Path) -> GGUFFile:
    """The parsed file at ``path``, cached while the file is unchanged."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    st = path.stat()
    return _open_cached(str(path.resolve()), st.st_mtime_ns, st.st_size)


def is_gguf(path: str | Path) -> bool:
    """True for a file that starts with the GGUF magic."""
    path = Path(path)
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def _raw(f: GGUFFile, t, cfg: ModelConfig, permute: bool) -> RawTensor:
    type_name = t.tensor_type.name
    shape = tuple(int(s) for s in reversed(t.shape.tolist()))  # GGUF lists dims innermost first
    if type_name not in SUPPORTED_TYPES:
        raise ValueError(
            f"{f.path}: tensor {t.name} has ggml type {type_name}, which specdec does not read; supported: "
            f"{', '.join(SUPPORTED_TYPES)} (requantize, e.g. llama-quantize --allow-requantize IN OUT Q8_0)"
        )
    arr = np.asarray(t.data)
    if type_name in QUANT_FORMATS:
        block = QUANT_FORMATS[type_name].block_weights
        if len(shape) != 2 or shape[1] % block:
            raise ValueError(
                f"{f.path}: {type_name} tensor {t.name} of shape {shape}: rows of {block}-weight blocks expected"
            )
        data = torch.from_numpy(arr.copy()).reshape(shape[0], -1)  # [N, K // block_weights * block_bytes]
    elif type_name == "BF16":
        data = torch.from_numpy(arr.view(np.uint16).copy()).view(torch.bfloat16).reshape(shape)
    else:
        data = torch.from_numpy(arr.copy()).reshape(shape)
    if permute and t.name.endswith(("attn_q.weight", "attn_k.weight")):
        heads = cfg.num_attention_heads if "attn_q" in t.name else cfg.num_key_value_heads
        data = unpermute_qk_rows(data, heads)
    return RawTensor(data, type_name, shape)


def read_gguf_raw(path: str | Path) -> tuple[ModelConfig, dict[str, RawTensor]]:
    """The config and every tensor of a GGUF checkpoint as stored, under HF names (no dequantization).

    Returns
    -------
    config : ``ModelConfig`` from the metadata.
    tensors : HF name (``model.layers.0.self_attn.q_proj.weight``, ...) -> ``RawTensor``. A quantized 2-D weight
        stays as its blocks: ``data`` is ``torch.uint8 [N, K // block_weights * block_bytes]`` (``QUANT_FORMATS``),
        ``shape == (N, K)``, ``type_name`` its ggml type; q_proj / k_proj rows are already in HF's order.
        ``lm_head.weight`` is absent when the embeddings are tied.

    Raises ValueError for an unsupported architecture, a tensor of an unsupported type, or an unknown tensor name.
    """
    f = open_gguf(path)
    cfg = gguf_config(f)
    arch = f.get("general.architecture")
    out: dict[str, RawTensor] = {}
    for name, t in f.tensors.items():
        if name == ROPE_FREQS:
            continue
        hf = hf_name(arch, name)
        if hf is None:
            raise ValueError(f"{f.path}: unexpected tensor {name!r} for architecture {arch}")
        out[hf] = _raw(f, t, cfg, GGUF_ARCHITECTURES[arch].permuted_qk)
    f.release_pages()
    return cfg, split_fused(cfg, out)


def read_gguf(path: str | Path, dtype: torch.dtype = torch.float32) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The config and the HF state dict of a GGUF checkpoint, every tensor dequantized to ``dtype``."""
    cfg, raw = read_gguf_raw(path)
    return cfg, {name: r.dequantize(weight_dtype(cfg, name, dtype)) for name, r in raw.items()}


def gguf_path_or_none(model: str | Path) -> Path | None:
    """``model`` as a GGUF file path, or None when it is something else (an HF directory)."""
    p = Path(model)
    if p.suffix.lower() == ".gguf" or (p.is_file() and is_gguf(p)):
        return p
    return None


__all__ = [
    "GGUF_ARCHITECTURES",
    "SUPPORTED_TYPES",
    "GGUFFile",
    "RawTensor",
    "gguf_config",
    "gguf_path_or_none",
    "open_gguf",
    "permute_qk_rows",
    "read_gguf",
    "read_gguf_raw",
    "unpermute_qk_rows",
]
