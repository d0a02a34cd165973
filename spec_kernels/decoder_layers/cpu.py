"""``decoder_layers``' native CPU backend, the glue to the C++ extension: the flat weight list its ops take
(``LayerWeights``), and the native step ops that run a whole model in one call (``NativeModel`` / ``NativeHead`` and
``draft_chain``, ``plain_steps``, ``spec_chain``, ``tree_step``, ``eagle3_draft``; csrc/runner_cpu.cpp).
``spec_kernels.decoder_layers`` re-exports the public names.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from spec_kernels.decoder_layers.ref import LLAMA, LayerVariant
from spec_kernels.types import QuantizedWeight, VerifyResult

_EMPTY = torch.empty(0)  # stands for a missing optional weight in the C++ op's list (its schema has no holes)
NATIVE_DTYPES = (torch.float32, torch.bfloat16)


class LayerWeights(list):
    """A model's layer tensors in ``decoder_layers``' order (``LAYER_FIELDS`` per layer, None for an absent one),
    with the C++ op's list of them built once: a model builds this at ``fuse``, and flattening and checking ~90
    entries on every native call would be a measurable part of a speculative step.

    ``flat``: ``_op_tensor`` of each entry; ``takes(dtype)``: whether the native op takes these layers with
    activations of that dtype (every quantized matrix on the CPU, every other tensor in that dtype, norm vectors in
    it or in float32: Gemma's 1 + w, which the C++ op reads as float32). A plain list passed to ``decoder_layers``
    is flattened on each call."""

    def __init__(self, weights):
        super().__init__(weights)
        self.flat = [_op_tensor(w) for w in self]
        self._decide()

    def _decide(self) -> None:
        """The one dtype the non-float32-vector tensors share (None: they do not, or a quantized matrix is off the
        CPU), and the entry that tells it (None: only quantized matrices and float32 vectors, any dtype)."""
        quant_cpu = all(w.device.type == "cpu" for w in self if isinstance(w, QuantizedWeight))
        tell = [
            i for i, w in enumerate(self) if isinstance(w, torch.Tensor) and (w.dim() > 1 or w.dtype != torch.float32)
        ]
        dtypes = {self[i].dtype for i in tell}
        self._witness = tell[0] if tell else None
        self._dtype = dtypes.pop() if len(dtypes) == 1 and quant_cpu else None
        self._any = not tell and quant_cpu

    def takes(self, dtype: torch.dtype) -> bool:
        witness = self._witness
        if self._dtype is not None and self.flat[witness].dtype != self._dtype:  # Module.to() converts in place
            self._decide()
        return dtype in NATIVE_DTYPES and (self._any or self._dtype == dtype)


def _op_tensor(w: torch.Tensor | QuantizedWeight | None) -> torch.Tensor:
    """What the C++ ops take for a weight: the tensor, a quantized matrix's uint8 blocks ``[N, K / block_weights,
    block_bytes]`` (the op tells the format by that shape), an empty tensor for a missing optional one."""
    if w is None:
        return _EMPTY
    return w.blocks if isinstance(w, QuantizedWeight) else w


def _native_ops():
    """``torch.ops.spec_kernels`` with the extension loaded: the step runners' ops are looked up before a model's
    ``handle`` (which loads it) is built, so in a fresh process they were not registered yet."""
    from spec_kernels._ext import load_ext

    load_ext()
    return torch.ops.spec_kernels


@dataclass(frozen=True, eq=False)
class NativeModel:
    """A whole model as the native step ops take it (``draft_chain``, ``plain_steps``, ``spec_chain``), built
    once by the model's ``fuse`` (``native_model``): CPU tensors in one float32 or bfloat16 dtype, or GGUF blocks.

    Shapes: embed ``[V, H]``; lm_head ``[V, H]``, or ``[K, H]`` over ``vocab_map`` ``[K]`` int64 (a draft's
    restricted vocabulary, ``LlamaForCausalLM.restrict_vocab``; None: the whole vocabulary); final_norm ``[H]``;
    rope_table ``[2, P, D]`` (cos, sin by position P). ``variant`` (``LayerVariant``: Gemma's layer, its float32
    norms included), ``rope_local`` ``[2, P, D]`` (its windowed layers' table), ``embed_scale`` (each embedding row
    times it, rounded to the dtype; 0: none) and ``final_softcap`` (the logits' soft cap, Gemma 2's, which the
    runners' argmax and sampling read through; 0: none): a family's layer other than Llama's."""

    embed: torch.Tensor | QuantizedWeight
    layers: LayerWeights
    final_norm: torch.Tensor
    lm_head: torch.Tensor | QuantizedWeight
    rope_table: torch.Tensor
    num_heads: int
    eps: float
    vocab_map: torch.Tensor | None = None
    variant: LayerVariant | None = None
    rope_local: torch.Tensor | None = None
    embed_scale: float = 0.0
    final_softcap: float = 0.0

    @property
    def dtype(self) -> torch.dtype:
        return self.rope_table.dtype

    @functools.cached_property
    def handle(self) -> torch.ScriptObject:
        """The model as the ops take it, made and checked once (``new_handle``)."""
        return self.new_handle()

    def new_handle(self) -> torch.ScriptObject:
        """A new ``torch.classes.spec_kernels.NativeModel`` (csrc/native_model.h) of this model's tensors (shared,
        not copied); its constructor checks them."""
        from spec_kernels._ext import load_ext

        load_ext()
        handle = torch.classes.spec_kernels.NativeModel(_op_tensor(self.embed), self.layers.flat, self.final_norm,
                                                        _op_tensor(self.lm_head), self.rope_table, self.num_heads,
                                                        self.eps, self.vocab_map)  # fmt: skip
        v = self.variant or (LLAMA if self.final_softcap else None)  # (a final cap alone rides on Llama's layer)
        if v is not None:
            handle.set_variant(list(v.windows or []), self.rope_local, v.softmax_scale or 0.0, v.softcap or 0.0,
                               v.activation, self.embed_scale, self.final_softcap)  # fmt: skip
        return handle

    def check_cache(self, kv_cache: torch.Tensor) -> torch.Tensor:
        """``kv_cache``, or ValueError for a cache of another dtype (the model's decides its cache's)."""
        if kv_cache.dtype != self.dtype:
            raise ValueError(f"native chain: a {self.dtype} model takes a {self.dtype} cache, got {kv_cache.dtype}")
        return kv_cache


def native_model(embed, layers: LayerWeights, final_norm, lm_head, rope_table, *, num_heads: int, eps: float,
                 vocab_map: torch.Tensor | None = None, variant: LayerVariant | None = None,
                 rope_local: torch.Tensor | None = None, embed_scale: float = 0.0,
                 final_softcap: float = 0.0) -> NativeModel | None:  # fmt: skip
    """The model as the native step ops take it, or None where they cannot run it (a device other than the CPU, a
    dtype other than float32 / bfloat16, tensors of mixed dtypes): decided once, when the model is built."""
    dtype = rope_table.dtype
    float32_norms = variant is not None and variant.float32_norms
    fits = (
        rope_table.is_cpu
        and dtype in NATIVE_DTYPES
        and layers.takes(dtype)
        and (final_norm.dtype == dtype or (float32_norms and final_norm.dtype == torch.float32))
        and (rope_local is None or (rope_local.dtype == dtype and rope_local.shape == rope_table.shape))
        and all(isinstance(t, QuantizedWeight) or t.dtype == dtype for t in (embed, lm_head))
        and embed.device.type == "cpu"
        and lm_head.device.type == "cpu"
    )
    if not fits:
        return None
    return NativeModel(embed, layers, final_norm, lm_head, rope_table, num_heads, eps, vocab_map, variant, rope_local,
                       embed_scale, final_softcap)  # fmt: skip


@dataclass(frozen=True, eq=False)
class NativeHead:
    """An EAGLE-3 head as ``eagle3_draft`` and ``spec_chain`` take it, built once by ``EagleHead.fuse``: ``model``
    its one layer (the qkv matrix reads the 2 H attention input), final norm, embedding (the target's, unless the
    head has its own) and lm_head over ``model.vocab_map`` (the draft vocabulary's target ids, d2t applied);
    ``hidden_norm`` ``[H]`` the feature's norm; ``norm_before_residual``: the residual stream starts at the normed
    feature; ``fc`` ``[H, C * H_target]`` maps the target's residual streams entering layers ``capture`` (C of them,
    concatenated in that order) to the head's features."""

    model: NativeModel
    hidden_norm: torch.Tensor
    norm_before_residual: bool
    fc: torch.Tensor
    capture: tuple[int, ...]

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @functools.cached_property
    def handle(self) -> torch.ScriptObject:
        """The head as the ops take it: a ``NativeModel`` of its layer with the head's parts (``set_head``)."""
        handle = self.model.new_handle()
        handle.set_head(self.hidden_norm, self.fc, self.norm_before_residual, list(self.capture))
        return handle


def draft_chain(
    root_logits: torch.Tensor,
    model: NativeModel,
    kv_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    *,
    gamma: int,
    block_table: torch.Tensor | None = None,
    strict: bool = False,
) -> torch.Tensor:
    """A greedy draft chain in one native call: ``gamma`` tokens per row, token d the argmax of token d-1's logits
    (the first of them of ``root_logits``, final logits as ``model.logits`` returns them: a capped model's already
    capped, not capped again; the chain's own are, as that), tokens 1 .. gamma-1 run through the layers at positions
    ``L_b + d`` (their K/V written there).

    Shapes: root_logits ``[B, V]`` (``[B, K]`` over ``model.vocab_map`` for a restricted vocabulary); cache_seqlens
    ``[B]`` the roots' positions L_b; returns ``[B, gamma]`` int64. ``strict``: from a row's first logits with a NaN
    or a non-finite maximum on, its tokens are -1 (a draft skips NaNs by default: a bad guess costs acceptance
    only).
    """
    return _native_ops().draft_chain(root_logits, model.handle, model.check_cache(kv_cache), cache_seqlens,
                                     block_table, gamma, strict)  # fmt: skip


def plain_steps(
    roots: torch.Tensor,
    model: NativeModel,
    kv_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    *,
    steps: int,
    block_table: torch.Tensor | None = None,
    stop_ids: torch.Tensor | None = None,
    temperature: torch.Tensor | None = None,
    noise_seeds: torch.Tensor | None = None,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """``steps`` plain steps per row in one native call (see ``plain_steps_cpu``): the roots ``[B]`` run at
    positions ``cache_seqlens`` (L_b), then each token is the argmax of the previous forward's logits and runs at
    L_b + d, its K/V written there: ``spec_chain``'s steps with no draft. Returns ``[B, K]`` int64, K = ``steps``,
    or fewer where some row emitted one of ``stop_ids`` ``[S]`` (the call ends after that token) or where some row's
    logits are not finite (the call ends before that step; K = 0 when the first is). The model's vocabulary cannot
    be restricted (its logits decide the output). ``temperature`` ... ``min_p``: sampled rows, as ``spec_chain``
    takes them (the position-keyed coupling's tokens)."""
    if model.vocab_map is not None:
        raise ValueError("plain_steps: the model's vocabulary cannot be restricted (its logits decide the output)")
    sampling = row_sampling(temperature, noise_seeds, top_k, top_p, min_p)
    return _native_ops().plain_steps(roots, model.handle, model.check_cache(kv_cache), cache_seqlens,
                                      block_table, steps, stop_ids, sampling)  # fmt: skip


def row_sampling(temperature=None, noise_seeds=None, top_k=None, top_p=None, min_p=None) -> list:
    """A native call's sampled rows as its ops take them (``Tensor?[] sampling``, read by ``sampling_of`` in
    csrc/runner_cpu.cpp into its ``Sampling``): ``[temperature, noise_seeds, top_k, top_p, min_p]``, each ``[B]`` or
    None; the empty list where every row is greedy."""
    fields = [temperature, noise_seeds, top_k, top_p, min_p]
    return [] if all(t is None for t in fields) else fields


SPEC_CHAIN_MAX_NODES = 1024  # the widest tree spec_chain takes (kMaxTreeNodes in csrc/runner_cpu.cpp)


def spec_chain(target: NativeModel, draft: NativeModel | NativeHead, catch_up, catch_up_lens, cache_seqlens,
               target_kv, draft_kv, block_table, tokens_left, stop_ids, *, gamma: int, max_steps: int,
               stop_on_reject: bool = False, draft_features: torch.Tensor | None = None, tree: Sequence[int] = (),
               topk: int = 0, temperature: torch.Tensor | None = None, noise_seeds: torch.Tensor | None = None,
               top_k: torch.Tensor | None = None, top_p: torch.Tensor | None = None,
               min_p: torch.Tensor | None = None):  # fmt: skip
    """Up to ``max_steps`` speculative steps of a draft model's or an EAGLE-3 head's chain in one native call
    (see ``spec_chain_cpu`` in csrc/runner_cpu.cpp). A head reads its features from ``draft_features``
    ``[1, num_blocks, block_size, H]`` (on the caches' blocks), and each step writes the accepted positions' there.
    ``gamma`` 0: plain steps, the draft idle (a head's features still written).

    catch_up ``[B, P]`` the tokens each row's draft cache lacks (its lag) then its root, catch_up_lens / cache_seqlens
    (L_b) / tokens_left ``[B]``, stop_ids ``[S]``. Returns (steps ``[B, max_steps, gamma + 2]``: per step the count n of
    emitted tokens then the tokens; the rows' new catch_up ``[B, P']`` and catch_up_lens ``[B]``; times
    ``[max_steps, 2]``: per step the draft's and the whole step's seconds; ranks ``[B, max_steps, gamma + 1]``: per
    step the accepted path's ranks, ``spec_engine.tree.path_ranks``'s, what a chain would have kept).
    ``stop_on_reject``: a step where some row accepted no draft is the call's last (an adaptive controller then
    re-decides the depth). ``tree`` (a head's):
    the static tree with ``tree[d]`` children per node at depth d (``gamma`` levels; empty: a chain), its children
    the head's most likely tokens, the accepted paths compacted in the target's cache after each step. ``topk`` k > 0
    (a head's): EAGLE-2's dynamic tree of k nodes a level (``tree`` its shape (k, 1, ..., 1) or empty), each level's
    parents chosen per row and step by path score (``spec_engine.drafters.dynamic_tree``'s rule: a sampled row's on
    its level's perturbed logits). ``temperature`` float32 and ``noise_seeds`` int64 ``[B]`` (together): the rows at a
    temperature > 0 are sampled through the position-keyed coupling (``spec_engine.coupling``: the regular step's
    coupled rows, the same tokens), drafted by a head's chains or dynamic trees or not at all (``gamma`` 0).
    ``top_k`` int64, ``top_p`` and ``min_p`` float32 ``[B]`` (together, with ``temperature``; 0, 1, 0: off): a sampled
    row's filters (``keep_threshold``, the regular step's).
    """
    if target.vocab_map is not None:
        raise ValueError("spec_chain: the target's vocabulary cannot be restricted (its logits decide the output)")
    head = isinstance(draft, NativeHead)
    if head and draft_features is None:
        raise ValueError("spec_chain: an EAGLE-3 head needs its feature cache (draft_features)")
    model = draft.model if head else draft
    caches = [target.check_cache(target_kv), model.check_cache(draft_kv)] + ([draft_features] if head else [])
    inputs = [
        catch_up,
        catch_up_lens,
        cache_seqlens,
        tokens_left,
        stop_ids,
        block_table,
    ]  # spec_chain_cpu's inputs, in its order
    sampling = row_sampling(temperature, noise_seeds, top_k, top_p, min_p)
    return _native_ops().spec_chain(target.handle, draft.handle, caches, inputs, sampling,
                                    [gamma, max_steps, int(stop_on_reject)], list(tree), topk)  # fmt: skip


def tree_step(
    target: NativeModel, tokens, parents, cache_seqlens, kv_cache, block_table=None, *, capture: Sequence[int] = ()
) -> tuple[VerifyResult, torch.Tensor | None] | None:
    """One greedy speculative step over trees drafted elsewhere, in one native call (``tree_step_cpu`` in
    csrc/runner_cpu.cpp): the target's pass over every node (slot L_b + t, position L_b + its depth, seeing the prefix
    and its ancestors), greedy verification (the walk ``verify_tree`` and ``spec_chain`` share) and the accepted paths'
    K/V compacted to L_b .. in every plane: what the regular step's target pass, ``verify_tree`` and ``compact_kv_``
    do for greedy rows, the same tokens and cache.

    tokens, parents ``[B, T]`` int64 (``verify_tree``'s), cache_seqlens ``[B]`` = L_b; ``capture``: the layers whose
    input streams come back too (an EAGLE-3 head's features, ``LlamaForCausalLM.forward_features``). Returns
    (``VerifyResult``, features ``[B, T, len(capture) * H]`` or None), or None, with nothing compacted, where some row
    needs the regular path (a visited node's logits not finite, which it sanitises; a malformed tree, for which it
    raises): it redoes the step, overwriting the slots this call wrote."""
    if target.vocab_map is not None:
        raise ValueError("tree_step: the target's vocabulary cannot be restricted (its logits decide the output)")
    accepted, output, counts, features = _native_ops().tree_step(
        tokens, parents, cache_seqlens, target.handle, target.check_cache(kv_cache), block_table, list(capture)
    )  # [B, T], [B, T], [B], [B, T, F] | [0]
    if counts.numel() and int(counts.min()) < 1:
        return None
    return VerifyResult(accepted, output, counts), features if capture else None


def eagle3_draft(
    head: NativeHead,
    tokens: torch.Tensor,
    start: torch.Tensor,
    last: torch.Tensor,
    feature_cache: torch.Tensor,
    kv_cache: torch.Tensor,
    *,
    gamma: int,
    block_table: torch.Tensor | None = None,
    inv_temp: torch.Tensor | None = None,
    noise: torch.Tensor | None = None,
    topk: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An EAGLE-3 head's entries and greedy (or sampled) chain in one native call (see ``eagle3_draft_cpu``).

    Entry (b, t) is ``tokens[b, t]`` at position ``start[b] + t`` (a causal chunk: a prefill chunk or a step's
    catch-up) with the target's feature of the position before it from ``feature_cache``; its K/V are written.
    From each row's root, entry ``last[b]`` at R_b = start_b + last_b, ``gamma`` greedy tokens follow: token d the
    argmax of the head's logits at node d - 1 over its draft vocabulary, node d run at R_b + d with its parent's
    output as its feature. A sampled chain gives ``inv_temp`` [B] float32 (1 / temperature, 0 for a greedy row) and
    ``noise`` [B, gamma, K] float32 (Gumbel noise over the K draft tokens per level): a sampled row's token d is then
    the argmax of logits * inv_temp + noise, a draw from softmax(logits / temperature).

    Shapes: tokens ``[B, T]``; start, last ``[B]``; feature_cache ``[1, num_blocks, block_size, H]`` and kv_cache
    ``[1, 2, num_blocks, block_size, Hkv, D]`` on ``block_table`` ``[B, max_blocks]``. Returns (the roots' raw
    outputs ``[B, H]``, the stand-ins for their features: the other entries' outputs feed nothing, so only their
    K/V are made; the chain ``[B, gamma]`` int64; a sampled chain's logits at each level ``[B, gamma, K]`` float32,
    empty otherwise). ``topk`` k > 0 drafts EAGLE-2's dynamic tree instead, as ``spec_chain`` does
    (``spec_engine.drafters.dynamic_tree``'s rule; with draws, a sampled row's children ranked on its level's perturbed
    logits): then the second result is its nodes' tokens ``[B, k * gamma]`` (nodes 1 ..) and the third their parents
    ``[B, 1 + k * gamma]`` int64 (the root's -1).
    """
    draws = [] if inv_temp is None and noise is None else [inv_temp, noise]  # eagle3_draft_cpu's draws, in its order
    return _native_ops().eagle3_draft([tokens, start, last], feature_cache, head.handle,
                                      head.model.check_cache(kv_cache), block_table, gamma, draws, topk)  # fmt: skip
