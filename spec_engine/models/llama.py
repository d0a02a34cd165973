"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, Phi-3 once its fused matrices are split) in plain torch.

Parameter names match HF transformers, so HF checkpoints load as they are and our own checkpoints load in HF.
Two forward paths share every weight:

- ``forward``: the engine's path. It writes the new tokens' K/V into the cache at slots ``L_b .. L_b+T-1`` and
  attends to the prefix plus the nodes each row's tree mask allows, through ``spec_kernels.decoder_layers``: on CPU
  in float32 and bfloat16 (``NATIVE_DTYPES``) the whole layer stack is one C++ call (``csrc/decoder_layers_cpu.cpp``);
  elsewhere torch ops around the ``linear`` and ``tree_attention`` kernels.
- ``forward_train``: plain causal attention over a whole batch, for the zoo training recipe.

The engine's path is lean (``LlamaForCausalLM.fuse``, done at load): q/k/v and gate/up are one matrix each, so a
layer runs 4 matmuls, not 7; RoPE reads a cos/sin table by position. The HF names stay: the separate projections are
views of the fused rows.

A model loaded with ``quantization="gguf"`` keeps its GGUF-quantized matrices as stored (``quantized``: HF name ->
``QuantizedWeight``): the engine's path multiplies the blocks (fused by concatenating block rows; a v in a format of
its own stays apart), and the modules' own parameters for those names are NaN placeholders (no memory) that only
``forward_train`` would read, and it refuses. The embedding also keeps a dense copy in the run dtype: drafters
(EAGLE heads) and lookups read it.
"""

from __future__ import annotations

import dataclasses
import itertools

import torch
import torch.nn.functional as F
from torch import nn

from spec_engine.models.config import ModelConfig, rope_inv_freq
from spec_kernels import linear
from spec_kernels.decoder_layers import (
    LayerWeights,
    NativeModel,
    decoder_layers,
    draft_chain,
    native_model,
)
from spec_kernels.fused_elementwise.ref import rms_norm_ref
from spec_kernels.fused_elementwise.ref import rope_ref as apply_rope
from spec_kernels.types import QuantizedWeight


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:  # one fused op, not the reference's several
            return F.rms_norm(x, (x.shape[-1],), self.weight, eps=self.eps)
        return rms_norm_ref(x, self.weight, self.eps)


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

    def _qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        B, T, _ = x.shape
        q = self.q_proj(x).reshape(B, T, self.num_heads, self.head_dim)  # [B, T, Hq, D]
        k = self.k_proj(x).reshape(B, T, self.num_kv_heads, self.head_dim)  # [B, T, Hkv, D]
        v = self.v_proj(x).reshape(B, T, self.num_kv_heads, self.head_dim)  # [B, T, Hkv, D]
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

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
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


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


def _llama_norms(layer: DecoderLayer) -> tuple:
    """A layer's norm weights as ``LAYER_FIELDS`` names them: input_norm, post_norm (the MLP's input),
    attn_out_norm and mlp_out_norm (None: the Llama layer has neither)."""
    return layer.input_layernorm.weight, layer.post_attention_layernorm.weight, None, None


def _layer_fields(layer: DecoderLayer, norms: tuple | None = None) -> list[torch.Tensor | None]:
    """One fused layer's tensors in the order of ``spec_kernels.decoder_layers.ref.LAYER_FIELDS``, with its model's
    ``_norms(layer)`` (None: the Llama layer's)."""
    attn, mlp = layer.self_attn, layer.mlp
    head_norms = (attn.q_norm.weight, attn.k_norm.weight) if attn.qk_norm else (None, None)
    input_norm, post_norm, attn_out_norm, mlp_out_norm = norms or _llama_norms(layer)
    return [
        input_norm, attn.qkv_weight, attn.qkv_bias, attn.o_proj.weight, post_norm, mlp.gate_up_weight,
        mlp.down_proj.weight, *head_norms, None, attn_out_norm, mlp_out_norm,
    ]  # fmt: skip


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


class LlamaForCausalLM(nn.Module):
    """A Llama-family causal LM whose ``forward`` runs on a KV cache through ``spec_kernels.decoder_layers``.

    The KV cache of one model is a single tensor ``[layers, 2, B, S, Hkv, D]`` (see ``spec_engine.kv_cache``).
    """

    capturable = True  # the forward runs on the device alone: CUDA graphs may capture it (``Target.capturable``)

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inv_freq(cfg.rope, cfg.head_dim), persistent=False)
        self.rope_table: torch.Tensor | None = None  # [2, max_positions, D] cos and sin, once fused
        self.layer_weights: LayerWeights | None = None  # decoder_layers' list, once fused
        self.native: NativeModel | None = None  # the native step ops' handle, once fused with a RoPE table
        # a draft's restricted vocabulary (restrict_vocab): token ids [K], ascending, and their lm_head rows [K, H];
        # buffers, so .to() moves them with the weights (not saved: the draft directory's draft_vocab.json is)
        self.register_buffer("vocab_map", None, persistent=False)
        self.register_buffer("head_weight", None, persistent=False)
        self.quantized: dict[str, QuantizedWeight] = {}  # quantization="gguf": HF name -> the file's blocks
        self.head_blocks: QuantizedWeight | None = None  # a quantized head's restricted rows (restrict_vocab)

    def fuse(self, max_positions: int | None = None) -> LlamaForCausalLM:
        """Prepare the engine's lean path (inference only): fused q/k/v and gate/up matrices, and with
        ``max_positions`` a RoPE cos/sin table for positions below it. Returns self."""
        if self.layer_weights is None and self.quantized:
            fields = (self._quantized_fields(i) for i in range(len(self.model.layers)))
            self.layer_weights = LayerWeights(w for layer in fields for w in layer)
        if self.layer_weights is None:
            for layer in self.model.layers:
                layer.self_attn.fuse()
                layer.mlp.fuse()
            self.layer_weights = LayerWeights(w for layer in self.model.layers
                                              for w in _layer_fields(layer, self._norms(layer)))  # fmt: skip
        if max_positions is not None:
            positions = torch.arange(max_positions, device=self.inv_freq.device)
            cos, sin = self._rope_from_freqs(positions, self.lm_head.weight.dtype)
            self.rope_table = torch.stack((cos, sin))  # [2, max_positions, D]
        self._build_native()
        return self

    def _build_native(self) -> None:
        """``native``: this model as the native step ops take it, once fused with a RoPE table (None otherwise, or
        where those ops cannot run it: see ``spec_kernels.decoder_layers.native_model``)."""
        self.native = None
        if self.layer_weights is not None and self.rope_table is not None:
            cfg = self.config
            self.native = native_model(self._embed_weight(), self.layer_weights, self.model.norm.weight, self._head(),
                                       self.rope_table, num_heads=cfg.num_attention_heads, eps=cfg.rms_norm_eps,
                                       vocab_map=self.vocab_map)  # fmt: skip

    def _apply(self, fn, recurse=True):
        """``Module.to`` and friends: the native handle is rebuilt on the converted tensors (or dropped where the
        RoPE table's dtype no longer matches them)."""
        out = super()._apply(fn, recurse)
        if getattr(self, "layer_weights", None) is not None:
            self._build_native()
        return out

    def _matrix(self, names: list[str]) -> torch.Tensor | QuantizedWeight:
        """The row concatenation of the named matrices: their blocks where all are quantized in one format (rows
        are independent), else dense in the run dtype (a format the others do not share is dequantized)."""
        blocks = [self.quantized.get(n) for n in names]
        if all(b is not None for b in blocks) and len({b.qtype for b in blocks}) == 1:
            return blocks[0] if len(blocks) == 1 else self._fused_blocks(names, blocks)
        dtype = self.model.norm.weight.dtype
        parts = [self.get_parameter(n).detach() if b is None else b.dequantize(dtype) for b, n in zip(blocks, names)]
        return torch.cat(parts)

    def _fused_blocks(self, names: list[str], blocks: list[QuantizedWeight]) -> QuantizedWeight:
        """The row concatenation of ``blocks``, whose entries in ``quantized`` become views of its rows (as
        ``_fuse_rows`` does for dense matrices): the fused copy is the only one kept, where two copies of q/k/v and
        gate/up had doubled a quantized model's resident memory. Blocks that already are adjacent rows of one tensor
        (a rebuild of the native handle) are that tensor's rows, not a new copy."""
        first = blocks[0].data  # [N_0, row_bytes]
        rows, row_bytes, storage = sum(b.shape[0] for b in blocks), first.shape[1], first.untyped_storage()
        starts = itertools.accumulate([b.shape[0] for b in blocks[:-1]], initial=0)  # each part's first row
        adjacent = all(
            b.data.is_contiguous()
            and b.data.untyped_storage().data_ptr() == storage.data_ptr()
            and b.data.storage_offset() == first.storage_offset() + r * row_bytes
            for b, r in zip(blocks, starts)
        )
        if adjacent:
            data = first.new_empty(0).set_(storage, first.storage_offset(), (rows, row_bytes))
            return dataclasses.replace(blocks[0], data=data, shape=(rows, blocks[0].shape[1]))
        fused = QuantizedWeight.cat(blocks)
        start = 0
        for name, b in zip(names, blocks):
            self.quantized[name] = dataclasses.replace(b, data=fused.data[start : start + b.shape[0]])
            start += b.shape[0]
        return fused

    def _quantized_fields(self, i: int) -> list[torch.Tensor | QuantizedWeight | None]:
        """Layer i's tensors in the order of ``LAYER_FIELDS``, its matrices from ``_matrix`` (a quantized model's
        ``fuse``: the modules' placeholders are never concatenated). A quantized v in a format q and k do not share
        (llama.cpp's Q4_K_M keeps v in Q6_K in half the layers) is held apart as its blocks, not dequantized with
        them into one dense q/k/v."""
        layer, p = self.model.layers[i], f"model.layers.{i}."
        attn = layer.self_attn
        q, k, v = (f"{p}self_attn.{n}_proj.weight" for n in "qkv")
        bias = None if attn.q_proj.bias is None else torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias])
        head_norms = (attn.q_norm.weight, attn.k_norm.weight) if attn.qk_norm else (None, None)
        input_norm, post_norm, attn_out_norm, mlp_out_norm = self._norms(layer)
        qtypes = {getattr(self.quantized.get(n), "qtype", None) for n in (q, k, v)}
        v_apart = v in self.quantized and len(qtypes) > 1
        qkv = self._matrix([q, k]) if v_apart else self._matrix([q, k, v])
        return [
            input_norm, qkv, bias, self._matrix([f"{p}self_attn.o_proj.weight"]), post_norm,
            self._matrix([f"{p}mlp.gate_proj.weight", f"{p}mlp.up_proj.weight"]),
            self._matrix([f"{p}mlp.down_proj.weight"]), *head_norms, self._matrix([v]) if v_apart else None,
            attn_out_norm, mlp_out_norm,
        ]  # fmt: skip

    def _norms(self, layer: DecoderLayer) -> tuple:
        """A layer's norm weights in ``LAYER_FIELDS``' terms (``_llama_norms``); a family with others overrides it."""
        return _llama_norms(layer)

    def _embed_weight(self) -> torch.Tensor | QuantizedWeight:
        """The embedding the native chains look tokens up in: the file's blocks when quantized (each row dequantized
        on lookup, the dense copy's values), else the table."""
        return self.quantized.get("model.embed_tokens.weight", self.model.embed_tokens.weight)

    def _head(self) -> torch.Tensor | QuantizedWeight:
        """The lm_head the logits use: a restricted vocabulary's rows, the file's blocks, or the dense matrix."""
        if self.vocab_map is not None:
            return self.head_weight if self.head_blocks is None else self.head_blocks
        return self.quantized.get("lm_head.weight", self.lm_head.weight)

    def restrict_vocab(self, token_ids: torch.Tensor | None) -> LlamaForCausalLM:
        """A draft's logits over ``token_ids`` only (FR-Spec's frequency-ranked draft vocabulary; EAGLE-3 ships its
        heads so): its lm_head costs K rows instead of V. ``logits`` stays [..., V], -inf outside the ids, so every
        drafting path works unchanged: a greedy draft proposes the most likely of the ids, a sampled one draws from
        q renormalised over them, and verification stays lossless (a proposal outside the ids is never made; the
        target's residual keeps its mass) as long as K is at least a tree level's branching: b children drawn
        without replacement need b ids with q > 0 (``LLM`` refuses a narrower K). Acceptance falls only where the
        target's token lies outside.
        Not for a target: its logits are the output. None restores the full vocabulary. Returns self."""
        if token_ids is None:
            self.vocab_map = self.head_weight = self.head_blocks = None
            self._build_native()
            return self
        V = self.config.vocab_size
        ids = torch.as_tensor(token_ids, dtype=torch.int64).cpu().flatten().unique()  # [K], ascending, checked here
        if ids.numel() == 0 or ids.min() < 0 or ids.max() >= V:
            raise ValueError(f"restrict_vocab: token ids must be a non-empty set of ids in [0, {V})")
        self.vocab_map = ids.to(self.lm_head.weight.device)  # [K]
        blocks = self.quantized.get("lm_head.weight")
        if blocks is not None:
            picked = blocks.data[self.vocab_map].contiguous()  # [K, row_bytes]
            self.head_blocks = QuantizedWeight(picked, blocks.qtype, (ids.numel(), blocks.shape[1]), blocks.activations)
            self.head_weight = self.head_blocks.dequantize(self.lm_head.weight.dtype)  # [K, H]
        else:
            self.head_weight = self.lm_head.weight.detach()[self.vocab_map].contiguous()  # [K, H]
        self._build_native()
        return self

    def reset_rope(self) -> None:
        """The RoPE inverse frequencies from the config (buffers are not in a checkpoint: a model built on meta and
        then loaded needs them made)."""
        self.inv_freq = rope_inv_freq(self.config.rope, self.config.head_dim)

    def _rope_from_freqs(self, positions: torch.Tensor, dtype: torch.dtype,
                         inv_freq: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        inv_freq = self.inv_freq if inv_freq is None else inv_freq  # [D/2]
        freqs = positions.float()[..., None] * inv_freq.float()  # [..., D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [..., D]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """cos and sin [2, B, T, D] for positions [B, T]: read from the table when there is one (positions past it
        are the caller's error: the engine sizes the table to max_model_len plus a tree)."""
        if self.rope_table is not None and self.rope_table.dtype == dtype:
            return self.rope_table[:, positions]
        return torch.stack(self._rope_from_freqs(positions, dtype))

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
        return self._decoder(input_ids, positions, kv_cache, cache_seqlens, tree_mask, block_table)

    def draft_chain(self, root_logits, kv_cache, cache_seqlens, gamma: int, block_table=None,
                     strict: bool = False) -> torch.Tensor | None:  # fmt: skip
        """``gamma`` greedy tokens per row from the roots' logits [B, V] in one native call (see
        ``spec_kernels.decoder_layers.draft_chain``): [B, gamma], or None without the native handle (``native``)."""
        if self.native is None:
            return None
        if self.vocab_map is not None:  # the chain runs over the restricted ids; -inf elsewhere never wins
            root_logits = root_logits[:, self.vocab_map]  # [B, K]
        return draft_chain(root_logits, self.native, kv_cache, cache_seqlens, gamma=gamma, block_table=block_table,
                            strict=strict)  # fmt: skip

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., hidden] -> [..., V] in float32 (-inf outside a restricted vocabulary)."""
        if self.vocab_map is None:
            return linear(hidden, self._head()).float()
        sub = linear(hidden, self._head()).float()  # [..., K]
        out = sub.new_full((*sub.shape[:-1], self.config.vocab_size), float("-inf"))  # [..., V]
        return out.index_copy_(-1, self.vocab_map, sub)

    def forward_train(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Causal LM logits [B, T, V] for a batch of full sequences (no cache)."""
        if self.quantized:
            raise NotImplementedError("forward_train runs the modules' float weights; load without quantization='gguf'")
        B, T = input_ids.shape
        h = self.model.embed_tokens(input_ids)
        positions = torch.arange(T, device=h.device).expand(B, T)
        cos, sin = self._rope(positions, h.dtype).unsqueeze(3)  # 2 x [B, T, 1, D]
        for layer in self.model.layers:
            h = h + layer.self_attn.forward_train(layer.input_layernorm(h), cos, sin)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.lm_head(self.model.norm(h))

    def num_parameters(self) -> int:
        return sum(p.numel() for p in {id(p): p for p in self.parameters()}.values())

    def forward_features(self, input_ids, positions, kv_cache, cache_seqlens, tree_mask, block_table=None, *, layers):
        """``forward``, also returning the residual streams entering ``layers`` (EAGLE-3's features): (final normed
        hidden states [B, T, hidden], those streams concatenated in ``layers``' order [B, T, len(layers) * hidden]).
        The same computation as ``forward`` (one ``decoder_layers`` call), so the target's tokens do not depend on
        whether a drafter reads its features."""
        return self._decoder(input_ids, positions, kv_cache, cache_seqlens, tree_mask, block_table, list(layers))

    def _decoder(self, input_ids, positions, kv_cache, cache_seqlens, tree_mask, block_table, capture=None):
        if self.layer_weights is None:
            self.fuse()
        h = self.model.embed_tokens(input_ids)  # [B, T, hidden]
        cfg = self.config
        return decoder_layers(
            h, self.layer_weights, self.model.norm.weight, kv_cache, cache_seqlens, self._rope(positions, h.dtype),
            tree_mask, num_heads=cfg.num_attention_heads, eps=cfg.rms_norm_eps, block_table=block_table,
            capture=capture,
        )  # fmt: skip


def cache_slots(positions: torch.Tensor, block_size: int, block_table: torch.Tensor | None):
    """(blocks, offsets) [B, T] of logical ``positions`` [B, T] in a cache ``[blocks, block_size, ...]`` (paged with
    ``block_table``; contiguous ``[B, S, ...]`` without: block b is sequence b)."""
    if block_table is None:
        return torch.arange(positions.shape[0], device=positions.device)[:, None].expand_as(positions), positions
    return block_table.long().gather(1, positions // block_size), positions % block_size


def cached_attention(attn: Attention, x, cos, sin, layer_cache, cache_seqlens, tree_mask, block_table=None):
    """One attention block in torch ops around ``tree_attention`` (inference): writes the K/V of x's T tokens at
    positions L_b .. L_b+T-1 of ``layer_cache`` [2, blocks, block_size, Hkv, D]; returns [B, T, hidden]."""
    from spec_kernels import tree_attention

    B, T, _ = x.shape
    q, k, v = attn._qkv(x, cos, sin)  # [B, T, Hq | Hkv, D]
    positions = cache_seqlens.long()[:, None] + torch.arange(T, device=x.device)  # [B, T]
    blocks, offsets = cache_slots(positions, layer_cache.shape[2], block_table)
    layer_cache[0, blocks, offsets] = k
    layer_cache[1, blocks, offsets] = v
    out = tree_attention(q, layer_cache[0], layer_cache[1], cache_seqlens, tree_mask, block_table=block_table)
    return linear(out.reshape(B, T, -1), attn.o_proj.weight, attn.o_proj.bias)
