"""The model families of GGUF files: llama.cpp's architecture names, metadata keys and tensor names, read into our
``ModelConfig`` and HF tensor names. (The file format and its types: ``spec_engine.models.gguf``; the tokenizer:
``spec_engine.models.gguf_tokenizer``.)"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from spec_engine.models.config import FREQ_FACTORS, ModelConfig


@dataclass(frozen=True)
class GGUFArch:
    """What a GGUF ``general.architecture`` means here: our ``model_type``; whether llama.cpp permuted the Q/K rows
    when converting (its Llama RoPE rotates interleaved pairs); its per-layer tensor names that differ from
    ``LAYER_NAMES``."""

    model_type: str
    permuted_qk: bool = False
    layer_names: dict[str, str] = field(default_factory=dict)


# llama.cpp's per-layer tensor names -> HF's (prefix "model.layers.N.")
LAYER_NAMES = {
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
# Phi-3 keeps HF's fused q/k/v and gate/up matrices (split at load: spec_engine.models.families.split_fused)
_PHI3_NAMES = {"attn_qkv.weight": "self_attn.qkv_proj.weight", "ffn_up.weight": "mlp.gate_up_proj.weight"}
# Gemma's norm after attention, before and after the MLP (its ffn_norm is the MLP's input norm, as in Llama)
_GEMMA_NAMES = {
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
GGUF_ARCHITECTURES = {
    "llama": GGUFArch("llama", permuted_qk=True),
    "qwen2": GGUFArch("qwen2"),
    "qwen3": GGUFArch("qwen3"),
    "phi3": GGUFArch("phi3", layer_names=_PHI3_NAMES),
    "gemma2": GGUFArch("gemma2", layer_names=_GEMMA_NAMES),
    "gemma3": GGUFArch("gemma3_text", layer_names=_GEMMA_NAMES),
}
# llama.cpp's fixed Gemma facts, which the converter does not write: every n-th layer attends globally (n = 2, 6),
# Gemma 3's local layers rotate with base 10000 (unless the file says), and the 27B models (46, 62 layers) scale
# queries by (hidden / heads) ** -0.5 rather than head_dim ** -0.5
_GEMMA_FULL_EVERY = {"gemma2": 2, "gemma3": 6}
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
ROPE_FREQS = "rope_freqs.weight"  # a config tensor (the RoPE frequencies' divisors), read into ModelConfig.rope
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}  # fmt: skip


def gguf_config(f) -> ModelConfig:
    """Our ``ModelConfig`` from a parsed ``GGUFFile``'s metadata; ValueError for an architecture we do not run."""
    arch = f.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"{f.path}: unsupported GGUF architecture {arch!r}; specdec reads {', '.join(GGUF_ARCHITECTURES)}"
        )

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


def _gguf_config(f, arch: str, key, need) -> ModelConfig:
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
    if ROPE_FREQS in f.tensors:  # Llama 3's scaling, as the converter stores it: the frequencies' divisors
        if rope["rope_type"] != "default":
            raise ValueError(f"{f.path}: {ROPE_FREQS} together with {scaling} RoPE scaling is not supported")
        factors = np.asarray(f.tensors[ROPE_FREQS].data, dtype=np.float32).reshape(-1)  # [head_dim // 2]
        rope = {**rope, "rope_type": FREQ_FACTORS, "factors": [float(x) for x in factors]}
    eos = [f.get(k) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")]
    hf = {
        "model_type": GGUF_ARCHITECTURES[arch].model_type,
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
    if arch == "phi3":
        _phi3_config(f, hf, key)
    if arch in _GEMMA_FULL_EVERY:
        _gemma_config(arch, hf, key)
    return ModelConfig.from_dict(hf)


def hf_name(arch: str, name: str) -> str | None:
    """The HF name of architecture ``arch``'s llama.cpp tensor ``name``, or None for a name we do not know."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    parts = name.split(".", 2)
    layer_names = {**LAYER_NAMES, **GGUF_ARCHITECTURES[arch].layer_names}
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in layer_names:
        return f"model.layers.{parts[1]}.{layer_names[parts[2]]}"
    return None


def _phi3_config(f, hf: dict, key) -> None:
    """Phi-3's window (0: none, as the converter writes it) into ``hf``; ValueError for its variants we do not run:
    LongRoPE (the long / short factor tensors) and partial rotary dimensions."""
    if "rope_factors_long.weight" in f.tensors:
        raise ValueError(f"{f.path}: Phi-3's LongRoPE scaling (rope_factors_long / rope_factors_short) is not "
                         "supported; supported: the default RoPE, linear scaling, Llama 3's")  # fmt: skip
    full = hf["hidden_size"] // hf["num_attention_heads"]
    if int(key("rope.dimension_count", full)) != full:
        raise ValueError(f"{f.path}: partial rotary embeddings (rope.dimension_count < {full}) are not supported")
    hf["sliding_window"] = int(key("attention.sliding_window", 0)) or None
    hf.pop("use_sliding_window")


def _gemma_config(arch: str, hf: dict, key) -> None:
    """Gemma 2 / 3's fields into ``hf`` (an HF config dict), as llama.cpp reads the file (``_GEMMA_FULL_EVERY``)."""
    n = hf["num_hidden_layers"]
    every = int(key("attention.sliding_window_pattern", _GEMMA_FULL_EVERY[arch]))
    window = key("attention.sliding_window")
    hf.pop("use_sliding_window")
    hf["sliding_window"] = None if window is None else int(window)
    hf["layer_types"] = ["full_attention" if window is None or (i + 1) % every == 0 else "sliding_attention"
                         for i in range(n)]  # fmt: skip
    wide = n == _GEMMA_27B_LAYERS[arch]
    scale = hf["hidden_size"] // hf["num_attention_heads"] if wide else hf["head_dim"]
    hf["query_pre_attn_scalar"] = float(scale)
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        value = key(name)
        hf[name] = None if value is None else float(value)
    if arch == "gemma3":
        hf["rope_local_base_freq"] = float(key("rope.freq_base_swa", 10000.0))
