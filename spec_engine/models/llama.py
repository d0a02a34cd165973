"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) in plain torch.

Parameter names match HF transformers, so HF checkpoints load as they are and our own checkpoints load in HF.
Two forward paths share every weight:

- ``forward``: the engine's path. It writes the new tokens' K/V into the cache at slots ``L_b .. L_b+T-1``
  and attends with ``spec_kernels.tree_attention`` (prefix + the nodes each row's tree mask allows).
- ``forward_train``: plain causal attention over a whole batch, for the zoo training recipe.

The engine's path is lean (``LlamaForCausalLM.fuse``, done at load): q/k/v and gate/up are one matrix each, so a
layer runs 4 matmuls, not 7, each through ``spec_kernels.linear`` (the native small-M kernel on CPU: batch-invariant,
2.5-4x torch's GEMMs at M <= 16); RMSNorm is ``F.rms_norm``; RoPE reads a cos/sin table by position; K and V are
written to the cache in one indexed copy. The HF names stay: the separate projections are views of the fused rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from spec_engine.models.config import ModelConfig, rope_inv_freq
from spec_kernels import linear, plan_tree_attention, tree_attention


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:  # one fused op (8 vs 11-18 us on CPU)
            return F.rms_norm(x, (x.shape[-1],), self.weight, eps=self.eps)
        # float32 statistics as HF does: fp16/bf16 variance underflows on long rows; the weight multiplies after.
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


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
        self.qkv_weight: torch.Tensor | None = None  # [(Hq + 2 Hkv) D, hidden] once fused (see fuse)
        self.qkv_bias: torch.Tensor | None = None

    def fuse(self) -> None:
        """One q/k/v matrix; q_proj, k_proj and v_proj become views of its rows (no copy kept, HF names kept)."""
        projs = (self.q_proj, self.k_proj, self.v_proj)
        self.qkv_weight = _fuse_rows(projs)
        if self.q_proj.bias is not None:
            self.qkv_bias = _fuse_rows(projs, bias=True)

    def _project(self, x: torch.Tensor):
        B, T, _ = x.shape
        sizes = (self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.num_kv_heads * self.head_dim)
        if self.qkv_weight is not None:
            q, k, v = linear(x, self.qkv_weight, self.qkv_bias).split(sizes, dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        return (
            q.reshape(B, T, self.num_heads, self.head_dim),  # [B, T, Hq, D]
            k.reshape(B, T, self.num_kv_heads, self.head_dim),  # [B, T, Hkv, D]
            v.reshape(B, T, self.num_kv_heads, self.head_dim),  # [B, T, Hkv, D]
        )

    def _qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        if self.qkv_weight is not None and not self.qk_norm:
            # fused: q and k are adjacent columns of one output, so one RoPE pass rotates both (6 ops, not 12)
            B, T, _ = x.shape
            H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
            qkv = linear(x, self.qkv_weight, self.qkv_bias)  # [B, T, (Hq + 2 Hkv) D]
            qk = apply_rope(qkv[..., : (H + Hkv) * D].reshape(B, T, H + Hkv, D), cos, sin)  # [B, T, Hq + Hkv, D]
            return qk[:, :, :H], qk[:, :, H:], qkv[..., (H + Hkv) * D :].reshape(B, T, Hkv, D)
        q, k, v = self._project(x)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward(self, x, cos, sin, layer_cache, cache_seqlens, flat_slots, tree_mask, block_table, plan):
        """layer_cache: [2, blocks, block_size, Hkv, D], this layer's K and V planes."""
        B, T, _ = x.shape
        q, k, v = self._qkv(x, cos, sin)
        # [2, rows, Hkv, D] <- [2, B * T, Hkv, D]: row = the physical cache row of position L_b + t; K and V at once
        planes = layer_cache.view(2, -1, self.num_kv_heads, self.head_dim)
        planes[:, flat_slots] = torch.stack((k, v)).view(2, B * T, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = layer_cache[0], layer_cache[1]
        out = tree_attention(q, k_cache, v_cache, cache_seqlens, tree_mask, block_table=block_table, plan=plan)
        return linear(out.reshape(B, T, -1), self.o_proj.weight, self.o_proj.bias)

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
        self.gate_up_weight: torch.Tensor | None = None  # [2 * intermediate, hidden] once fused

    def fuse(self) -> None:
        self.gate_up_weight = _fuse_rows((self.gate_proj, self.up_proj))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_weight is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        gate, up = linear(x, self.gate_up_weight).chunk(2, dim=-1)
        return linear(F.silu(gate) * up, self.down_proj.weight)


def _fuse_rows(linears, bias: bool = False) -> torch.Tensor:
    """The weights (or biases) of ``linears`` stacked by rows into one tensor, each module's own parameter becoming
    a view of its rows: the fused matrix costs no extra memory, and state_dict still has the HF names."""
    parts = [m.bias if bias else m.weight for m in linears]
    fused = torch.cat([p.detach() for p in parts])
    start = 0
    for m, p in zip(linears, parts):
        view = nn.Parameter(fused[start : start + p.shape[0]], requires_grad=False)
        if bias:
            m.bias = view
        else:
            m.weight = view
        start += p.shape[0]
    return fused


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
        self.rope_table: torch.Tensor | None = None  # [2, max_positions, D] cos and sin, once fused

    def fuse(self, max_positions: int | None = None) -> LlamaForCausalLM:
        """Prepare the engine's lean path (inference only): fused q/k/v and gate/up matrices, and with
        ``max_positions`` a RoPE cos/sin table for positions below it. Returns self."""
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()
        if max_positions is not None:
            positions = torch.arange(max_positions, device=self.inv_freq.device)
            cos, sin = self._rope_from_freqs(positions, self.lm_head.weight.dtype)
            self.rope_table = torch.stack((cos, sin))  # [2, max_positions, D]
        return self

    def _rope_from_freqs(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[..., None] * self.inv_freq.float()  # [..., D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [..., D]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, T, 1, D] for positions [B, T]: read from the table when there is one (positions past it are
        the caller's error: the engine sizes the table to max_model_len plus a tree)."""
        if self.rope_table is not None and self.rope_table.dtype == dtype:
            cos, sin = self.rope_table[:, positions].unsqueeze(3)  # 2 x [B, T, 1, D]
            return cos, sin
        cos, sin = self._rope_from_freqs(positions, dtype)
        return cos[:, :, None], sin[:, :, None]

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
                layer.input_layernorm(h), cos, sin, kv_cache[i], cache_seqlens, flat_slots, tree_mask, block_table, plan
            )
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.model.norm(h)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., hidden] -> [..., V] in float32."""
        return linear(hidden, self.lm_head.weight).float()

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
