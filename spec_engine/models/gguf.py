"""Reading GGUF checkpoints (llama.cpp's single-file format) into our Llama-family model.

Glossary:

- **GGUF**: one file holding metadata (key -> value: the config, the tokenizer, the chat template) and tensors, each
  in a **ggml type**: a float type (F32, F16, BF16) or a block-quantized one. A block holds 32 consecutive weights of
  one row: Q8_0 = fp16 scale d + 32 int8 (34 bytes, w = d * q); Q4_0 = d + 16 bytes of 4-bit q (18 bytes,
  w = d * (q - 8)); Q4_1 = d + fp16 minimum m + 16 bytes (20 bytes, w = d * q + m). In a 4-bit block, weight j < 16
  is the low nibble of byte j and weight j + 16 its high nibble.
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
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from spec_engine.models.config import ModelConfig
from spec_kernels.types import QUANT_BLOCK, QUANT_BLOCK_BYTES, dequantize_ref

log = logging.getLogger("spec_engine.models.gguf")

# GGUF general.architecture -> (our model_type, whether llama.cpp permuted the Q/K rows when converting)
GGUF_ARCHITECTURES = {"llama": ("llama", True), "qwen2": ("qwen2", False), "qwen3": ("qwen3", False)}
FLOAT_TYPES = ("F32", "F16", "BF16")
SUPPORTED_TYPES = FLOAT_TYPES + tuple(QUANT_BLOCK_BYTES)

# llama.cpp's per-layer tensor names -> HF's (prefix "model.layers.N.")
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}  # fmt: skip


@dataclass
class RawTensor:
    """One checkpoint tensor as the file stores it, under its HF name.

    Attributes
    ----------
    data : quantized types: ``torch.uint8 [N, K // 32 * bytes_per_block]``, row n holding the blocks of output
        feature n in input order (Q8_0: 34 bytes per block, Q4_0: 18, Q4_1: 20; the layout of the module
        docstring); float types: the stored dtype (float32, float16, bfloat16) in the logical shape.
        q_proj / k_proj rows are already un-permuted (HF's order), whatever the type.
    type_name : the ggml type: "F32", "F16", "BF16", "Q8_0", "Q4_0" or "Q4_1".
    shape : the logical shape in torch order, ``(N, K)`` for a weight (N output features, K inputs).
    """

    data: torch.Tensor
    type_name: str
    shape: tuple[int, ...]

    @property
    def quantized(self) -> bool:
        return self.type_name in QUANT_BLOCK_BYTES

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
    the parse per file: the config, the weights, the tokenizer and the chat template all come from one read.
    """

    def __init__(self, path: str | Path):
        import gguf

        self.path = Path(path)
        try:
            self.reader = gguf.GGUFReader(str(self.path))
        except (ValueError, OSError, struct.error) as e:
            raise ValueError(f"corrupt or unreadable GGUF file {self.path}: {e}") from e
        self.metadata = {k: self._value(f) for k, f in self.reader.fields.items()}
        self.tensors = {t.name: t for t in self.reader.tensors}

    @staticmethod
    def _value(field):
        try:
            return field.contents()
        except Exception:  # a value type the reader cannot render (never one we read)
            return None

    def get(self, key: str, default=None):
        value = self.metadata.get(key)
        return default if value is None else value


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


def gguf_config(f: GGUFFile) -> ModelConfig:
    """Our ``ModelConfig`` from the file's metadata; ValueError for an architecture we do not run."""
    arch = f.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"{f.path}: unsupported GGUF architecture {arch!r}; specdec reads {', '.join(GGUF_ARCHITECTURES)}"
        )
    if "rope_freqs.weight" in f.tensors:
        raise ValueError(f"{f.path}: per-frequency RoPE factors (rope_freqs.weight, Llama 3.1 style) are not supported")

    def key(name, default=None):
        return f.get(f"{arch}.{name}", default)

    def need(name):
        value = key(name)
        if value is None:
            raise ValueError(f"{f.path}: the metadata lacks {arch}.{name}")
        return value

    try:
        return _gguf_config(f, arch, key, need)
    except (TypeError, ValueError) as e:  # (a value of the wrong type: int() of a string, a list...)
        raise ValueError(e if str(f.path) in str(e) else f"{f.path}: {e}") from None


def _gguf_config(f: GGUFFile, arch: str, key, need) -> ModelConfig:
    num_heads = int(need("attention.head_count"))
    hidden = int(need("embedding_length"))
    tokens = f.get("tokenizer.ggml.tokens")
    vocab = key("vocab_size") or (len(tokens) if tokens else None)
    if vocab is None:
        vocab = int(f.tensors["token_embd.weight"].shape[-1])
    head_dim = key("attention.key_length") or key("rope.dimension_count") or hidden // num_heads
    rope = {"rope_type": "default", "rope_theta": float(key("rope.freq_base", 10000.0))}
    scaling = key("rope.scaling.type")
    if scaling == "linear":
        rope = {**rope, "rope_type": "linear", "factor": float(need("rope.scaling.factor"))}
    elif scaling not in (None, "none"):
        raise ValueError(f"{f.path}: unsupported RoPE scaling {scaling!r}; supported: none, linear")
    eos = [f.get(k) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")]
    hf = {
        "model_type": GGUF_ARCHITECTURES[arch][0],
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(key("attention.head_count_kv", num_heads)),
        "head_dim": int(head_dim),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(key("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in f.tensors,
        "rope_parameters": rope,
        "bos_token_id": f.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": list(dict.fromkeys(int(e) for e in eos if e is not None)),
        "use_sliding_window": False,
    }
    if arch == "qwen2":  # Qwen2 always has q/k/v biases; the config says so for ModelConfig's sake
        hf["attention_bias"] = True
    return ModelConfig.from_dict(hf)


def _hf_name(name: str) -> str | None:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    return None


def _raw(f: GGUFFile, t, cfg: ModelConfig, permute: bool) -> RawTensor:
    type_name = t.tensor_type.name
    shape = tuple(int(s) for s in reversed(t.shape.tolist()))  # GGUF lists dims innermost first
    if type_name not in SUPPORTED_TYPES:
        raise ValueError(
            f"{f.path}: tensor {t.name} has ggml type {type_name}, which specdec does not read; supported: "
            f"{', '.join(SUPPORTED_TYPES)} (requantize, e.g. llama-quantize --allow-requantize IN OUT Q8_0)"
        )
    arr = np.asarray(t.data)
    if type_name in QUANT_BLOCK_BYTES:
        if len(shape) != 2 or shape[1] % QUANT_BLOCK:
            raise ValueError(f"{f.path}: quantized tensor {t.name} of shape {shape}: rows of 32-weight blocks expected")
        data = torch.from_numpy(arr.copy()).reshape(shape[0], -1)  # [N, K // 32 * bytes_per_block]
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
        stays as its blocks: ``data`` is ``torch.uint8 [N, K // 32 * bytes_per_block]`` (Q8_0: 34, Q4_0: 18,
        Q4_1: 20 bytes per block), ``shape == (N, K)``, ``type_name`` its ggml type; q_proj / k_proj rows are
        already in HF's order. ``lm_head.weight`` is absent when the embeddings are tied.

    Raises ValueError for an unsupported architecture, a tensor of an unsupported type, or an unknown tensor name.
    """
    f = open_gguf(path)
    cfg = gguf_config(f)
    permute = GGUF_ARCHITECTURES[f.get("general.architecture")][1]
    out: dict[str, RawTensor] = {}
    for name, t in f.tensors.items():
        hf = _hf_name(name)
        if hf is None:
            raise ValueError(f"{f.path}: unexpected tensor {name!r} for architecture {cfg.model_type}")
        out[hf] = _raw(f, t, cfg, permute)
    return cfg, out


def read_gguf(path: str | Path, dtype: torch.dtype = torch.float32) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The config and the HF state dict of a GGUF checkpoint, every tensor dequantized to ``dtype``."""
    cfg, raw = read_gguf_raw(path)
    return cfg, {name: r.dequantize(dtype) for name, r in raw.items()}


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
