"""Each model family's class, and what its checkpoint holds beyond our model's layout, turned into it at load.

- **Fused matrices** (Phi-3, in its HF checkpoints and its GGUF files alike): q/k/v as one ``qkv_proj`` and gate/up
  as one ``gate_up_proj``. They are split by rows into the separate HF names the model has; rows are independent, so
  a quantized matrix splits into the blocks of its row ranges, bit for bit.
- **Gemma 3's image-text checkpoints** keep the text model under ``language_model.``: read without the vision tower.
- **Gemma's norms** hold ``w`` in HF checkpoints and ``1 + w`` in llama.cpp's files (its converter adds the 1); the
  model holds ``1 + w`` in float32 (``spec_engine.models.gemma``), so an HF checkpoint's are folded here.
"""

from __future__ import annotations

import dataclasses

import torch

from spec_engine.models.config import ModelConfig
from spec_engine.models.gemma import GemmaForCausalLM
from spec_engine.models.llama import LlamaForCausalLM

# a fused matrix's HF suffix -> the suffixes of its parts, in row order
FUSED = {
    "self_attn.qkv_proj.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
}


def _part_rows(cfg: ModelConfig, fused: str) -> tuple[int, ...]:
    if fused.startswith("self_attn"):
        kv = cfg.num_key_value_heads * cfg.head_dim
        return cfg.num_attention_heads * cfg.head_dim, kv, kv
    return cfg.intermediate_size, cfg.intermediate_size


def _rows(t, start: int, stop: int):
    """Rows ``start:stop`` of a tensor or of a GGUF ``RawTensor`` (whose ``data`` rows are its output rows, as
    floats or as each row's blocks)."""
    if isinstance(t, torch.Tensor):
        return t[start:stop]
    return dataclasses.replace(t, data=t.data[start:stop], shape=(stop - start, *t.shape[1:]))


def split_fused(cfg: ModelConfig, state: dict) -> dict:
    """``state`` (HF name -> tensor or ``RawTensor``) with every fused matrix replaced by its parts; ValueError for
    a fused matrix whose rows do not add up to its parts'."""
    out = {}
    for name, t in state.items():
        suffix = next((s for s in FUSED if name.endswith(s)), None)
        if suffix is None:
            out[name] = t
            continue
        sizes = _part_rows(cfg, suffix)
        if t.shape[0] != sum(sizes):
            raise ValueError(f"{name} has {t.shape[0]} rows; its parts {FUSED[suffix]} take {sum(sizes)}")
        prefix, start = name.removesuffix(suffix), 0
        for part, n in zip(FUSED[suffix], sizes):
            out[prefix + part] = _rows(t, start, start + n)
            start += n
    return out


def model_class(cfg: ModelConfig) -> type[LlamaForCausalLM]:
    """The module class of ``cfg``'s family."""
    return GemmaForCausalLM if cfg.is_gemma else LlamaForCausalLM


def weight_dtype(cfg: ModelConfig, name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype our model holds checkpoint tensor ``name`` in when it runs in ``dtype``: float32 for Gemma's norms
    (their ``1 + w`` would round in 16 bits), else ``dtype``."""
    return torch.float32 if cfg.is_gemma and name.endswith("norm.weight") else dtype


# Gemma 3's image-text checkpoints: its text model's prefix, and the vision parts left unread
_TEXT_MODEL_PREFIX = "language_model."
_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.")


def hf_state(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An HF checkpoint's tensors in the layout our model holds (see the module docstring); an image-text Gemma 3
    checkpoint's text model alone."""
    if cfg.is_gemma and any(n.startswith(_TEXT_MODEL_PREFIX) for n in state):
        state = {n.removeprefix(_TEXT_MODEL_PREFIX): t for n, t in state.items() if not n.startswith(_VISION_PREFIXES)}
    state = split_fused(cfg, state)
    if cfg.is_gemma:  # in float32, as HF's own (1.0 + self.weight.float())
        state = {n: t.float() + 1.0 if n.endswith("norm.weight") else t for n, t in state.items()}
    return state
