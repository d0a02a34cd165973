"""Gemma 2 and Gemma 3 (text) on the engine's KV cache, as HF transformers computes them.

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

The native C++ decoder layers run Llama's layer only: a Gemma model has no native handle (``native`` stays None), so
the step planner never picks a native path for it; every step is a regular one, through ``_decoder`` below.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from spec_engine.models.config import SLIDING, ModelConfig, rope_inv_freq
from spec_engine.models.llama import LlamaForCausalLM, RMSNorm, cache_slots
from spec_kernels import linear
from spec_kernels.decoder_layers.ref import LAYER_FIELDS, qkv_projection
from spec_kernels.fused_elementwise import rope_qk
from spec_kernels.tree_attention import plan_tree_attention, tree_attention


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

    def reset_rope(self) -> None:
        super().reset_rope()
        self.inv_freq_local = rope_inv_freq(self.config.rope_local, self.config.head_dim)

    def fuse(self, max_positions: int | None = None) -> GemmaForCausalLM:
        super().fuse(max_positions)
        if max_positions is not None:
            positions = torch.arange(max_positions, device=self.inv_freq_local.device)
            self.rope_table_local = torch.stack(self._rope_from_freqs(positions, self.lm_head.weight.dtype,
                                                                      self.inv_freq_local))  # fmt: skip
        return self

    def _build_native(self) -> None:
        self.native = None  # the native layers run Llama's layer, not Gemma's (module docstring)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., hidden] -> [..., V] float32, soft-capped where the model says (-inf outside a restricted vocabulary
        stays -inf)."""
        out = super().logits(hidden)
        cap = self.config.final_logit_softcapping
        return out if cap is None else torch.where(out.isinf(), out, torch.tanh(out / cap) * cap)

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
        B, T = input_ids.shape
        Hq, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        embed = self.model.embed_tokens(input_ids)  # [B, T, H]
        h = embed * torch.tensor(cfg.hidden_size**0.5).to(embed.dtype)
        ropes = {kind: self._rope_of(kind, positions, h.dtype) for kind in set(cfg.layer_types)}  # [2, B, T, D] each
        pos = cache_seqlens.long()[:, None] + torch.arange(T, device=h.device)  # [B, T]: the cache slots written
        blocks, offsets = cache_slots(pos, kv_cache.shape[3], block_table)
        plan = plan_tree_attention(kv_cache[0, 0], cache_seqlens, tree_mask, num_q_heads=Hq, block_table=block_table)
        streams = {}
        for i, layer in enumerate(self.model.layers):
            if capture is not None and i in capture:
                streams[i] = h
            w = dict(zip(LAYER_FIELDS, self.layer_weights[i * len(LAYER_FIELDS) : (i + 1) * len(LAYER_FIELDS)]))
            attn, kind = layer.self_attn, cfg.layer_types[i]
            qkv = qkv_projection(layer.input_layernorm(h), w, linear)  # [B, T, (Hq + 2 Hkv) D]
            q, k, v = qkv.split((Hq * D, Hkv * D, Hkv * D), dim=-1)
            q, k, v = q.reshape(B, T, Hq, D), k.reshape(B, T, Hkv, D), v.reshape(B, T, Hkv, D)
            if cfg.qk_norm:
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k = rope_qk(q, k, *ropes[kind])  # (one kernel on CUDA)
            kv_cache[i, 0, blocks, offsets] = k
            kv_cache[i, 1, blocks, offsets] = v
            out = tree_attention(q, kv_cache[i, 0], kv_cache[i, 1], cache_seqlens, tree_mask, block_table=block_table,
                                 softmax_scale=cfg.query_pre_attn_scalar**-0.5, softcap=cfg.attn_logit_softcapping,
                                 window=cfg.sliding_window if kind == SLIDING else None, plan=plan)  # fmt: skip
            h = h + layer.post_attention_layernorm(linear(out.flatten(2), w["o"], None))  # [B, T, H]
            gate, up = linear(layer.pre_feedforward_layernorm(h), w["gate_up"], None).chunk(2, dim=-1)
            mlp = linear(F.gelu(gate, approximate="tanh") * up, w["down"], None)  # [B, T, H]
            h = h + layer.post_feedforward_layernorm(mlp)
        out = self.model.norm(h)
        if capture is None:
            return out
        return out, torch.cat([streams[i] for i in capture], dim=-1) if capture else h.new_empty(B, T, 0)


__all__ = ["GemmaForCausalLM", "GemmaRMSNorm"]
