"""EAGLE draft heads: one decoder layer that drafts from the target's own features (EAGLE-1/2 and EAGLE-3 layouts).

Glossary:
    feature f_p   what the target hands the head for position p: its final hidden state (RMS-normed, the input of
                  lm_head) for EAGLE-1/2; for EAGLE-3 ``fc`` of the residual streams entering three of its layers,
                  concatenated (the head's ``target_layers``).
    entry p       one head token: the token x_p with the feature of the position before it, f_{p-1} (zeros for
                  p = 0), at RoPE position p. Its output h_p stands in for f_p: the head reads it back as the feature
                  of its own next entry while drafting, and ``logits(h_p)`` predicts x_{p+1}. (The published heads
                  pair f_p with x_{p+1} at position p: RoPE is relative, so the shift by one changes nothing.)
    feature cache the target's features of every committed position, paged like the KV caches and compacted with
                  the accepted path: the head's entries for the tokens of the last step are computed from it, with
                  the target's true features, as EAGLE does (the drafted entries, built on the head's own guesses,
                  are dropped).

Layouts, as vLLM and SGLang load them (``eagle_checkpoint.load_eagle_head``):
- "eagle" (EAGLE-1/2): ``fc`` [H, 2H] over cat(embedding, feature), ``layers.0.*`` a decoder layer without input
  norm, no final norm; the target's ``embed_tokens`` and ``lm_head`` unless the head has its own. The variant our
  recipe trains ("normed": ``layers.0.input_layernorm`` and a final ``norm`` present) is a plain decoder layer whose
  output is RMS-normed like the target's features: it runs as one ``decoder_layers`` call once fused.
- "eagle3" (EAGLE-3): ``fc`` [H, 3 H_target] over the three target layers' features, ``midlayer.*`` a decoder layer
  whose attention reads cat(input_layernorm(embedding), hidden_norm(feature)) [2H], a final ``norm``, its own
  ``lm_head`` over a draft vocabulary whose token i is target token ``i + d2t[i]``.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from spec_engine.cuda_graphs import CapturedForward, captured_forward
from spec_engine.drafters.base import Draft, StepBatch
from spec_engine.drafters.draft_model import CATCH_UP_SLACK, DraftModelDrafter
from spec_engine.drafters.dynamic_tree import dynamic_level, mask_level, perturbed
from spec_engine.kv_cache import PagedKVCache
from spec_engine.models import LlamaForCausalLM, ModelConfig
from spec_engine.models.config import rope_inv_freq
from spec_engine.models.llama import (
    MLP,
    Attention,
    DecoderLayer,
    RMSNorm,
    _layer_fields,
    apply_rope,
    cache_slots,
    cached_attention,
)
from spec_engine.transfer import to_device
from spec_engine.tree import StaticTree, dynamic_tree
from spec_kernels import PAD_NODE, VerifyResult, compact_kv_, linear, rng
from spec_kernels.decoder_layers import LayerWeights, NativeHead, decoder_layers, eagle3_draft, native_model
from spec_kernels.rng import position_gumbel

LAYOUTS = ("eagle", "eagle3")


def eagle3_target_layers(num_layers: int) -> tuple[int, int, int]:
    """The target layers whose inputs EAGLE-3 reads by default (vLLM's choice: low, middle and high), kept inside
    targets of fewer than 5 layers."""
    return (min(2, num_layers - 1), num_layers // 2, max(num_layers - 3, 0))


class EagleHead(nn.Module):
    """One EAGLE head. Parameter names are the published checkpoints' (``fc``, ``layers.0.*`` or ``midlayer.*``,
    ``norm``, ``lm_head``, ``d2t``); the target's embedding and lm_head are shared, never copied or saved.

    Shapes: token ids [B, T]; features [B, T, H] (``features`` maps the target's [B, T, F] to them); outputs
    [B, T, H], the stand-ins for the next features; ``logits`` [B, T, V_target] float32.
    """

    def __init__(self, cfg: ModelConfig, layout: str, target: LlamaForCausalLM, *, fc_bias: bool = False,
                 draft_vocab_size: int | None = None, target_layers: tuple[int, ...] | None = None,
                 own_embedding: bool = False, own_lm_head: bool = False, norm_before_residual: bool = False,
                 normed: bool = False):  # fmt: skip
        super().__init__()
        if layout not in LAYOUTS:
            raise ValueError(f"EAGLE layout must be one of {LAYOUTS}, got {layout!r}")
        self.config, self.layout = cfg, layout
        H, Ht = cfg.hidden_size, target.config.hidden_size
        self.norm_before_residual = norm_before_residual
        layer = DecoderLayer(cfg)
        layer.mlp = _NativeMLP(cfg)
        self.normed = normed and layout == "eagle"  # the normed variant: a plain decoder layer and a final norm
        self.layer_weights: LayerWeights | None = None  # decoder_layers' list, once fused (normed)
        if layout == "eagle":
            self.target_layers = None  # the final hidden state
            self.fc = nn.Linear(2 * H, H, bias=fc_bias)
            layer.self_attn = _NativeAttention(cfg)
            if not self.normed:
                layer.input_layernorm = nn.Identity()  # EAGLE-1 feeds fc's output to attention as it is
            self.layers = nn.ModuleList([layer])
        else:
            self.target_layers = tuple(target_layers or eagle3_target_layers(target.config.num_hidden_layers))
            self.fc = nn.Linear(len(self.target_layers) * Ht, H, bias=False)
            layer.self_attn = _NativeAttention(dataclasses.replace(cfg, hidden_size=2 * H))
            layer.self_attn.o_proj = nn.Linear(cfg.num_attention_heads * cfg.head_dim, H, bias=False)
            layer.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)
            self.midlayer = layer
        if layout == "eagle3" or self.normed:
            self.norm = RMSNorm(H, cfg.rms_norm_eps)
        if own_embedding:
            self.embed_tokens = nn.Embedding(cfg.vocab_size, H)
        self.draft_vocab_size = draft_vocab_size or cfg.vocab_size
        if own_lm_head or layout == "eagle3":
            self.lm_head = nn.Linear(H, self.draft_vocab_size, bias=False)
        if layout == "eagle3":
            self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("inv_freq", rope_inv_freq(cfg.rope, cfg.head_dim), persistent=False)
        self.rope_table: torch.Tensor | None = None  # [2, max_positions, D] cos and sin, once fused
        self.native: NativeHead | None = None  # an EAGLE-3 head's native draft op, once fused where it can run
        self.__dict__["target"] = target  # shared, not a submodule: its weights are neither trained nor saved
        self.vocab_size = target.config.vocab_size

    @property
    def layer(self) -> DecoderLayer:
        return self.layers[0] if self.layout == "eagle" else self.midlayer

    def fuse(self, max_positions: int | None = None) -> EagleHead:
        """The engine's lean path (as ``LlamaForCausalLM.fuse``): fused q/k/v and gate/up matrices, a RoPE table
        for positions below ``max_positions``; the normed variant's layer then runs as one ``decoder_layers`` call."""
        if max_positions is not None:
            self.rope_table = torch.stack(self._rope(torch.arange(max_positions, device=self.inv_freq.device)[None],
                                                     self.fc.weight.dtype))[:, 0]  # fmt: skip
        self.layer.self_attn.fuse()
        self.layer.mlp.fuse()
        if self.normed:
            self.layer_weights = LayerWeights(_layer_fields(self.layer))
        if self.layout == "eagle3" and self.rope_table is not None:
            self.native = self._native_head()
        return self

    def _native_head(self) -> NativeHead | None:
        """The head as ``eagle3_draft`` takes it, or None where that op cannot run it (not on the CPU, mixed
        dtypes): its lm_head over the draft vocabulary's target ids."""
        if not self.fc.weight.is_cpu:
            return None  # (and its draft-to-target map stays on the device, unread)
        cfg = self.config
        embed = self.embed_tokens.weight if "embed_tokens" in self._modules else self.target._embed_weight()
        ids = self.d2t + torch.arange(self.draft_vocab_size, device=self.d2t.device)  # [K]: draft token -> target id
        model = native_model(embed, LayerWeights(_layer_fields(self.layer)), self.norm.weight, self.lm_head.weight,
                             self.rope_table, num_heads=cfg.num_attention_heads, eps=cfg.rms_norm_eps,
                             vocab_map=ids.cpu())  # fmt: skip
        hidden_norm = self.layer.hidden_norm.weight
        fc = self.fc.weight
        if model is None or {hidden_norm.dtype, fc.dtype} != {model.dtype} or not (hidden_norm.is_cpu and fc.is_cpu):
            return None
        return NativeHead(model, hidden_norm, self.norm_before_residual, fc, self.target_layers)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if "embed_tokens" in self._modules:
            return self.embed_tokens(input_ids)
        return self.target.model.embed_tokens(input_ids)

    def features(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """[B, T, F] target hidden states (final, or the target layers' concatenated) -> [B, T, H] features."""
        return target_hidden if self.layout == "eagle" else _linear(target_hidden, self.fc)

    def inputs(self, input_ids: torch.Tensor, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual stream, attention input) of each entry: token ids [B, T], features [B, T, H]. The attention
        input is None where ``decoder_layers`` normalises it itself (the fused normed variant)."""
        e = self.embed(input_ids)
        if self.layout == "eagle":
            x = _linear(torch.cat((e, features), dim=-1), self.fc)
            return x, None if self.layer_weights is not None else self.layer.input_layernorm(x)  # fused: in the op
        layer = self.layer
        normed = layer.hidden_norm(features)
        residual = normed if self.norm_before_residual else features
        return residual, torch.cat((layer.input_layernorm(e), normed), dim=-1)

    def finish(self, x: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """The rest of the layer after attention: [B, T, H] outputs (final-normed in the normed variant)."""
        x = x + attn_out
        x = x + self.layer.mlp(self.layer.post_attention_layernorm(x))
        return self.norm(x) if self.normed else x

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """cos and sin [2, B, T, D] for positions [B, T]: read from the table when there is one."""
        if self.rope_table is not None and self.rope_table.dtype == dtype:
            return self.rope_table[:, positions]
        return torch.stack(self._rope(positions, dtype))

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[..., None] * self.inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)  # [B, T, D]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(self, input_ids, features, positions, kv_cache, cache_seqlens, tree_mask, block_table=None):
        """Run T entries per row on the head's paged KV cache, ``LlamaForCausalLM.forward``'s conventions for one
        layer: positions [B, T] (L_b + depth), kv_cache [1, 2, num_blocks, block_size, Hkv, D], the entries' K/V
        written at slots L_b .. L_b+T-1. Returns the outputs [B, T, H]."""
        x, attn_in = self.inputs(input_ids, features)
        rope = self.rope(positions, x.dtype)  # [2, B, T, D]
        if self.layer_weights is not None:  # the normed variant: the whole layer in one op (C++ on CPU)
            cfg = self.config
            return decoder_layers(x, self.layer_weights, self.norm.weight, kv_cache, cache_seqlens, rope, tree_mask,
                                  num_heads=cfg.num_attention_heads, eps=cfg.rms_norm_eps,
                                  block_table=block_table)  # fmt: skip
        attn = cached_attention(self.layer.self_attn, attn_in, *rope.unsqueeze(3), kv_cache[0], cache_seqlens,
                                tree_mask, block_table)  # fmt: skip
        return self.finish(x, attn)

    def draft_chain(self, *args) -> None:
        """None: a head's next level reads its own outputs as features, which ``LlamaForCausalLM.draft_chain``'s
        one-call chain does not do (``EagleDrafter.propose`` runs an EAGLE-3 head's chain as ``eagle3_draft``)."""
        return None

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """[..., H] outputs -> [..., V_target] float32 logits; tokens outside an EAGLE-3 draft vocabulary get -inf."""
        lm_head = self.lm_head if "lm_head" in self._modules else self.target.lm_head
        if self.layout == "eagle":
            return _linear(h, lm_head).float()
        z = _linear(self.norm(h), lm_head).float()  # [..., V_draft]
        out = z.new_full((*z.shape[:-1], self.vocab_size), float("-inf"))
        out[..., self.d2t + torch.arange(self.draft_vocab_size, device=z.device)] = z
        return out


class _NativeAttention(Attention):
    """``Attention`` whose q/k/v run as one native ``linear`` over the fused matrix at inference (torch's bf16
    matmul has no fast path on AVX2 CPUs); autograd and unfused modules take ``Attention``'s own path."""

    def _qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        if self.qkv_weight is None or torch.is_grad_enabled():
            return super()._qkv(x, cos, sin)
        B, T, _ = x.shape
        D, Hq, Hkv = self.head_dim, self.num_heads, self.num_kv_heads
        q, k, v = linear(x, self.qkv_weight, self.qkv_bias).split([Hq * D, Hkv * D, Hkv * D], dim=-1)
        q, k, v = q.reshape(B, T, Hq, D), k.reshape(B, T, Hkv, D), v.reshape(B, T, Hkv, D)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


class _NativeMLP(MLP):
    """``MLP`` on native ``linear`` calls (the fused gate/up matrix, then down) at inference."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_weight is None or torch.is_grad_enabled():
            return super().forward(x)
        gate, up = linear(x, self.gate_up_weight).chunk(2, dim=-1)
        return linear(nn.functional.silu(gate) * up, self.down_proj.weight)


def _linear(x: torch.Tensor, m: nn.Linear) -> torch.Tensor:
    """The native small-M kernel at inference; the module itself (autograd) while training."""
    return m(x) if torch.is_grad_enabled() else linear(x, m.weight, m.bias)


class EagleDrafter(DraftModelDrafter):
    """Chains and static trees from an EAGLE head, level by level as the draft model (``DraftModelDrafter``: the
    same tree shapes, children draws and verification modes), with the head's features in place of a model's own
    state: an entry reads the target's feature of the position before it (the feature cache) when it is a token of
    the sequence, and its parent node's output when it is a drafted node. An EAGLE-3 head on the CPU runs natively
    (``EagleHead.native``): every causal chunk it is fed (prefill, catch-up) as one ``eagle3_draft`` call, and a
    chain step, its catch-up's last forward and the whole chain, as one more (sampled rows too: their Gumbel noise
    drawn here, the draws made there); the engine's native greedy speculative steps (``spec_chain``) run its chains,
    static trees and EAGLE-2 dynamic trees whole, the feature cache written there; a regular step's dynamic tree is
    one more ``eagle3_draft`` call (``_propose_dynamic``).

    Caches: the head's KV ``kv`` [1, 2, num_blocks, block_size, Hkv, D] and the feature cache ``features``
    [1, num_blocks, block_size, H], both on the target's block table. ``commit`` writes every node's feature and
    compacts the feature cache with the accepted path; the head's KV keeps only the root's entry (built on true
    features), and the next step's catch-up recomputes the accepted tokens' entries from their true features.
    """

    needs_hidden = True
    node_graphs: CapturedForward | None = None

    def __init__(self, head: EagleHead, kv: PagedKVCache, features: torch.Tensor, tree: StaticTree,
                 draft_sampling: str = "without_replacement", widths: dict[int, int] | None = None):  # fmt: skip
        super().__init__(head, kv, tree, draft_sampling)
        # EAGLE-2's dynamic tree has the shape of the static tree (k, 1, 1, ...): k nodes per level below the root
        self.dynamic_topk = tree.topk
        # tree="auto" (``widths`` {1: chains' deepest, k: trees'}): ``tree`` the chain, ``wide`` the dynamic tree of k
        # a level, each step's chosen by the adaptive controller (``StepBatch.width``)
        self.widths = widths
        self.wide = dynamic_tree(max(widths), tree.depth) if widths else None
        self.max_nodes = max(self.max_nodes, self.wide.num_nodes if self.wide else 0)
        self.features = features
        # [K]: the draft vocabulary's target ids (an EAGLE-1/2 head drafts over the target's whole vocabulary)
        self._draft_ids = head.d2t + torch.arange(head.draft_vocab_size, device=head.d2t.device) \
            if head.layout == "eagle3" else torch.arange(head.vocab_size, device=self.device)  # fmt: skip
        self.target_layers = head.target_layers
        self._node_parents = to_device(self.device, self._parents.clamp(min=0))[0]  # [T_max]: node -> parent node

    def tree_for(self, width: int) -> StaticTree:
        return self.wide if width > 1 else self.tree

    @property
    def native(self) -> NativeHead | None:
        """The handle of the engine's native steps (``spec_chain``): an EAGLE-3 head's chains, static trees and
        EAGLE-2's dynamic tree alike (None for a dynamic tree wider than the draft vocabulary: only the Python path,
        over the target's whole vocabulary, takes it)."""
        if self.dynamic_topk is not None and self.dynamic_topk > self.model.draft_vocab_size:
            return None
        return self.model.native

    def use_graphs(self, enforce_eager: bool, mechanism: str | None = None, *, table_width: int,
                   max_rows: int) -> None:  # fmt: skip
        """The head's forwards replayed from graphs per bucket, as a draft model's: ``graphs`` the entries that read
        the feature cache (a short catch-up's), ``node_graphs`` the tree nodes that read their parents' outputs (an
        input of the capture). On the CPU an EAGLE-3 head's native calls stay as they are."""
        super().use_graphs(enforce_eager, mechanism, table_width=table_width, max_rows=max_rows)
        self.node_graphs = None if enforce_eager else captured_forward(
            self._node_hidden, self.device, table_width=table_width, max_rows=max_rows,
            max_width=max(CATCH_UP_SLACK + 1, self.max_nodes), mechanism=mechanism,
            name="head's tree nodes")  # fmt: skip

    def _store(self, hidden: torch.Tensor, positions: torch.Tensor, block_table: torch.Tensor) -> None:
        """The target's hidden states [B, T, F] at ``positions`` [B, T] into the feature cache."""
        blocks, offsets = cache_slots(positions, self.features.shape[2], block_table)
        self.features[0, blocks, offsets] = self.model.features(hidden)

    def prefill(self, input_ids, positions, cache_seqlens, mask, block_table, hidden=None) -> None:
        self._store(hidden, positions, block_table)
        self._forward_prefix(input_ids, positions, cache_seqlens, mask, block_table)

    def store_features(self, positions, block_table, hidden) -> None:
        self._store(hidden, positions, block_table)

    def _forward_prefix(self, tokens, positions, cache_seqlens, mask, block_table, last=None) -> torch.Tensor | None:
        native = self.model.native
        if native is None:
            return super()._forward_prefix(tokens, positions, cache_seqlens, mask, block_table, last)
        # the head's layer in one call, each entry's feature read from the cache there, no chain after it
        roots = torch.zeros_like(cache_seqlens, dtype=torch.int64) if last is None else last  # [B]
        hidden = eagle3_draft(native, tokens, cache_seqlens, roots, self.features, self.kv.data, gamma=0,
                              block_table=block_table)[0]  # fmt: skip
        return None if last is None else hidden

    def _hidden(self, tokens, positions, cache_seqlens, mask, block_table) -> tuple[torch.Tensor]:
        """Entries of the sequences themselves, each reading the feature cache at the position before it: (the
        head's outputs [B, T, H],), what ``graphs`` captures."""
        before = positions - 1  # [B, T]: entry p reads the feature of p - 1 (zeros before the first token)
        blocks, offsets = cache_slots(before.clamp(min=0), self.features.shape[2], block_table)
        feats = self.features[0, blocks, offsets] * (before >= 0)[..., None]  # [B, T, H]
        return (self.model(tokens, feats, positions, self.kv.data, cache_seqlens, mask, block_table),)

    def _forward_nodes(self, tokens, nodes, sub, positions, cache_seqlens, mask, block_table) -> torch.Tensor:
        feats = nodes[:, self._node_parents[sub]]  # [B, n, H]: the parents' outputs stand in for their features
        forward = self.node_graphs or self._node_hidden
        return forward(tokens[:, sub], positions, cache_seqlens, mask, block_table, feats)[0]

    def _node_hidden(self, tokens, positions, cache_seqlens, mask, block_table, feats) -> tuple[torch.Tensor]:
        """Tree nodes [B, n] on their parents' outputs ``feats`` [B, n, H]: (outputs [B, n, H],), ``node_graphs``'."""
        return (self.model(tokens, feats, positions, self.kv.data, cache_seqlens, mask, block_table),)

    def propose(self, batch: StepBatch) -> Draft:
        if self.dynamic_topk is not None or batch.width > 1:
            return self._propose_dynamic(batch)
        native = self.model.native
        greedy = all(r.greedy for r in batch.rows)
        # a sampled chain natively: its draws are Gumbel-top-1, which "without_replacement" makes (and coupled rows)
        sampled = not greedy and self.draft_sampling == "without_replacement"
        if native is None or not self.tree.is_chain or not (greedy and batch.coupled is None or sampled):
            return super().propose(batch)
        # the catch-up's last forward and the whole chain in one native call
        gamma = max(batch.gammas)
        tokens, start, lags = self._catch_up_entries(batch)
        draws = self._chain_noise(batch, gamma) if sampled else {}
        _, chain, logits = eagle3_draft(native, tokens, start, lags, self.features, self.kv.data, gamma=gamma,
                                        block_table=batch.block_table, **draws)  # fmt: skip
        parents, tree_mask, depths = self._tree_shape(batch.gammas)
        tokens = torch.cat((batch.roots[:, None], chain), dim=1)  # [B, gamma + 1]
        if not sampled:
            return Draft(tokens, parents, tree_mask, depths, None, "iid")
        # q: node d - 1's draft distribution, softmax(logits / temperature) over the draft vocabulary
        temp = batch.draft_temperature[:, None, None]  # [B, 1, 1]
        q = torch.zeros(batch.size, gamma + 1, self.model.vocab_size, device=self.device)  # [B, T, V]
        q[:, :gamma, self._draft_ids] = torch.softmax(logits / temp, dim=-1)
        return Draft(tokens, parents, tree_mask, depths, q, self.draft_sampling)

    def _chain_noise(self, batch: StepBatch, gamma: int) -> dict:
        """``eagle3_draft``'s sampling inputs for a chain of ``depth``: inv_temp [B] (0 on greedy rows) and noise
        [B, gamma, K], each level's Gumbel noise at the draft vocabulary's ids, the same draws as the level-by-level
        path's (``DraftModelDrafter._draw_children``): a row's own stream keyed by ``keys + d``, or on coupled rows
        the coupling's noise at the parent's position L_b + d - 1."""
        V, ids, free = self.model.vocab_size, self._draft_ids, batch.free_draws
        levels = []
        for d in range(1, gamma + 1):
            noise = rng.gumbel(batch.keys + d, (1, V))[:, 0, ids] if free else None  # [B, K]
            if batch.coupled is not None:
                positions = batch.cache_seqlens.long()[:, None] + (d - 1)  # [B, 1]
                coupled = position_gumbel(batch.noise_seeds, positions, V)[:, 0, ids]  # [B, K]
                noise = coupled if noise is None else torch.where(batch.coupled[:, None], coupled, noise)
            levels.append(noise)
        inv_temp = torch.where(batch.temperature == 0, 0.0, 1.0 / batch.draft_temperature.clamp(min=1e-30))
        return {"inv_temp": inv_temp.float().contiguous(), "noise": torch.stack(levels, 1).float().contiguous()}

    def _propose_dynamic(self, batch: StepBatch) -> Draft:
        """EAGLE-2's dynamic tree under a fixed node budget: level d keeps the k nodes of highest cumulative log q
        among the k best children of each of level d - 1's k nodes (level 1: the root's k best; ``dynamic_level``).
        The shape (k nodes per level, their depths, each row's padding) is fixed and host-known; which parent each
        node hangs from is chosen on the device, and the mask follows from it there. The children are the head's most
        likely tokens (a coupled row's: on its level's perturbed logits, Gumbel-top-k, ``_tree_noise``), not draws,
        so every row verifies them as point-mass proposals (a coupled row on its perturbed argmax): lossless whatever
        tree was chosen. A native head (``native``) drafts the whole tree in one ``eagle3_draft`` call, by the same
        rule as ``_dynamic_levels``, the reference, level by level here."""
        tree = self.tree_for(batch.width)
        gamma, k = max(batch.gammas), tree.topk
        T = tree.nodes(gamma)
        static_parents, _, depths = self._tree_shape(batch.gammas, tree)  # [B, T]: padding and depths per row
        eye = torch.eye(T, dtype=torch.bool, device=self.device)  # [T, T]
        if self.native is not None:
            entries, start, lags = self._catch_up_entries(batch)
            _, nodes, parents = eagle3_draft(self.native, entries, start, lags, self.features, self.kv.data,
                                             gamma=gamma, block_table=batch.block_table, topk=k,
                                             **self._tree_noise(batch, gamma))  # fmt: skip
            tokens = torch.cat((batch.roots[:, None], nodes), dim=1)  # [B, T]
            mask = eye.repeat(batch.size, 1, 1)  # [B, T, T]
            for level in tree.level_slices[1 : gamma + 1]:
                mask_level(mask, parents, level, eye)
        else:
            tokens, parents, mask = self._dynamic_levels(batch, tree, gamma, depths, eye)
        pad = static_parents == PAD_NODE  # rows drafted shallower than the deepest: their extra nodes are padding
        pad[:, 0] = False
        parents = parents.masked_fill(pad, PAD_NODE)
        mask = torch.where(pad[..., None], eye, mask)
        return Draft(tokens, parents, mask, depths, None, "iid")

    def _tree_noise(self, batch: StepBatch, gamma: int) -> dict:
        """A dynamic tree's draws: the chain's (``_chain_noise``) on coupled rows, whose children are then ranked on
        their level's perturbed logits; other rows rank the head's logits (a free draw's children are point masses
        either way, verified as such)."""
        if batch.coupled is None:
            return {}
        draws = self._chain_noise(batch, gamma)
        return draws | {"inv_temp": torch.where(batch.coupled, draws["inv_temp"], 0.0).contiguous()}

    def _dynamic_levels(self, batch: StepBatch, tree: StaticTree, gamma: int, depths: torch.Tensor, eye: torch.Tensor):
        """The dynamic tree level by level (torch ops; the reference of the native ``eagle3_draft``'s): tokens and
        parents [B, T], the mask [B, T, T]."""
        T = eye.shape[0]
        B, L, dev = batch.size, batch.cache_seqlens, self.device
        tokens = torch.zeros(B, T, dtype=torch.int64, device=dev)  # [B, T]
        tokens[:, 0] = batch.roots
        parents = torch.full((B, T), PAD_NODE, dtype=torch.int64, device=dev)  # [B, T]
        mask = eye.repeat(B, 1, 1)  # [B, T, T]
        scores = torch.zeros(B, T, device=dev)  # [B, T]: cumulative log q of each node's path
        rows = torch.arange(B, device=dev)[:, None]  # [B, 1]
        root = self._catch_up(batch)  # [B, H]
        nodes = root.new_empty(B, T, root.shape[-1])  # [B, T, H]: each node's output
        nodes[:, 0] = root
        logits = self.model.logits(root)[:, None]  # [B, 1, V]
        levels, k = tree.level_slices, tree.topk
        draws = self._tree_noise(batch, gamma)
        for d in range(1, gamma + 1):
            parent_level, level = levels[d - 1], levels[d]
            if draws:  # coupled rows: their level's perturbed logits
                logits = perturbed(logits, draws["inv_temp"], draws["noise"][:, d - 1], self._draft_ids)
            best, parent, token = dynamic_level(logits, scores[:, parent_level], k)  # [B, k] each
            tokens[:, level] = token
            parents[:, level] = parent_level.start + parent
            scores[:, level] = best
            mask_level(mask, parents, level, eye)
            if d == gamma:
                break
            sub = slice(1, level.stop)  # levels 1..d, re-rooted at node 1 (the root's entry is cached at L)
            feats = nodes[rows, parents[:, sub]]  # [B, n, H]: the parents' outputs
            hidden = self.model(tokens[:, sub], feats, L.long()[:, None] + depths[:, sub], self.kv.data, L + 1,
                                mask[:, sub, sub], batch.block_table)  # fmt: skip
            nodes[:, sub] = hidden
            logits = self.model.logits(hidden[:, level.start - 1 :])  # [B, k, V]
        return tokens, parents, mask

    def commit(self, batch: StepBatch, result: VerifyResult, num_accepted: list[int], hidden=None) -> list[int]:
        """Every row (drafted or not): the nodes' features in, the accepted path's kept. A drafted row's head cache
        ends after its root's entry; an undrafted row's is unchanged (the catch-up feeds it later)."""
        T = hidden.shape[1]
        self._store(
            hidden, batch.cache_seqlens.long()[:, None] + torch.arange(T, device=self.device), batch.block_table
        )
        if T > 1:
            compact_kv_(self.features, batch.cache_seqlens, result.accepted_nodes, result.num_accepted,
                        block_table=batch.block_table)  # fmt: skip
        return [r.cache_seqlen + 1 if gamma else r.draft_len for r, gamma in zip(batch.rows, batch.gammas)]
