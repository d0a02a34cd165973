"""Reference implementations: the readable spec of every op, in plain torch.

Each ``<op>_ref`` has its op's exact signature. It is what the tests and benchmarks compare against, and the
CPU fallback of last resort (``backend="torch"``). Clarity beats speed here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

PAD_NODE = -1  # padding in parents / accepted_nodes / output_tokens


class VerifyResult(NamedTuple):
    accepted_nodes: torch.Tensor  # [B, T] int64: the accepted path from the root, padded with PAD_NODE
    output_tokens: torch.Tensor  # [B, T] int64: accepted drafts, then the recovered/bonus token, padded with -1
    num_accepted: torch.Tensor  # [B] int64: path length including the root == number of emitted tokens


# --- tree_attention -------------------------------------------------------------------------------------------


def _gather_kv(cache: torch.Tensor, b: int, length: int, block_table: torch.Tensor | None) -> torch.Tensor:
    """Logical positions ``0 .. length-1`` of sequence ``b``: ``[length, Hkv, D]``."""
    if block_table is None:
        return cache[b, :length]  # [length, Hkv, D]
    block_size = cache.shape[1]
    pos = torch.arange(length, device=cache.device)
    blocks = block_table[b, pos // block_size].long()
    return cache[blocks, pos % block_size]  # [length, Hkv, D]


def tree_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    tree_mask: torch.Tensor,
    *,
    block_table: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Every tree node attends to the whole committed prefix plus the tree nodes its mask allows.

    Softmax runs in float32 (float64 inputs stay float64, which makes this the tests' exact reference). A row that
    sees nothing (L_b = 0 and an all-False mask row) outputs zeros rather than NaN.
    """
    B, T, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    group = Hq // Hkv
    scale = D**-0.5 if softmax_scale is None else softmax_scale
    compute_dtype = torch.promote_types(q.dtype, torch.float32)
    out = torch.empty_like(q)
    for b in range(B):
        L = int(cache_seqlens[b])
        k = _gather_kv(k_cache, b, L + T, block_table).to(compute_dtype).repeat_interleave(group, dim=1)
        v = _gather_kv(v_cache, b, L + T, block_table).to(compute_dtype).repeat_interleave(group, dim=1)
        scores = torch.einsum("thd,shd->hts", q[b].to(compute_dtype), k) * scale  # [Hq, T, L+T]
        prefix = torch.ones(T, L, dtype=torch.bool, device=q.device)
        allowed = torch.cat([prefix, tree_mask[b]], dim=1)  # [T, L+T]
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # all-masked rows: NaN -> 0
        out[b] = torch.einsum("hts,shd->thd", probs, v).to(q.dtype)  # [T, Hq, D]
    return out


# --- verify_tree ------------------------------------------------------------------------------------------------


def _transform_row_ref(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float
) -> torch.Tensor:
    """One node's logits [V] -> its transformed target distribution [V] float64 (greedy: one-hot argmax).

    HF order: logits / temperature, top-k (ties kept), top-p, min-p, renormalising after each. See
    spec_kernels/_sampling.py for the exact filter definitions and the NaN/inf sanitising.
    """
    z = logits.double() / (temperature if temperature > 0 else 1.0)
    z = torch.nan_to_num(z, nan=-math.inf, posinf=torch.finfo(torch.float32).max)
    if bool((z == -math.inf).all()):
        z = torch.zeros_like(z)  # nothing finite: uniform, greedy id 0
    if temperature == 0:
        return torch.nn.functional.one_hot(z.argmax(), z.numel()).double()
    neg_inf = torch.tensor(-math.inf, dtype=z.dtype)
    if 0 < top_k < z.numel():
        kth = torch.sort(z, descending=True).values[top_k - 1]
        z = torch.where(z >= kth, z, neg_inf)
    if top_p < 1:
        p = torch.softmax(z, -1)
        p_sorted = torch.sort(p, descending=True).values
        mass_before = torch.cumsum(p_sorted, 0) - p_sorted
        smallest_kept = p_sorted[mass_before < top_p][-1]
        z = torch.where(p >= smallest_kept, z, neg_inf)
    if min_p > 0:
        p = torch.softmax(z, -1)
        z = torch.where(p >= min_p * p.max(), z, neg_inf)
    return torch.softmax(z, -1)


def verify_tree_ref(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    parents: torch.Tensor,
    *,
    draft_probs: torch.Tensor | None = None,
    draft_sampling: str = "iid",
    temperature: torch.Tensor | None = None,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
    seed: int | torch.Tensor | None = None,
    noise_seeds: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    coupled: torch.Tensor | None = None,
    backend: str | None = None,
) -> VerifyResult:
    """Reference verify_tree: python loops over rows, nodes and siblings, float64. See spec_kernels.verify_tree.

    A coupled row's token at each node is the Gumbel-max sample argmax_x (log p~(x) + g(x)) with the noise of
    ``spec_kernels.rng.position_gumbel`` at the node's position; the row then walks greedily on those tokens."""
    from spec_kernels._sampling import RESIDUAL_EPS, check_coupling_args, check_seed, check_verify_tree_args
    from spec_kernels.rng import position_gumbel

    parents, params = check_verify_tree_args(
        target_logits, draft_tokens, parents, draft_probs, draft_sampling, temperature, top_k, top_p, min_p
    )
    coupling = check_coupling_args(target_logits, noise_seeds, positions, coupled, params.temperature)
    B, T, V = target_logits.shape
    seed = check_seed(seed, target_logits.shape[0])
    gen = torch.Generator()
    gen.manual_seed(seed if isinstance(seed, int) else int(torch.randint(2**62, ())))
    accepted_nodes = torch.full((B, T), PAD_NODE, dtype=torch.int64)
    output_tokens = torch.full((B, T), PAD_NODE, dtype=torch.int64)
    num_accepted = torch.zeros(B, dtype=torch.int64)
    logits, tokens, par = target_logits.cpu(), draft_tokens.cpu().tolist(), parents.cpu().tolist()
    if coupling is not None:
        coupling = type(coupling)(*(x.cpu() for x in coupling))
    probs = draft_probs.cpu().double() if draft_probs is not None else None
    for b in range(B):
        if isinstance(seed, torch.Tensor):  # per-row seeds: row b's stream depends on seed[b] alone
            gen.manual_seed(int(seed[b]))
        t, k, tp, mp = (
            float(params.temperature[b]),
            int(params.top_k[b]),
            float(params.top_p[b]),
            float(params.min_p[b]),
        )
        is_coupled = coupling is not None and bool(coupling.coupled[b])
        path, node = [0], 0
        while True:
            p_node = _transform_row_ref(logits[b, node], t, k, tp, mp)
            children = [i for i in range(node + 1, T) if par[b][i] == node]
            if is_coupled:
                # the Gumbel-max sample at this node, with the noise of its position; the walk is then greedy
                g = position_gumbel(coupling.noise_seeds[b, None], coupling.positions[b, None, node, None], V)
                final = int((torch.log(p_node) + g[0, 0].double()).argmax())
                accepted = next((i for i in children if tokens[b][i] == final), None)
                if accepted is None:
                    break
                path.append(accepted)
                node = accepted
                continue
            q_node = probs[b, node] if probs is not None else None
            p, q = p_node, q_node
            accepted = None
            for child in children:
                x = tokens[b][child]
                q_x = 1.0 if q is None else float(q[x])  # draft_probs=None: a point-mass proposal
                u = float(torch.rand((), generator=gen, dtype=torch.float64))
                if u * q_x < float(p[x]):  # accept with probability min(1, p(x) / q(x))
                    accepted = child
                    break
                # rejected: the next sibling is judged against the residual norm(max(p - q, 0))
                if q is None:
                    residual = p.clone()
                    residual[x] = 0.0
                else:
                    residual = torch.clamp(p - q, min=0.0)
                p = residual / residual.sum() if residual.sum() > RESIDUAL_EPS else p_node
                if q is not None and draft_sampling == "without_replacement":
                    q = q.clone()
                    q[x] = 0.0  # the next sibling was drawn from the draft without x
                    q = q / q.sum() if q.sum() > RESIDUAL_EPS else q_node
            if accepted is None:
                # recovered (a child was rejected) or bonus (leaf) token, from the current residual
                final = int(torch.multinomial(p, 1, generator=gen))
                break
            path.append(accepted)
            node = accepted
        n = len(path)
        accepted_nodes[b, :n] = torch.tensor(path)
        output_tokens[b, : n - 1] = torch.tensor([tokens[b][i] for i in path[1:]], dtype=torch.int64)
        output_tokens[b, n - 1] = final
        num_accepted[b] = n
    dev = target_logits.device
    return VerifyResult(accepted_nodes.to(dev), output_tokens.to(dev), num_accepted.to(dev))


# --- compact_kv_ ------------------------------------------------------------------------------------------------


def compact_kv_ref(
    cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    accepted_nodes: torch.Tensor,
    num_accepted: torch.Tensor,
    *,
    block_table: torch.Tensor | None = None,
    backend: str | None = None,
) -> None:
    """Move the K/V rows of each accepted path to the first slots after the committed prefix, in place.

    For every plane n, sequence b and t < num_accepted[b]:
    ``cache[n, b, L_b + t] <- old cache[n, b, L_b + accepted_nodes[b, t]]`` with ``L_b = cache_seqlens[b]``; a paged
    cache maps logical slot p of sequence b to ``cache[n, block_table[b, p // block_size], p % block_size]``.
    Every source row is gathered (a copy) before any row is written, because paths like [0, 1, 3, 4] overlap.
    ``backend`` is ignored: this is the reference.
    """
    num_nodes = accepted_nodes.shape[1]
    steps = torch.arange(num_nodes, device=cache.device)  # [T]
    keep = steps < num_accepted.to(torch.int64)[:, None]  # [B, T]
    seq, step = keep.nonzero(as_tuple=True)  # [K], [K]: every (b, t) that moves a row
    base = cache_seqlens.to(torch.int64)[seq]  # [K]
    src = base + accepted_nodes.to(torch.int64)[seq, step]  # [K] logical source slots
    dst = base + step  # [K] logical destination slots
    if block_table is None:
        rows = cache[:, seq, src].clone()  # [N, K, ...]: read everything first
        cache[:, seq, dst] = rows
    else:
        block_size = cache.shape[2]
        table = block_table.to(torch.int64)  # [B, max_blocks]
        rows = cache[:, table[seq, src // block_size], src % block_size].clone()  # [N, K, ...]
        cache[:, table[seq, dst // block_size], dst % block_size] = rows


# --- linear -----------------------------------------------------------------------------------------------------


def linear_ref(
    x: torch.Tensor,
    weight: torch.Tensor | QuantizedWeight,
    bias: torch.Tensor | None = None,
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """``x @ weight.T + bias``: ``F.linear`` itself, ``[..., K] x [N, K] -> [..., N]`` (a ``QuantizedWeight``:
    ``quant_linear_ref``). ``backend`` is ignored."""
    if isinstance(weight, QuantizedWeight):
        return quant_linear_ref(x, weight.data, weight.qtype, bias=bias)
    return torch.nn.functional.linear(x, weight, bias)


# --- decoder_layers ---------------------------------------------------------------------------------------------

# The tensors of one layer in ``decoder_layers``' flat ``weights`` list, in order (None where a model has none).
LAYER_FIELDS = ("input_norm", "qkv", "qkv_bias", "o", "post_norm", "gate_up", "down", "q_norm", "k_norm")


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm: float32 statistics (fp16/bf16 variance underflows on long rows), then the weight in x's dtype."""
    normed = torch.nn.functional.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)
    return weight * normed


def rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE. x ``[B, T, H, D]``; cos, sin ``[B, T, 1, D]``."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def decoder_layer_loop(
    hidden, weights, final_norm, kv_cache, cache_seqlens, rope, tree_mask, block_table, num_heads, eps, linear, attend,
    capture=None,
):  # fmt: skip
    """The body of ``decoder_layers`` in torch ops, with the matmul (``linear(x, w, b)``) and the attention
    (``attend(q, k_cache, v_cache)``) given: the reference passes its references, the device path its kernels."""
    B, T, _ = hidden.shape
    Hkv, D = kv_cache.shape[-2:]
    sizes = (num_heads * D, Hkv * D, Hkv * D)
    cos, sin = rope.unsqueeze(3)  # 2 x [B, T, 1, D]
    pos = cache_seqlens.long()[:, None] + torch.arange(T, device=hidden.device)  # [B, T]
    block_size = kv_cache.shape[3]
    if block_table is None:
        blocks = torch.arange(B, device=hidden.device)[:, None].expand(B, T)
    else:
        blocks = block_table.long().gather(1, pos // block_size)  # [B, T]
    offsets = pos % block_size  # [B, T]
    h = hidden
    streams = {}  # the residual stream entering each captured layer
    for i in range(len(weights) // len(LAYER_FIELDS)):
        if capture is not None and i in capture:
            streams[i] = h
        w = dict(zip(LAYER_FIELDS, weights[i * len(LAYER_FIELDS) : (i + 1) * len(LAYER_FIELDS)]))
        q, k, v = linear(rms_norm_ref(h, w["input_norm"], eps), w["qkv"], w["qkv_bias"]).split(sizes, dim=-1)
        q, k, v = q.reshape(B, T, num_heads, D), k.reshape(B, T, Hkv, D), v.reshape(B, T, Hkv, D)
        if w["q_norm"] is not None:
            q, k = rms_norm_ref(q, w["q_norm"], eps), rms_norm_ref(k, w["k_norm"], eps)
        q, k = rope_ref(q, cos, sin), rope_ref(k, cos, sin)
        kv_cache[i, 0, blocks, offsets] = k  # [B, T, Hkv, D] at positions L_b + t
        kv_cache[i, 1, blocks, offsets] = v
        out = attend(q, kv_cache[i, 0], kv_cache[i, 1])  # [B, T, Hq, D]
        h = h + linear(out.flatten(2), w["o"], None)  # [B, T, Hq * D] (reshape(B, T, -1) fails at B = 0)
        gate, up = linear(rms_norm_ref(h, w["post_norm"], eps), w["gate_up"], None).chunk(2, dim=-1)
        h = h + linear(torch.nn.functional.silu(gate) * up, w["down"], None)
    out = rms_norm_ref(h, final_norm, eps)
    if capture is None:
        return out
    return out, torch.cat([streams[i] for i in capture], dim=-1) if capture else h.new_empty(B, T, 0)


def decoder_layers_ref(
    hidden: torch.Tensor,
    weights: list[torch.Tensor | None],
    final_norm: torch.Tensor,
    kv_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    rope: torch.Tensor,
    tree_mask: torch.Tensor,
    *,
    num_heads: int,
    eps: float,
    block_table: torch.Tensor | None = None,
    capture: list[int] | None = None,
    backend: str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """A stack of Llama-family decoder layers over T new tokens per sequence, writing their K/V into ``kv_cache``
    and attending with ``tree_attention_ref``. ``backend`` is ignored. See ``spec_kernels.decoder_layers``."""

    def attend(q, k_cache, v_cache):
        return tree_attention_ref(q, k_cache, v_cache, cache_seqlens, tree_mask, block_table=block_table)

    return decoder_layer_loop(
        hidden, weights, final_norm, kv_cache, cache_seqlens, rope, tree_mask, block_table, num_heads, eps,
        linear_ref, attend, capture,
    )  # fmt: skip


# --- quant_linear -----------------------------------------------------------------------------------------------

# GGUF block formats the quantized kernels read: ggml's type id and the bytes of one block of QUANT_BLOCK weights.
QUANT_BLOCK = 32
QUANT_TYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8}
QUANT_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}
_TYPE_NAMES = {v: k for k, v in QUANT_TYPES.items()}


def dequantize_ref(weight: torch.Tensor, qtype: str) -> torch.Tensor:
    """GGUF blocks ``uint8 [N, K / 32 * block_bytes]`` -> float32 ``[N, K]``, bit for bit gguf.quants.dequantize's
    values: Q8_0 ``q * d``; Q4_0 ``d * (q - 8)``; Q4_1 ``d * q + m`` (each product and sum rounded once). Byte j of a
    block's nibbles holds element j (low nibble) and element j + 16 (high nibble). Written into one float32 tensor in
    place: a model's whole embedding dequantizes without temporaries of its size."""
    num_rows = weight.shape[0]
    blocks = weight.reshape(num_rows, -1, QUANT_BLOCK_BYTES[qtype])  # [N, K / 32, block_bytes]
    d = blocks[..., 0:2].contiguous().view(torch.float16).float()  # [N, K / 32, 1]
    out = torch.empty(num_rows, blocks.shape[1], QUANT_BLOCK, dtype=torch.float32, device=weight.device)  # [N,K/32,32]
    if qtype == "Q8_0":
        out.copy_(blocks[..., 2:].view(torch.int8))
        return out.mul_(d).reshape(num_rows, -1)
    nibbles = blocks[..., -16:]  # [N, K / 32, 16]
    out[..., :16].copy_(nibbles & 0x0F)
    out[..., 16:].copy_(nibbles >> 4)
    if qtype == "Q4_0":
        return out.sub_(8).mul_(d).reshape(num_rows, -1)
    m = blocks[..., 2:4].contiguous().view(torch.float16).float()
    return out.mul_(d).add_(m).reshape(num_rows, -1)


def quant_linear_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    qtype: str,
    *,
    bias: torch.Tensor | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """``x @ dequantize_ref(weight, qtype).T + bias`` in float32, cast to x's dtype. ``backend`` is ignored."""
    w = dequantize_ref(weight, qtype)  # [N, K]
    out = torch.nn.functional.linear(x.float(), w, None if bias is None else bias.float())
    return out.to(x.dtype)


def quant_type_name(qtype: str | int) -> str:
    """The format's name ("Q4_1") from a name, ggml's type id or a ``gguf.GGMLQuantizationType``; ValueError for a
    format the kernels do not read."""
    if isinstance(qtype, str):
        name = qtype.upper()
        if name in QUANT_TYPES:
            return name
    elif isinstance(qtype, int) and int(qtype) in _TYPE_NAMES:
        return _TYPE_NAMES[int(qtype)]
    supported = ", ".join(QUANT_TYPES)
    shown = getattr(qtype, "name", qtype)
    raise ValueError(f"unsupported quantization type {shown!r}; the kernels read {supported}")


@dataclass(frozen=True)
class QuantizedWeight:
    """A weight matrix ``[N, K]`` kept as GGUF blocks: ``data`` uint8 ``[N, K / 32 * block_bytes]``.

    Rows are independent, so fused projections (q/k/v, gate/up) are the row concatenation of their blocks
    (:meth:`cat`). ``linear(x, qw)`` dispatches here."""

    data: torch.Tensor
    qtype: str
    shape: tuple[int, int]

    def __post_init__(self) -> None:
        qtype = quant_type_name(self.qtype)
        object.__setattr__(self, "qtype", qtype)
        num_rows, k = self.shape
        if k % QUANT_BLOCK or self.data.dtype != torch.uint8:
            raise ValueError(f"QuantizedWeight: K = {k} must be a multiple of 32 and data uint8, got {self.data.dtype}")
        expected = (num_rows, k // QUANT_BLOCK * QUANT_BLOCK_BYTES[qtype])
        if tuple(self.data.shape) != expected:
            raise ValueError(f"QuantizedWeight: {qtype} [{num_rows}, {k}] needs data {expected}, got {self.data.shape}")

    @property
    def qtype_id(self) -> int:
        return QUANT_TYPES[self.qtype]

    @property
    def device(self) -> torch.device:
        return self.data.device

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``[N, K]`` in ``dtype``: gguf's float32 values, then one rounding."""
        return dequantize_ref(self.data, self.qtype).to(dtype)

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """Dequantized float32 rows ``[..., K]`` of ``index`` (an embedding lookup that reads only those rows)."""
        picked = self.data[index.reshape(-1)]  # [R, row_bytes]
        return dequantize_ref(picked, self.qtype).reshape(*index.shape, self.shape[1])

    @staticmethod
    def cat(parts: list[QuantizedWeight]) -> QuantizedWeight:
        """Row concatenation of matrices of one format and K."""
        qtype, k = parts[0].qtype, parts[0].shape[1]
        if any(p.qtype != qtype or p.shape[1] != k for p in parts):
            raise ValueError("QuantizedWeight.cat: the parts must share qtype and K")
        data = torch.cat([p.data for p in parts]).contiguous()
        return QuantizedWeight(data, qtype, (sum(p.shape[0] for p in parts), k))
