"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) in plain torch.

Parameter names match HF transformers, so HF checkpoints load as they are and our own checkpoints load in HF.
Two forward paths share every weight:

- ``forward``: the engine's path. It writes the new tokens' K/V into the cache at slots ``L_b .. L_b+T-1``
  and attends with ``spec_kernels.tree_attention`` (prefix + the nodes each row's tree mask allows).
- ``forward_train``: plain causal attention over a whole batch, for the zoo training recipe.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from spec_engine.models.config import ModelConfig, rope_inv_freq
from spec_kernels import plan_tree_attention, tree_attention


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # float32 statistics as HF does: fp16/bf16 variance underflows on long rows.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE. x [B, T, H, D]; cos, sin [B, T, 1, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm

    def _qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim)  # [B, T, Hq, D]
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim)  # [B, T, Hkv, D]
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim)  # [B, T, Hkv, D]
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward(self, x, cos, sin, k_cache, v_cache, cache_seqlens, flat_slots, tree_mask, block_table, plan):
        B, T, _ = x.shape
        q, k, v = self._qkv(x, cos, sin)
        # [rows, Hkv, D] <- [B * T, Hkv, D]: row = the physical cache row of position L_b + t
        k_cache.view(-1, self.num_kv_heads, self.head_dim)[flat_slots] = k.reshape(B * T, self.num_kv_heads, -1)
        v_cache.view(-1, self.num_kv_heads, self.head_dim)[flat_slots] = v.reshape(B * T, self.num_kv_heads, -1)
        out = tree_attention(q, k_cache, v_cache, cache_seqlens, tree_mask, block_table=block_table, plan=plan)
        return self.o_proj(out.reshape(B, T, -1))

    def forward_train(self, x, cos, sin):
        B, T, _ = x.shape
        q, k, v = self._qkv(x, cos, sin)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
        )  # [B, Hq, T, D]
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


def cache_rows(cache_seqlens: torch.Tensor, T: int, rows_per_block: int, block_table: torch.Tensor | None):
    """[B * T] physical row of positions L_b .. L_b+T-1 in a cache flattened to [blocks * rows_per_block, ...].

    Contiguous caches are the case "block b of sequence b holds all S positions".
    """
    B = cache_seqlens.shape[0]
    pos = cache_seqlens.long()[:, None] + torch.arange(T, device=cache_seqlens.device)  # [B, T]
    if block_table is None:
        return (torch.arange(B, device=pos.device)[:, None] * rows_per_block + pos).flatten()
    block = block_table.long().gather(1, pos // rows_per_block)  # [B, T]
    return (block * rows_per_block + pos % rows_per_block).flatten()


class LlamaForCausalLM(nn.Module):
    """A Llama-family causal LM whose ``forward`` runs on a KV cache through ``tree_attention``.

    The KV cache of one model is a single tensor ``[layers, 2, B, S, Hkv, D]`` (see ``spec_engine.kv_cache``).
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inv_freq(cfg.rope, cfg.head_dim), persistent=False)

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[..., None] * self.inv_freq.float()  # [B, T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, :, None, :]  # [B, T, 1, D]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        cache_seqlens: torch.Tensor,
        tree_mask: torch.Tensor,
        block_table: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run T new tokens per sequence on top of the cached prefix and return their final hidden states.

        Shapes:
            input_ids, positions: [B, T] int64 (position = L_b + depth for tree nodes)
            kv_cache: [layers, 2, B, S, Hkv, D], or paged [layers, 2, num_blocks, block_size, Hkv, D]
            cache_seqlens: [B] int32 (L_b); block_table: [B, max_blocks] int32 for a paged cache
            tree_mask: [B, T, T] bool
            returns: [B, T, hidden]; apply ``logits`` to the rows whose logits are needed.
        """
        h = self.model.embed_tokens(input_ids)  # [B, T, hidden]
        cos, sin = self._rope(positions, h.dtype)
        flat_slots = cache_rows(cache_seqlens, input_ids.shape[1], kv_cache.shape[3], block_table)  # [B * T]
        # key rows and masks, shared by every layer (None on paths that need none)
        heads = self.config.num_attention_heads
        plan = plan_tree_attention(kv_cache[0, 0], cache_seqlens, tree_mask, num_q_heads=heads, block_table=block_table)
        for i, layer in enumerate(self.model.layers):
            h = h + layer.self_attn(
                layer.input_layernorm(h), cos, sin, kv_cache[i, 0], kv_cache[i, 1],
                cache_seqlens, flat_slots, tree_mask, block_table, plan,
            )  # fmt: skip
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.model.norm(h)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., hidden] -> [..., V] in float32."""
        return self.lm_head(hidden).float()

    def forward_train(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Causal LM logits [B, T, V] for a batch of full sequences (no cache)."""
        B, T = input_ids.shape
        h = self.model.embed_tokens(input_ids)
        positions = torch.arange(T, device=h.device).expand(B, T)
        cos, sin = self._rope(positions, h.dtype)
        for layer in self.model.layers:
            h = h + layer.self_attn.forward_train(layer.input_layernorm(h), cos, sin)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.lm_head(self.model.norm(h))

    def num_parameters(self) -> int:
        return sum(p.numel() for p in {id(p): p for p in self.parameters()}.values())
