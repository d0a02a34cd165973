"""The model families of GGUF files: llama.cpp's architecture names, metadata keys and tensor names, read into our
``ModelConfig`` and HF tensor names. (The file format, its types and the tokenizer: ``spec_engine.models.gguf``.)"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from spec_engine.models.config import FREQ_FACTORS, ModelConfig

if TYPE_CHECKING:
    from spec_engine.models.gguf import GGUFFile

# GGUF general.architecture -> (our model_type, whether llama.cpp permuted the Q/K rows when converting)
GGUF_ARCHITECTURES = {"llama": ("llama", True), "qwen2": ("qwen2", False), "qwen3": ("qwen3", False)}

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
ROPE_FREQS = "rope_freqs.weight"  # a config tensor (the RoPE frequencies' divisors), read into ModelConfig.rope
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}  # fmt: skip


def gguf_config(f: GGUFFile) -> ModelConfig:
    """Our ``ModelConfig`` from the file's metadata; ValueError for an architecture we do not run."""
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
    if ROPE_FREQS in f.tensors:  # Llama 3's scaling, as the converter stores it: the frequencies' divisors
        if rope["rope_type"] != "default":
            raise ValueError(f"{f.path}: {ROPE_FREQS} together with {scaling} RoPE scaling is not supported")
        factors = np.asarray(f.tensors[ROPE_FREQS].data, dtype=np.float32).reshape(-1)  # [head_dim // 2]
        rope = {**rope, "rope_type": FREQ_FACTORS, "factors": [float(x) for x in factors]}
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


def hf_name(name: str) -> str | None:
    """The HF name of a llama.cpp tensor name, or None for a name we do not know."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    return None
