"""Reading HF ``config.json`` files of the Llama family into one plain dataclass."""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

log = logging.getLogger("spec_engine.models")

# Gemma 2 and Gemma 3's text model: the Llama layer plus norms after attention and after the MLP, (1 + w) norms,
# scaled embeddings, GELU-tanh, soft-capping, sliding-window layers (spec_engine.models.gemma)
GEMMA_TYPES = ("gemma2", "gemma3_text")
# Gemma 3's image-text checkpoints (Gemma3ForConditionalGeneration): their text model is read, the vision tower left
GEMMA3_MULTIMODAL = "gemma3"
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "phi3", *GEMMA_TYPES, GEMMA3_MULTIMODAL)
SLIDING, FULL = "sliding_attention", "full_attention"  # HF's layer_types
# A rope_type of ours, not HF's: the frequencies divided by per-dimension factors (``factors``, head_dim / 2 of them),
# as llama.cpp's converter stores Llama 3's scaling (the ``rope_freqs.weight`` tensor of a GGUF file)
FREQ_FACTORS = "freq_factors"


@dataclass
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections carry a bias (always on for Qwen2)
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (Qwen3)
    rope: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)
    # HF's sliding_window: the attention window of the layers ``layer_types`` marks SLIDING. Where layer_types is None
    # (the Llama layout, whose native layers attend without a window) it capped max_position_embeddings instead,
    # within which windowed attention is full attention
    sliding_window: int | None = None
    # Gemma (GEMMA_TYPES) alone: each layer's SLIDING or FULL; the SLIDING layers' RoPE (Gemma 3's local base);
    # the MLP's activation; q scaled by query_pre_attn_scalar ** -0.5; soft-capped attention scores and logits
    layer_types: list[str] | None = None
    rope_local: dict | None = None
    hidden_act: str = "silu"
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None

    @property
    def is_gemma(self) -> bool:
        return self.model_type in GEMMA_TYPES

    @classmethod
    def from_dict(cls, cfg: dict) -> ModelConfig:
        """The config of an HF ``config.json``'s dict; ValueError naming the field that is missing, of the wrong
        type, or asks for what this engine does not implement."""
        if not isinstance(cfg, dict):
            raise ValueError(f"config.json must hold a JSON object, got {type(cfg).__name__}")
        try:
            return cls._from_dict(cfg)
        except KeyError as e:
            raise ValueError(f"config.json lacks {e.args[0]!r}") from None

    @classmethod
    def _from_dict(cls, cfg: dict) -> ModelConfig:
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_ARCHITECTURES:
            supported = ", ".join(SUPPORTED_ARCHITECTURES)
            raise ValueError(f"unsupported architecture model_type={model_type!r}; specdec supports {supported}")
        if model_type == GEMMA3_MULTIMODAL:
            if not isinstance(cfg.get("text_config"), dict):
                raise ValueError("a gemma3 (image-text) config.json needs its text_config")
            ids = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "tie_word_embeddings") if k in cfg}
            cfg = {**cfg["text_config"], **ids, "model_type": "gemma3_text"}
            model_type = "gemma3_text"
        gemma = model_type in GEMMA_TYPES
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or ("gelu_pytorch_tanh" if gemma else "silu")
        if act != ("gelu_pytorch_tanh" if gemma else "silu"):
            raise ValueError(f"unsupported hidden_act={act!r} for {model_type}; SwiGLU ('silu') models are supported, "
                             "and Gemma's GELU-tanh ('gelu_pytorch_tanh')")  # fmt: skip
        if cfg.get("mlp_bias"):
            raise ValueError("mlp_bias (biases on the MLP's projections) is not supported")
        partial = (cfg.get("rope_parameters") or {}).get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
        if partial != 1.0:
            raise ValueError(f"partial_rotary_factor={partial!r} (RoPE on part of each head) is not supported")
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
            _positive_int(cfg, key, required=True)
        for key in ("num_key_value_heads", "head_dim", "max_position_embeddings"):
            _positive_int(cfg, key)
        # (Qwen's configs carry a window they do not use unless use_sliding_window says so; the others use theirs)
        uses_window = cfg.get("use_sliding_window", model_type not in ("qwen2", "qwen3"))
        sliding = cfg.get("sliding_window") if uses_window else None
        if sliding is not None:
            _positive_int(cfg, "sliding_window")
        num_heads = cfg["num_attention_heads"]
        eos = token_ids(cfg.get("eos_token_id"), "eos_token_id")
        out = cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", gemma),
            attention_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
            qk_norm=model_type in ("qwen3", "gemma3_text"),
            rope=_rope_parameters(cfg),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=eos,
            hidden_act=act,
        )
        if gemma:
            _gemma_fields(out, cfg, sliding)
        elif sliding is not None and sliding < out.max_position_embeddings:
            # Attention past the window would differ from HF; cap the context instead of silently diverging.
            log.warning("%s: sliding-window attention (a window of %d positions) is not implemented; the context is "
                        "capped to %d positions, within which it equals full attention (the model declares %d)",
                        model_type, sliding, sliding, out.max_position_embeddings)  # fmt: skip
            out.max_position_embeddings = out.sliding_window = int(sliding)
        if out.num_attention_heads % out.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        return out

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        """``config.json``'s config, its stop tokens joined by ``generation_config.json``'s (where chat models name
        their end-of-turn token, as HF's ``generate`` reads it)."""
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json in {model_dir!s}: not an HF model directory")
        try:
            raw = json.loads(path.read_text())
        except (ValueError, UnicodeDecodeError) as e:  # (json.JSONDecodeError is a ValueError)
            raise ValueError(f"corrupt {path}: {e}") from None
        try:
            out = cls.from_dict(raw)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
        generation = Path(model_dir) / "generation_config.json"
        if generation.is_file():
            try:
                gen = json.loads(generation.read_text())
                extra = token_ids(gen.get("eos_token_id") if isinstance(gen, dict) else None, "eos_token_id")
            except (ValueError, UnicodeDecodeError) as e:
                raise ValueError(f"{generation}: {e}") from None
            out.eos_token_id += [t for t in extra if t not in out.eos_token_id]
        return out


def _gemma_fields(out: ModelConfig, cfg: dict, sliding: int | None) -> None:
    """Gemma's fields of ``out`` from its HF config ``cfg`` (see ``ModelConfig``): the layer types (HF's default
    pattern where the config lists none: every 2nd layer full in Gemma 2, every 6th in Gemma 3), the local RoPE
    (transformers 5's per-layer-type rope_parameters, or rope_local_base_freq), the scalars."""
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention (Gemma 3's encoder variant) is not supported")
    n = out.num_hidden_layers
    pattern = (
        2 if out.model_type == "gemma2" else cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern", 6)
    )
    types = cfg.get("layer_types") or [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(n)]
    if len(types) != n or not set(types) <= {SLIDING, FULL}:
        raise ValueError(f"layer_types must list {SLIDING!r} or {FULL!r} for each of the {n} layers, got {types!r}")
    if SLIDING in types and sliding is None:
        raise ValueError(f"layer_types has {SLIDING!r} layers but sliding_window is not set")
    out.layer_types, out.sliding_window = list(types), sliding
    params = cfg.get("rope_parameters") or {}
    if SLIDING in params:
        out.rope_local = _rope_parameters({"rope_parameters": params[SLIDING]})
    elif out.model_type == "gemma3_text":
        out.rope_local = {"rope_type": "default", "rope_theta": float(cfg.get("rope_local_base_freq", 10000.0))}
    else:
        out.rope_local = out.rope
    out.query_pre_attn_scalar = float(cfg.get("query_pre_attn_scalar") or out.head_dim)
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        value = cfg.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
            raise ValueError(f"{key} must be a positive number or null, got {value!r}")
        setattr(out, key, None if value is None else float(value))


def token_ids(value, name: str) -> list[int]:
    """A config's token id field (one id, a list, or null) as a list; ValueError for anything else."""
    ids = [] if value is None else [value] if isinstance(value, int) else value
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise ValueError(f"{name} must be a token id or a list of them, got {value!r}")
    return list(ids)


def _positive_int(cfg: dict, key: str, required: bool = False) -> None:
    value = cfg[key] if required else cfg.get(key)
    if value is not None and not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
        raise ValueError(f"{key} must be a positive integer, got {value!r}")


def _rope_parameters(cfg: dict) -> dict:
    """Normalise the two HF spellings: ``rope_parameters`` (transformers 5) and ``rope_theta`` + ``rope_scaling``."""
    params = dict(cfg.get("rope_parameters") or {})
    if FULL in params:  # per layer type (transformers 5's Gemma 3): the full-attention layers' (_gemma_fields)
        params = dict(params[FULL])
    if not params:
        params = dict(cfg.get("rope_scaling") or {})
        params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    llama3 = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    needs = {"default": (), "linear": ("factor",), "llama3": llama3, FREQ_FACTORS: ()}
    if params["rope_type"] not in needs:
        raise ValueError(f"unsupported rope_type {params['rope_type']!r}; supported: default, linear, llama3")
    if params["rope_type"] == FREQ_FACTORS:
        factors = params.get("factors")
        if not (isinstance(factors, list) and factors and all(isinstance(f, float) and f > 0 for f in factors)):
            raise ValueError(f"rope_type {FREQ_FACTORS!r} needs a list of positive float factors, got {factors!r}")
    for key in ("rope_theta", *needs[params["rope_type"]]):
        value = params.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"rope_type {params['rope_type']!r} needs a positive {key}, got {value!r}")
    return params


def rope_inv_freq(rope: dict, head_dim: int) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] in float32 (as HF computes them), with linear or llama3 scaling, or divided
    by a GGUF file's per-dimension factors (``FREQ_FACTORS``, as llama.cpp applies them)."""
    inv_freq = 1.0 / (rope["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    if rope["rope_type"] == FREQ_FACTORS:
        factors = torch.tensor(rope["factors"], dtype=torch.float32)  # [head_dim // 2]
        if factors.shape != inv_freq.shape:
            raise ValueError(
                f"RoPE frequency factors: {factors.numel()} given, head_dim {head_dim} takes {head_dim // 2}"
            )
        return inv_freq / factors
    if rope["rope_type"] == "linear":
        return inv_freq / rope["factor"]
    if rope["rope_type"] == "llama3":
        factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
        old_len = rope["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(is_medium, smoothed, scaled)
    return inv_freq
