"""Tiny GGUF files written in the test session with ``gguf.GGUFWriter``, the way llama.cpp's ``convert_hf_to_gguf``
writes them: llama.cpp tensor names, Q/K rows permuted (llama), norms and biases in F32, every other weight in the
chosen type. No downloads."""

from __future__ import annotations

import json
import math
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import load_file

GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "self_attn.qkv_proj.weight": "attn_qkv.weight",  # Phi-3's fused matrices
    "mlp.gate_up_proj.weight": "ffn_up.weight",
}


# Gemma 2 / 3: the norm after attention, and the MLP's input and output norms
GEMMA_LAYER_NAMES = {
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}
GEMMA_ARCHS = ("gemma2", "gemma3")


def gguf_name(hf: str, arch: str = "llama") -> str:
    if hf in GGUF_NAMES:
        return GGUF_NAMES[hf]
    _, _, i, rest = hf.split(".", 3)
    names = {**LAYER_NAMES, **(GEMMA_LAYER_NAMES if arch in GEMMA_ARCHS else {})}
    return f"blk.{i}.{names[rest]}"


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf's ``LlamaModel.permute``, written out here independently of the loader's inverse."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_factors(cfg: dict, rope: dict) -> np.ndarray:
    """convert_hf_to_gguf's ``rope_freqs.weight`` for Llama 3's RoPE scaling, [head_dim // 2] float32: 1 where the
    wavelength is short, ``factor`` where it is long, the smoothed divisor between. (The converter reads
    original_max_position_embeddings from the top level, defaulting to Llama 3's 8192; ours is rope's own, which HF
    uses, so that a tiny test context means what it says.)"""
    dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_len = rope["original_max_position_embeddings"]
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old_len / high:
            out.append(1.0)
        elif wavelen > old_len / low:
            out.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def stored(w: np.ndarray, qtype: str) -> tuple[np.ndarray, gguf.GGMLQuantizationType]:
    """``w`` (float32) as the writer takes it in ggml type ``qtype``."""
    t = gguf.GGMLQuantizationType[qtype]
    if qtype == "F32":
        return w.astype(np.float32), t
    if qtype == "F16":
        return w.astype(np.float16), t
    return gguf.quants.quantize(w.astype(np.float32), t), t


def dequantized(w: np.ndarray, qtype: str) -> np.ndarray:
    """What a reader gets back from ``stored(w, qtype)``, by gguf's own dequantization (float32)."""
    data, t = stored(w, qtype)
    return gguf.quants.dequantize(data, t).reshape(w.shape).astype(np.float32)


def write_gguf(path: Path, hf_dir: Path, qtype: str = "F32", *, arch: str = "llama", tokenizer: dict | None = None,
               chat_template: str | None = None, type_of: dict | None = None) -> Path:  # fmt: skip
    """The HF checkpoint in ``hf_dir`` as a GGUF file; 2-D weights in ``qtype`` (``type_of``: per HF name overrides).

    ``tokenizer``: the metadata ``add_tokenizer`` writes.
    """
    cfg = json.loads((hf_dir / "config.json").read_text())
    state = load_file(str(hf_dir / "model.safetensors"))
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    params = cfg.get("rope_parameters") or {}
    params = params.get("full_attention", params)  # (Gemma 3's are per layer type: the global layers' base)
    w.add_rope_freq_base(float(cfg.get("rope_theta") or params.get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_dimension_count(cfg.get("head_dim") or cfg["hidden_size"] // heads)
    if arch == "qwen3":  # its heads are not hidden / heads wide
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    if arch in GEMMA_ARCHS:  # (llama.cpp fixes which layers slide, the local base and the query scale)
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
        w.add_sliding_window(cfg["sliding_window"])
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if cfg.get(key) is not None:
                getattr(w, f"add_{key}")(cfg[key])
    if arch == "phi3":
        w.add_rope_scaling_orig_ctx_len(cfg.get("original_max_position_embeddings") or cfg["max_position_embeddings"])
        w.add_sliding_window(cfg.get("sliding_window") or 0)  # (0: none)
    w.add_vocab_size(cfg["vocab_size"])
    if tokenizer is not None:
        add_tokenizer(w, tokenizer)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if rope.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_rope_factors(cfg, rope))
    for name, t in state.items():
        t = t.astype(np.float32)
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            t = llama_cpp_permute(t, heads if "q_proj" in name else kv_heads)
        if arch in GEMMA_ARCHS and name.endswith("norm.weight"):
            t = t + np.float32(1.0)  # the converter stores Gemma's norm multipliers 1 + w
        kind = (type_of or {}).get(name, qtype) if t.ndim == 2 else "F32"
        data, raw = stored(t, kind)
        w.add_tensor(gguf_name(name, arch), data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def add_tokenizer(w: gguf.GGUFWriter, tokenizer: dict) -> None:
    """``tokenizer.ggml.*`` metadata, as llama.cpp's converter writes it. ``tokenizer``: ``{"tokens", "types", "bos",
    "eos", "add_bos"}`` and, for byte-level BPE (``"model"`` absent or ``"gpt2"``), ``{"merges", "pre"}``; for
    SentencePiece (``"model": "llama"``), ``{"scores", "unk", "add_space_prefix"}`` (absent or None: no key)."""
    model = tokenizer.get("model", "gpt2")
    w.add_tokenizer_model(model)
    w.add_token_list(tokenizer["tokens"])
    w.add_token_types(tokenizer["types"])
    if model == "gpt2":
        w.add_tokenizer_pre(tokenizer.get("pre", "gpt-2"))
        w.add_token_merges(tokenizer["merges"])
    else:
        w.add_token_scores(tokenizer["scores"])
    for key, add in (("bos", w.add_bos_token_id), ("eos", w.add_eos_token_id), ("unk", w.add_unk_token_id),
                     ("add_space_prefix", w.add_add_space_prefix)):  # fmt: skip
        if tokenizer.get(key) is not None:
            add(tokenizer[key])
    w.add_add_bos_token(tokenizer.get("add_bos", False))


def tokenizer_metadata(tok, specials: list[str], pre: str = "gpt-2") -> dict:
    """The ``tokenizer.ggml.*`` metadata of a byte-level BPE ``tokenizers.Tokenizer`` (as convert_hf_to_gguf
    writes it): every token by id, the added specials as control tokens (type 3), the merges as "a b" strings."""
    spec = json.loads(tok.to_str())
    vocab = {**spec["model"]["vocab"], **{t["content"]: t["id"] for t in spec["added_tokens"]}}
    tokens = [None] * len(vocab)
    for t, i in vocab.items():
        tokens[i] = t
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    types = [3 if t in specials else 1 for t in tokens]
    return {"tokens": tokens, "types": types, "merges": merges, "pre": pre}


def chatml_tokenizer(specials: list[str], digits_apart: bool = True, vocab_size: int = 400):
    """A byte-level BPE trained here with ``specials`` as its first ids, pre-tokenized as SmolLM2's (each digit
    apart, then GPT-2's regex: llama.cpp's "smollm") or as GPT-2's."""
    from tiny_models import CORPUS
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    digits_first = pre_tokenizers.Sequence([pre_tokenizers.Digits(True), byte_level])
    tok.pre_tokenizer = digits_first if digits_apart else byte_level
    tok.decoder = decoders.ByteLevel()
    corpus = CORPUS + ["numbers 12345 and 2024, x = 3.14; ½ ② Ⅷ", "   indented\n\t\ttabs  \n\n"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tok.train_from_iterator(corpus * 4, trainer)
    return tok


# SentencePiece's "▁" (a space in a token's text) and llama.cpp's token types
SPACE = "\u2581"
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
SPM_CONTROL = ["<|user|>", "<|assistant|>", "<|end|>"]
SPM_USER_DEFINED = ["<tool>", "[[", "]]"]
SPM_CORPUS = [
    "the quick brown fox jumps over the lazy dog. ",
    "hello world, hello server, hello client. the theme of these three is there. ",
    "speculative decoding drafts tokens and the target verifies them in one pass. ",
    "def fib(n): return n if n < 2 else fib(n - 1) + fib(n - 2) ",
    "numbers 12345 and 2024, x = 3.14; naive cafe deja vu, Ελληνικά. ",
]


def spm_metadata(gemma: bool = False, vocab_size: int = 240) -> dict:
    """A SentencePiece vocabulary as llama.cpp's converter writes Llama 2's, or Gemma's (``gemma``: its first five
    tokens, no space prefix), for ``add_tokenizer``: the unknown and control tokens, ``SPM_CONTROL``, the 256 byte
    tokens ``<0x00>``..``<0xFF>``, then pieces best-scored first: the pieces a BPE trained here (on "▁"-prefixed
    words, as SentencePiece's BPE) made, scored -1, -2, ... in the order it made them, then its single characters
    below those; last ``SPM_USER_DEFINED`` and an unused token. No character of "\n", CJK or emoji is a piece: they
    encode as bytes."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme="always", split=True)
    tok.train_from_iterator(SPM_CORPUS * 4, trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False))
    model = json.loads(tok.to_str())["model"]
    made = list(dict.fromkeys(left + right for left, right in model["merges"]))
    chars = sorted((t for t in model["vocab"] if len(t) == 1), key=model["vocab"].get)
    first = {"<pad>": CONTROL, "<eos>": CONTROL, "<bos>": CONTROL, "<unk>": UNKNOWN, "<mask>": CONTROL} if gemma else {
        "<unk>": UNKNOWN, "<s>": CONTROL, "</s>": CONTROL}  # fmt: skip
    tokens = [*first, *SPM_CONTROL, *(f"<0x{b:02X}>" for b in range(256))]
    types = [*first.values(), *[CONTROL] * len(SPM_CONTROL), *[BYTE] * 256]
    scores = [0.0] * len(tokens)
    for rank, piece in enumerate(made + chars):
        tokens.append(piece), types.append(NORMAL), scores.append(-1.0 - rank)
    for piece, ty in [*((p, USER_DEFINED) for p in SPM_USER_DEFINED), ("<unused0>", UNUSED)]:
        tokens.append(piece), types.append(ty), scores.append(-1000.0)  # (the converter's score for both)
    ends = ["<bos>", "<eos>", "<unk>"] if gemma else ["<s>", "</s>", "<unk>"]
    ids = {name: tokens.index(text) for name, text in zip(["bos", "eos", "unk"], ends)}
    return {"model": "llama", "tokens": tokens, "types": types, "scores": scores, **ids, "add_bos": True,
            "add_space_prefix": False if gemma else None}  # fmt: skip
