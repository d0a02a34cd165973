"""Gemma 2 and Gemma 3 (text) on the engine's KV cache: HF transformers' layer (in bfloat16 the C++ layers keep the
residual stream in float32 and round less often, as they do for Llama's).

Gemma's layer is Llama's with:

- **(1 + w) norms**: every RMSNorm multiplies by ``1 + w``, in float32, before casting back (``GemmaRMSNorm``). The
  model holds the multiplier ``1 + w`` itself, in float32 whatever the run dtype, as llama.cpp's files store it: an
  HF checkpoint's ``w`` is folded at load (``spec_engine.models.families``), in float32, which is HF's own addition,
  so the fold is exact. (Folded into a bfloat16 weight it would round: 1 + w keeps 8 bits of mantissa.)
- **sandwich norms**: ``post_attention_layernorm`` normalises the attention's output before the residual add (in
  Llama it is the MLP's input norm), ``pre_feedforward_layernorm`` the MLP's input and
  ``post_feedforward_layernorm`` its output.
- **scaled embeddings** (by sqrt(hidden), rounded to the run dtype as HF does), a **GELU-tanh** MLP, queries scaled
  by ``query_pre_attn_scalar ** -0.5``.
- **soft-capping** (Gemma 2): attention scores ``c * tanh(s / c)`` (``tree_attention``'s ``softcap``) and final
  logits likewise.
- **sliding-window layers** (``ModelConfig.layer_types``): ``tree_attention``'s ``window``; Gemma 3's sliding layers
  rotate with their own RoPE base (``rope_local``), q and k are RMS-normed per head before RoPE.

Every forward is one ``decoder_layers`` call with Gemma's ``LayerVariant`` (on CPU the native C++ layers; the sandwich
norms are its "attn_out_norm" and "mlp_out_norm" fields). The native step runners (several steps in one C++ call) run
it too from the native handle, with the embedding's scale, the local RoPE table and Gemma 2's final soft cap: on CPU
the logits are capped by one C++ function (``spec_kernels.fused_elementwise.softcap``) that the runners' argmax and
sampling read through as well, so a native step chooses the token a regular step chooses.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from spec_engine.models.config import SLIDING, ModelConfig, rope_inv_freq
from spec_engine.models.llama import LlamaForCausalLM, RMSNorm
from spec_kernels import decoder_layers
from spec_kernels.decoder_layers import LayerVariant, native_model
from spec_kernels.fused_elementwise import softcap


class GemmaRMSNorm(RMSNorm):
    """RMSNorm whose ``weight`` is Gemma's multiplier ``1 + w`` (float32), applied in float32 before the cast."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps) * self.weight.float()).to(x.dtype)


class GemmaForCausalLM(LlamaForCausalLM):
    """``LlamaForCausalLM``'s interface (the engine's forward, logits, fuse, restricted vocabularies, GGUF blocks) over
    Gemma's layer. State dict names are HF's; the norms hold ``1 + w`` (see the module docstring)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        eps, H, D = cfg.rms_norm_eps, cfg.hidden_size, cfg.head_dim
        self.model.norm = GemmaRMSNorm(H, eps)
        for layer in self.model.layers:
            layer.input_layernorm = GemmaRMSNorm(H, eps)
            layer.post_attention_layernorm = GemmaRMSNorm(H, eps)
            layer.pre_feedforward_layernorm = GemmaRMSNorm(H, eps)
            layer.post_feedforward_layernorm = GemmaRMSNorm(H, eps)
            if cfg.qk_norm:
                layer.self_attn.q_norm, layer.self_attn.k_norm = GemmaRMSNorm(D, eps), GemmaRMSNorm(D, eps)
        self.register_buffer("inv_freq_local", rope_inv_freq(cfg.rope_local, D), persistent=False)
        self.rope_table_local: torch.Tensor | None = None  # [2, max_positions, D] for the sliding layers, once fused
        windows = tuple(cfg.sliding_window if kind == SLIDING else 0 for kind in cfg.layer_types)
        # Gemma's layer as decoder_layers takes it
        self.variant = LayerVariant(windows=windows, softmax_scale=cfg.query_pre_attn_scalar**-0.5,
                                    softcap=cfg.attn_logit_softcapping, activation="gelu_tanh",
                                    float32_norms=True)  # fmt: skip

    def reset_rope(self) -> None:
        super().reset_rope()
        self.inv_freq_local = rope_inv_freq(self.config.rope_local, self.config.head_dim)

    def fuse(self, max_positions: int | None = None) -> GemmaForCausalLM:
        super().fuse(max_positions)
        if max_positions is not None:
            positions = torch.arange(max_positions, device=self.inv_freq_local.device)
            self.rope_table_local = torch.stack(self._rope_from_freqs(positions, self.lm_head.weight.dtype,
                                                                      self.inv_freq_local))  # fmt: skip
            self._build_native()  # (the base class built it before this table)
        return self

    def _norms(self, layer) -> tuple:
        return (layer.input_layernorm.weight, layer.pre_feedforward_layernorm.weight,
                layer.post_attention_layernorm.weight, layer.post_feedforward_layernorm.weight)  # fmt: skip

    def _build_native(self) -> None:
        """The native handle with Gemma's variant and its final soft cap, once fused with both RoPE tables."""
        self.native = None
        local = getattr(self, "rope_table_local", None)
        if self.layer_weights is None or local is None:
            return
        if self.rope_table is None or not local.dtype == self.rope_table.dtype == self.lm_head.weight.dtype:
            return  # (a table of another dtype than the weights: Module.to since the fuse)
        cfg = self.config
        self.native = native_model(self._embed_weight(), self.layer_weights, self.model.norm.weight, self._head(),
                                   self.rope_table, num_heads=cfg.num_attention_heads, eps=cfg.rms_norm_eps,
                                   vocab_map=self.vocab_map, variant=self.variant, rope_local=local,
                                   embed_scale=cfg.hidden_size**0.5,
                                   final_softcap=cfg.final_logit_softcapping or 0.0)  # fmt: skip

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., hidden] -> [..., V] float32, soft-capped where the model says (-inf outside a restricted vocabulary
        stays -inf)."""
        out = super().logits(hidden)
        cap = self.config.final_logit_softcapping
        return out if cap is None else softcap(out, cap)

    def forward_train(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Causal LM logits [B, T, V] through the engine's forward over a fresh cache (the same computation)."""
        B, T = input_ids.shape
        cfg, dtype = self.config, self.lm_head.weight.dtype
        kv = torch.zeros(cfg.num_hidden_layers, 2, B, T, cfg.num_key_value_heads, cfg.head_dim, dtype=dtype,
                         device=input_ids.device)  # fmt: skip
        positions = torch.arange(T, device=input_ids.device).expand(B, T)
        mask = torch.ones(T, T, dtype=torch.bool, device=input_ids.device).tril().expand(B, T, T)
        cache_seqlens = torch.zeros(B, dtype=torch.int32, device=input_ids.device)
        return self.logits(self._decoder(input_ids, positions, kv, cache_seqlens, mask, None))

    def _rope_of(self, kind: str, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """cos and sin [2, B, T, D] of a layer kind's RoPE at positions [B, T]."""
        if kind != SLIDING:
            return self._rope(positions, dtype)
        if self.rope_table_local is not None and self.rope_table_local.dtype == dtype:
            return self.rope_table_local[:, positions]
        return torch.stack(self._rope_from_freqs(positions, dtype, self.inv_freq_local))

    def _decoder(self, input_ids, positions, kv_cache, cache_seqlens, tree_mask, block_table, capture=None):
        """Gemma's layers over the cache (``LlamaForCausalLM._decoder``'s contract): [B, T, hidden], with
        ``capture`` also the residual streams entering those layers."""
        if self.layer_weights is None:
            self.fuse()
        cfg = self.config
        embed = self.model.embed_tokens(input_ids)  # [B, T, H]
        h = embed * torch.tensor(cfg.hidden_size**0.5).to(embed.dtype)
        local = self._rope_of(SLIDING, positions, h.dtype) if SLIDING in cfg.layer_types else None  # [2, B, T, D]
        return decoder_layers(
            h, self.layer_weights, self.model.norm.weight, kv_cache, cache_seqlens, self._rope(positions, h.dtype),
            tree_mask, num_heads=cfg.num_attention_heads, eps=cfg.rms_norm_eps, block_table=block_table,
            capture=capture, variant=self.variant, rope_local=local,
        )  # fmt: skip


__all__ = ["GemmaForCausalLM", "GemmaRMSNorm"]
