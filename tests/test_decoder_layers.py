"""decoder_layers: the native C++ stack against the float64 reference, batch invariance, the KV it writes, errors."""

from __future__ import annotations

import math

import pytest
import torch

from spec_kernels.decoder_layers import decoder_layers
from spec_kernels.decoder_layers.ref import LAYER_FIELDS, decoder_layers_ref

# (Hq, Hkv, D, bias, qk_norm): Llama GQA, Qwen2 (bias), Qwen3 (q/k norm), D = 80 (a masked tail in every dot), MHA,
# D = 12 (not a whole number of 8-lane vectors: the attention's tail paths)
CONFIGS = {
    "llama_gqa": (4, 2, 16, False, False),
    "qwen2_bias": (4, 2, 16, True, False),
    "qwen3_qk_norm": (4, 2, 16, False, True),
    "d80_group5": (5, 1, 80, False, False),
    "mha": (2, 2, 32, False, False),
    "d12_tail": (3, 1, 12, False, False),
    "d64_group3": (6, 2, 64, False, False),
}
H, INTER, LAYERS, EPS = 48, 72, 2, 1e-5


def make_weights(Hq, Hkv, D, bias, qk_norm, seed=0):
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=0.2):
        return torch.randn(*shape, generator=g) * scale

    weights = []
    for _ in range(LAYERS):
        layer = {
            "input_norm": 1 + rnd(H),
            "qkv": rnd((Hq + 2 * Hkv) * D, H),
            "qkv_bias": rnd((Hq + 2 * Hkv) * D) if bias else None,
            "o": rnd(H, Hq * D),
            "post_norm": 1 + rnd(H),
            "gate_up": rnd(2 * INTER, H),
            "down": rnd(H, INTER),
            "q_norm": 1 + rnd(D) if qk_norm else None,
            "k_norm": 1 + rnd(D) if qk_norm else None,
        }
        weights += [layer.get(f) for f in LAYER_FIELDS]
    return weights, 1 + rnd(H)


def rope_rows(positions, D):
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    freqs = positions.float()[..., None] * inv
    emb = torch.cat((freqs, freqs), dim=-1)
    return torch.stack((emb.cos(), emb.sin()))  # [2, B, T, D]


def make_problem(Hq, Hkv, D, cache_seqlens, T, *, paged, mask="tree", seed=1):
    """Inputs for B = len(cache_seqlens) sequences with a random prefix already in the cache."""
    g = torch.Generator().manual_seed(seed)
    B = len(cache_seqlens)
    cache_seqlens = torch.tensor(cache_seqlens, dtype=torch.int32)
    capacity = max(cache_seqlens) + T
    if paged:
        block_size = 8
        per_seq = -(-capacity // block_size)
        perm = torch.randperm(B * per_seq + 3, generator=g)  # scattered blocks, a few unused
        block_table = perm[: B * per_seq].view(B, per_seq).to(torch.int32)
        kv = torch.randn(LAYERS, 2, B * per_seq + 3, block_size, Hkv, D, generator=g)
    else:
        block_table = None
        kv = torch.randn(LAYERS, 2, B, capacity + 2, Hkv, D, generator=g)
    if mask == "causal":
        tree_mask = torch.ones(T, T, dtype=torch.bool).tril().expand(B, T, T).clone()
    else:  # a tree: node i's parent is a random earlier node
        parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, T)]
        m = torch.zeros(T, T, dtype=torch.bool)
        for i in range(T):
            j = i
            while j >= 0:
                m[i, j] = True
                j = parents[j]
        tree_mask = m.expand(B, T, T).clone()
    depth = tree_mask.sum(-1) - 1  # [B, T]
    positions = cache_seqlens.long()[:, None] + depth
    hidden = torch.randn(B, T, H, generator=g)
    return hidden, kv, cache_seqlens, rope_rows(positions, D), tree_mask, block_table


def run(backend, weights, final_norm, hidden, kv, cache_seqlens, rope, mask, table, Hq, dtype=torch.float32):
    cast = [None if w is None else w.to(dtype) for w in weights]
    kv = kv.to(dtype).clone()
    out = (decoder_layers_ref if backend == "ref" else decoder_layers)(
        hidden.to(dtype), cast, final_norm.to(dtype), kv, cache_seqlens, rope.to(dtype), mask,
        num_heads=Hq, eps=EPS, block_table=table, **({} if backend == "ref" else {"backend": backend}),
    )  # fmt: skip
    return out, kv


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize(
    "cache_seqlens, T, mask", [([5], 1, "tree"), ([0, 9, 3], 5, "tree"), ([2], 26, "causal"), ([0], 4, "causal")]
)
def test_native_matches_float64_reference(name, paged, cache_seqlens, T, mask):
    Hq, Hkv, D, bias, qk_norm = CONFIGS[name]
    weights, final_norm = make_weights(Hq, Hkv, D, bias, qk_norm)
    problem = make_problem(Hq, Hkv, D, cache_seqlens, T, paged=paged, mask=mask)
    exact, exact_kv = run("ref", weights, final_norm, *problem, Hq, dtype=torch.float64)
    ref32, ref32_kv = run("ref", weights, final_norm, *problem, Hq)
    native, native_kv = run("native", weights, final_norm, *problem, Hq)
    assert native.dtype == torch.float32 and native.shape == (len(cache_seqlens), T, H)
    # measured tolerance: the native error within 2x the same-dtype torch error, plus a small floor
    err_torch = (ref32.double() - exact).abs().max().item()
    err_native = (native.double() - exact).abs().max().item()
    assert err_native <= 2 * err_torch + 1e-5, (err_native, err_torch)
    # the K/V it wrote (positions L_b .. L_b+T-1) and everything it left alone
    kv_err_torch = (ref32_kv.double() - exact_kv).abs().max().item()
    kv_err_native = (native_kv.double() - exact_kv).abs().max().item()
    assert kv_err_native <= 2 * kv_err_torch + 1e-5


@pytest.mark.parametrize("name", ["llama_gqa", "qwen2_bias", "qwen3_qk_norm", "d80_group5"])
@pytest.mark.parametrize("cache_seqlens, T, mask", [([0, 9, 3], 5, "tree"), ([2], 26, "causal")])
def test_native_bfloat16_matches_float64_reference(name, cache_seqlens, T, mask):
    """bfloat16 weights, activations and cache; the native op keeps its residual stream in float32, so it is at
    least as close to the exact result as torch's bfloat16 loop."""
    Hq, Hkv, D, bias, qk_norm = CONFIGS[name]
    weights, final_norm = make_weights(Hq, Hkv, D, bias, qk_norm)
    problem = make_problem(Hq, Hkv, D, cache_seqlens, T, paged=True, mask=mask)
    rounded = [None if w is None else w.bfloat16().double() for w in weights]  # the exact result of bf16 weights
    hidden, kv, *rest = problem
    exact, _ = run("ref", rounded, final_norm.bfloat16(), hidden.bfloat16(), kv.bfloat16(), *rest, Hq,
                   dtype=torch.float64)  # fmt: skip
    ref16, _ = run("ref", weights, final_norm, *problem, Hq, dtype=torch.bfloat16)
    native, native_kv = run("native", weights, final_norm, *problem, Hq, dtype=torch.bfloat16)
    assert native.dtype == torch.bfloat16 and native_kv.dtype == torch.bfloat16
    err_torch = (ref16.double() - exact).abs().max().item()
    err_native = (native.double() - exact).abs().max().item()
    assert err_native <= 2 * err_torch + 1e-3, (err_native, err_torch)


def test_planted_bug_is_caught():
    """The tolerance above is tight enough to see a real mistake: a RoPE at the wrong position moves the output."""
    Hq, Hkv, D, bias, qk_norm = CONFIGS["llama_gqa"]
    weights, final_norm = make_weights(Hq, Hkv, D, bias, qk_norm)
    hidden, kv, cache_seqlens, rope, mask, table = make_problem(Hq, Hkv, D, [0, 9, 3], 5, paged=True)
    exact, _ = run("ref", weights, final_norm, hidden, kv, cache_seqlens, rope, mask, table, Hq, dtype=torch.float64)
    ref32, _ = run("ref", weights, final_norm, hidden, kv, cache_seqlens, rope, mask, table, Hq)
    wrong_rope = rope_rows(cache_seqlens.long()[:, None] + torch.arange(5) + 1, D)
    buggy, _ = run("native", weights, final_norm, hidden, kv, cache_seqlens, wrong_rope, mask, table, Hq)
    err_torch = (ref32.double() - exact).abs().max().item()
    assert (buggy.double() - exact).abs().max().item() > 2 * err_torch + 1e-5


def v_apart(weights, Hq, Hkv, D, rows_of_v=None):
    """The same layers with each one's v rows held apart (LAYER_FIELDS' "v", as a GGUF file's v in a format of its
    own is); ``rows_of_v``: other rows of qkv to pass as v instead (a planted bug)."""
    n, qkv, v = len(LAYER_FIELDS), LAYER_FIELDS.index("qkv"), LAYER_FIELDS.index("v")
    apart, qk = list(weights), (Hq + Hkv) * D
    for i in range(0, len(apart), n):
        fused = weights[i + qkv]
        apart[i + qkv], apart[i + v] = fused[:qk].clone(), fused[rows_of_v or slice(qk, None)].clone()
    return apart


@pytest.mark.parametrize("name", ["llama_gqa", "qwen2_bias", "d80_group5"])
@pytest.mark.parametrize("backend", ["ref", "native"])
def test_v_rows_apart_are_the_same_layers(name, backend):
    """q/k's rows and v's apart (each with its share of the bias) are the fused q/k/v: both paths stay within the
    float64 reference's tolerance, K/V included, and v's rows passed in the wrong place do not."""
    Hq, Hkv, D, bias, qk_norm = CONFIGS[name]
    weights, final_norm = make_weights(Hq, Hkv, D, bias, qk_norm)
    problem = make_problem(Hq, Hkv, D, [0, 9, 3], 5, paged=True)
    exact, exact_kv = run("ref", weights, final_norm, *problem, Hq, dtype=torch.float64)
    ref32, ref32_kv = run("ref", weights, final_norm, *problem, Hq)
    got, got_kv = run(backend, v_apart(weights, Hq, Hkv, D), final_norm, *problem, Hq)
    assert got.shape == ref32.shape
    assert (got.double() - exact).abs().max() <= 2 * (ref32.double() - exact).abs().max() + 1e-5
    assert (got_kv.double() - exact_kv).abs().max() <= 2 * (ref32_kv.double() - exact_kv).abs().max() + 1e-5
    planted = v_apart(weights, Hq, Hkv, D, rows_of_v=slice(Hq * D, (Hq + Hkv) * D))  # k's rows as v's
    buggy, _ = run(backend, planted, final_norm, *problem, Hq)
    assert (buggy.double() - exact).abs().max() > 2 * (ref32.double() - exact).abs().max() + 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "name, cache_seqlens, T", [("d80_group5", [7, 2, 11], 4), ("llama_gqa", [20], 1), ("mha", [3], 26)]
)
def test_any_thread_count_gives_the_same_bits(name, cache_seqlens, T, dtype):
    """The stack splits each stage across its threads (matmul rows, attention heads, rows of h): 1, 2 or 3 threads
    (more than this CPU's cores: uneven shares, a descheduled worker) write the same outputs and cache, bit for bit."""
    Hq, Hkv, D, bias, qk_norm = CONFIGS[name]
    weights, final_norm = make_weights(Hq, Hkv, D, bias, qk_norm)
    problem = make_problem(Hq, Hkv, D, cache_seqlens, T, paged=True, mask="tree")
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            results.append(run("native", weights, final_norm, *problem, Hq, dtype=dtype))
    finally:
        torch.set_num_threads(threads)
    (out1, kv1), *others = results
    for out, kv in others:
        assert torch.equal(out, out1) and torch.equal(kv, kv1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize(
    "name, lengths, T",
    [("d80_group5", [7, 2, 11], 4), ("mha", [37, 2, 50], 8), ("d64_group3", [37, 2, 50], 8),
     ("d12_tail", [37, 2, 50], 8), ("mha", [9000, 2, 70], 8)],
    ids=["d80", "row_sets", "row_sets_d64", "row_sets_d12", "row_sets_cut"],
)  # fmt: skip
def test_tree_nodes_equal_plain_decoding_bitwise(paged, dtype, name, lengths, T):
    """A chain verified in one pass gives each node the hidden state plain decoding gives it, bit for bit, and
    a sequence's rows do not depend on the other sequences of the batch (what greedy speculation relies on).
    On AVX-512 a worker attends a sequence's rows at one KV head as one set, each shared key read once for all of
    them (attention_cpu.h, attends_row_sets); plain decoding's one row is a set of its own. "row_sets_d64": a set's
    24 heads summed 6 at a time; "row_sets_d12": 12-wide heads (sums through memory); "row_sets_cut": a 9,000-token
    prefix, whose scores cut a worker's 8 rows into several sets (on 1 or 2 threads, as this test runs)."""
    Hq, Hkv, D, bias, qk_norm = CONFIGS[name]
    weights, final_norm = make_weights(Hq, Hkv, D, bias, qk_norm)
    hidden, kv, cache_seqlens, _, _, table = make_problem(Hq, Hkv, D, lengths, T, paged=paged, mask="causal")
    chain = torch.ones(T, T, dtype=torch.bool).tril().expand(3, T, T).clone()
    positions = cache_seqlens.long()[:, None] + torch.arange(T)
    weights = [None if w is None else w.to(dtype) for w in weights]
    final_norm, hidden, kv = final_norm.to(dtype), hidden.to(dtype), kv.to(dtype)
    rope = rope_rows(positions, D)
    threads = torch.get_num_threads()
    torch.set_num_threads(min(threads, 2))  # (the sets a worker makes depend on the workers)
    try:
        together, _ = run("native", weights, final_norm, hidden, kv, cache_seqlens, rope, chain, table, Hq, dtype=dtype)
    finally:
        torch.set_num_threads(threads)

    one_by_one = kv.clone()
    for t in range(T):  # plain decoding: one token per step, the cache growing by one
        step_lens = cache_seqlens + t
        rope = rope_rows(positions[:, t : t + 1], D).to(dtype)
        one_mask = torch.ones(3, 1, 1, dtype=torch.bool)
        out = decoder_layers(hidden[:, t : t + 1], weights, final_norm, one_by_one, step_lens, rope, one_mask,
                             num_heads=Hq, eps=EPS, block_table=table)  # fmt: skip
        assert torch.equal(out[:, 0], together[:, t]), t

    b = 1  # alone instead of in the batch
    alone, _ = run(
        "native", weights, final_norm, hidden[b : b + 1], kv if paged else kv[:, :, b : b + 1],
        cache_seqlens[b : b + 1], rope_rows(positions[b : b + 1], D), chain[b : b + 1],
        None if table is None else table[b : b + 1], Hq, dtype,
    )  # fmt: skip
    assert torch.equal(alone[0], together[b])


def test_errors_are_clear():
    Hq, Hkv, D, bias, qk_norm = CONFIGS["llama_gqa"]
    weights, final_norm = make_weights(Hq, Hkv, D, bias, qk_norm)
    hidden, kv, cache_seqlens, rope, mask, table = make_problem(Hq, Hkv, D, [3, 4], 2, paged=True)
    kwargs = dict(num_heads=Hq, eps=EPS, block_table=table)
    with pytest.raises(ValueError, match="positions"):
        decoder_layers(hidden, weights, final_norm, kv, cache_seqlens + 100, rope, mask, **kwargs)
    bad_table = table.clone()
    bad_table[0, 0] = 10**6
    with pytest.raises(ValueError, match="not a block"):
        decoder_layers(
            hidden, weights, final_norm, kv, cache_seqlens, rope, mask, **{**kwargs, "block_table": bad_table}
        )
    with pytest.raises(ValueError, match="tensors per layer"):
        decoder_layers(hidden, weights[:-1], final_norm, kv, cache_seqlens, rope, mask, **kwargs)
    with pytest.raises(ValueError, match="qkv"):
        transposed = [w.t().contiguous() if w is weights[1] else w for w in weights]
        decoder_layers(hidden, transposed, final_norm, kv, cache_seqlens, rope, mask, **kwargs)
    with pytest.raises(ValueError, match="rope"):
        decoder_layers(hidden, weights, final_norm, kv, cache_seqlens, rope[:, :, :1], mask, **kwargs)
    with pytest.raises(ValueError, match="num_heads"):
        decoder_layers(hidden, weights, final_norm, kv, cache_seqlens, rope, mask, **{**kwargs, "num_heads": 3})
    with pytest.raises(ValueError, match="no Triton backend"):
        decoder_layers(hidden, weights, final_norm, kv, cache_seqlens, rope, mask, **kwargs, backend="triton")
    with pytest.raises(TypeError, match="float32"):
        decoder_layers(hidden.double(), weights, final_norm, kv, cache_seqlens, rope, mask, **kwargs, backend="native")


@pytest.mark.parametrize("backend, dtype", [("torch", torch.float32), ("native", torch.float32), (None, torch.float16)])
def test_empty_batch(backend, dtype):
    """B = 0 gives [0, T, H] on every path: the reference, the C++ op and the torch-op loop (float16 on CPU)."""
    Hq, Hkv, D, bias, qk_norm = CONFIGS["llama_gqa"]
    weights, final_norm = make_weights(Hq, Hkv, D, bias, qk_norm)
    hidden, kv, cache_seqlens, rope, mask, table = make_problem(Hq, Hkv, D, [3], 2, paged=True)
    weights = [None if w is None else w.to(dtype) for w in weights]
    empty = (hidden[:0].to(dtype), kv.to(dtype), cache_seqlens[:0], rope[:, :0].to(dtype), mask[:0])
    out = decoder_layers(empty[0], weights, final_norm.to(dtype), *empty[1:], num_heads=Hq, eps=EPS,
                         block_table=table[:0], backend=backend)  # fmt: skip
    assert out.shape == (0, 2, H) and out.dtype == dtype


def test_meta_takes_the_device_path_and_native_refuses_it():
    Hq, Hkv, D, bias, qk_norm = CONFIGS["qwen2_bias"]
    weights, final_norm = make_weights(Hq, Hkv, D, bias, qk_norm)
    problem = make_problem(Hq, Hkv, D, [3, 4], 2, paged=True)
    meta = lambda t: None if t is None else t.to("meta")  # noqa: E731
    hidden, kv, cache_seqlens, rope, mask, table = map(meta, problem)
    args = (hidden, [meta(w) for w in weights], meta(final_norm), kv, cache_seqlens, rope, mask)
    out = decoder_layers(*args, num_heads=Hq, eps=EPS, block_table=table)
    assert out.device.type == "meta" and out.shape == hidden.shape
    with pytest.raises(RuntimeError, match="CPU path"):
        decoder_layers(*args, num_heads=Hq, eps=EPS, block_table=table, backend="native")


def test_tree_path_equals_plain_decoding_bitwise():
    """A path through a tree whose nodes sit at scattered slots (0, 2, 4) gets plain decoding's hidden states, bit
    for bit: each row attends over the prefix and its ancestors in order, wherever the ancestors were written."""
    Hq, Hkv, D, bias, qk_norm = CONFIGS["d80_group5"]
    weights, final_norm = make_weights(Hq, Hkv, D, bias, qk_norm)
    T, parents = 5, [-1, 0, 0, 1, 2]
    hidden, kv, cache_seqlens, _, _, table = make_problem(Hq, Hkv, D, [6], T, paged=True, mask="causal")
    mask = torch.zeros(1, T, T, dtype=torch.bool)
    depth = [0] * T
    for i in range(T):
        j = i
        while j >= 0:
            mask[0, i, j] = True
            j = parents[j]
        depth[i] = 0 if parents[i] < 0 else depth[parents[i]] + 1
    positions = cache_seqlens.long()[:, None] + torch.tensor(depth)
    tree, _ = run("native", weights, final_norm, hidden, kv, cache_seqlens, rope_rows(positions, D), mask, table, Hq)
    plain = kv.clone()
    for step, node in enumerate([0, 2, 4]):
        rope = rope_rows(cache_seqlens.long()[:, None] + step, D)
        alone = torch.ones(1, 1, 1, dtype=torch.bool)
        out = decoder_layers(hidden[:, node : node + 1], weights, final_norm, plain, cache_seqlens + step, rope, alone,
                             num_heads=Hq, eps=EPS, block_table=table)  # fmt: skip
        assert torch.equal(out[0, 0], tree[0, node]), node


@pytest.mark.parametrize("backend", ["native", "torch"])
def test_capture_returns_the_streams_entering_layers(backend):
    """capture=[...] returns the residual streams entering those layers (EAGLE-3's features) from the same call:
    layer 0's is the input itself; the final hidden states are those of a call without capture, bit for bit."""
    Hq, Hkv, D, bias, qk_norm = CONFIGS["qwen2_bias"]
    weights, final_norm = make_weights(Hq, Hkv, D, bias, qk_norm)
    hidden, kv, cache_seqlens, rope, mask, table = make_problem(Hq, Hkv, D, [3, 0], 4, paged=True)
    kw = dict(num_heads=Hq, eps=EPS, block_table=table, backend=backend)
    plain = decoder_layers(hidden, weights, final_norm, kv.clone(), cache_seqlens, rope, mask, **kw)
    out, feats = decoder_layers(
        hidden, weights, final_norm, kv.clone(), cache_seqlens, rope, mask, capture=[1, 0], **kw
    )
    assert torch.equal(out, plain) and feats.shape == (2, 4, 2 * H)
    assert torch.equal(feats[..., H:], hidden)  # layer 0's input
    _, after_first = decoder_layers(
        hidden, weights, final_norm, kv.clone(), cache_seqlens, rope, mask, capture=[1], **kw
    )
    assert torch.equal(after_first, feats[..., :H]) and not torch.equal(after_first, hidden)
    with pytest.raises(ValueError, match="capture"):
        decoder_layers(hidden, weights, final_norm, kv.clone(), cache_seqlens, rope, mask, capture=[LAYERS], **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_draft_chain_equals_level_by_level(dtype):
    """The one-call greedy chain proposes what the drafter's level-by-level loop proposes (token d = argmax of
    token d-1's logits, tokens 1 .. gamma-1 run at positions L_b + d) and leaves the same K/V in the cache."""
    from spec_kernels import linear
    from spec_kernels.decoder_layers import LayerWeights, NativeModel, draft_chain

    Hq, Hkv, D, bias, qk_norm = CONFIGS["llama_gqa"]
    weights, final_norm = make_weights(Hq, Hkv, D, bias, qk_norm)
    weights = [None if w is None else w.to(dtype) for w in weights]
    g = torch.Generator().manual_seed(3)
    V, gamma = 97, 5
    embed, lm_head = (torch.randn(V, H, generator=g) * 0.5).to(dtype), (torch.randn(V, H, generator=g)).to(dtype)
    _, kv, cache_seqlens, _, _, table = make_problem(Hq, Hkv, D, [4, 0, 9], gamma, paged=True)
    kv = kv.to(dtype)
    table_len = int(cache_seqlens.max()) + gamma + 1
    rope_table = rope_rows(torch.arange(table_len)[None], D)[:, 0].to(dtype)  # [2, P, D]
    root_logits = torch.randn(3, V, generator=g)
    kw = dict(num_heads=Hq, eps=EPS, block_table=table)
    native_kv = kv.clone()
    model = NativeModel(embed, LayerWeights(weights), final_norm.to(dtype), lm_head, rope_table, Hq, EPS)
    chain = draft_chain(root_logits, model, native_kv, cache_seqlens, gamma=gamma, block_table=table)
    loop_kv, logits, expected = kv.clone(), root_logits, []
    for d in range(1, gamma + 1):
        tok = logits.float().argmax(-1)  # [B]
        expected.append(tok)
        if d == gamma:
            break
        rope, alone = rope_table[:, cache_seqlens.long() + d][:, :, None], torch.ones(3, 1, 1, dtype=torch.bool)
        hidden = decoder_layers(embed[tok][:, None], weights, final_norm.to(dtype), loop_kv, cache_seqlens + d, rope,
                                alone, **kw)  # fmt: skip
        logits = linear(hidden[:, 0], lm_head)
    assert torch.equal(chain, torch.stack(expected, dim=1))
    assert torch.equal(native_kv, loop_kv)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_plain_steps_equal_one_token_steps(dtype):
    """plain_steps (the target's plain chain in one call) emits what one-token steps emit: the roots run at L_b,
    token d = argmax of the previous forward's logits runs at L_b + d; the cache ends the same. The call ends before
    a step where some row's logits are not finite (the engine's regular step then decodes it)."""
    from spec_kernels import linear
    from spec_kernels.decoder_layers import LayerWeights, NativeModel, plain_steps

    Hq, Hkv, D, bias, qk_norm = CONFIGS["llama_gqa"]
    weights, final_norm = make_weights(Hq, Hkv, D, bias, qk_norm)
    weights, final_norm = [None if w is None else w.to(dtype) for w in weights], final_norm.to(dtype)
    g = torch.Generator().manual_seed(4)
    V, steps = 97, 4
    embed, lm_head = (torch.randn(V, H, generator=g) * 0.5).to(dtype), torch.randn(V, H, generator=g).to(dtype)
    _, kv, cache_seqlens, _, _, table = make_problem(Hq, Hkv, D, [4, 0, 9], steps, paged=True)
    kv = kv.to(dtype)
    rope_table = rope_rows(torch.arange(int(cache_seqlens.max()) + steps + 1)[None], D)[:, 0].to(dtype)  # [2, P, D]
    roots = torch.tensor([5, 60, 2])
    kw = dict(num_heads=Hq, eps=EPS, block_table=table)
    native_kv = kv.clone()
    model = NativeModel(embed, LayerWeights(weights), final_norm, lm_head, rope_table, Hq, EPS)
    run = dict(steps=steps, block_table=table)
    got = plain_steps(roots, model, native_kv, cache_seqlens, **run)
    loop_kv, tok, expected = kv.clone(), roots, []
    for d in range(steps):
        rope, alone = rope_table[:, cache_seqlens.long() + d][:, :, None], torch.ones(3, 1, 1, dtype=torch.bool)
        hidden = decoder_layers(embed[tok][:, None], weights, final_norm, loop_kv, cache_seqlens + d, rope, alone, **kw)
        tok = linear(hidden[:, 0], lm_head).float().argmax(-1)  # [B]
        expected.append(tok)
    assert torch.equal(got, torch.stack(expected, dim=1))
    assert torch.equal(native_kv, loop_kv)

    # stop ids: the call ends after the first token at which any row emits one (the prefix of the full run)
    full = got.tolist()
    stop = full[2][1]  # row 2's second token
    first = min(row.index(stop) for row in full if stop in row)
    cut = plain_steps(roots, model, kv.clone(), cache_seqlens, stop_ids=torch.tensor([V + 5, stop]), **run)
    assert first <= 1 and torch.equal(cut, got[:, : first + 1])
    never = plain_steps(roots, model, kv.clone(), cache_seqlens, stop_ids=torch.tensor([V + 5]), **run)
    assert torch.equal(never, got)

    broken = lm_head.clone()
    broken[7] = float("nan")  # every row's logits hold a NaN: no step runs
    broken_model = NativeModel(embed, model.layers, final_norm, broken, rope_table, Hq, EPS)
    bad = plain_steps(roots, broken_model, kv.clone(), cache_seqlens, **run)
    assert bad.shape == (3, 0)
    with pytest.raises(ValueError, match="token 97 is not an id"):
        plain_steps(torch.tensor([97, 0, 0]), model, kv.clone(), cache_seqlens, **run)


def _first_max(row: list[float], strict: bool) -> int:
    """greedy::argmax's contract (csrc/argmax_cpu.h), written plainly."""
    nan = any(math.isnan(v) for v in row)
    best = max((v for v in row if not math.isnan(v)), default=-math.inf)
    if strict and (nan or not math.isfinite(best)):
        return -1
    if best == -math.inf:
        return 0
    return next(i for i, v in enumerate(row) if v == best)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("strict", [False, True])
def test_greedy_argmax_on_hard_rows(dtype, strict):
    """The one greedy choice every native path shares (verify_greedy, the runners): the first index of the maximum,
    over rows of every length around the vector widths, with ties, NaNs, infinities and a maximum in the tail. A
    chain of one runs no forward: its token is the argmax of the root logits, which this feeds directly."""
    from spec_kernels.decoder_layers import LayerWeights, NativeModel, draft_chain

    Hq, Hkv, D, bias, qk_norm = CONFIGS["llama_gqa"]
    weights, final_norm = make_weights(Hq, Hkv, D, bias, qk_norm)
    weights, final_norm = [None if w is None else w.to(dtype) for w in weights], final_norm.to(dtype)
    gen = torch.Generator().manual_seed(9)
    inf, nan = float("inf"), float("nan")
    for V in (1, 7, 8, 9, 16, 17, 37, 100):
        rows = [torch.randn(V, generator=gen).tolist() for _ in range(8)]
        rows[1][V - 1] = 50.0  # the maximum in the tail
        rows[2] = [3.0] * V  # ties: the first
        rows[3][V // 2] = nan
        rows[4] = [nan] * V
        rows[5] = [-inf] * V
        rows[6][V - 1] = inf
        rows[7][0], rows[7][V - 1] = nan, 60.0
        logits = torch.tensor(rows, dtype=torch.float32).to(dtype)  # [8, V]
        embed = torch.randn(V, H, generator=gen).to(dtype)
        _, kv, cache_seqlens, _, _, table = make_problem(Hq, Hkv, D, [3] * 8, 2, paged=True)
        rope_table = rope_rows(torch.arange(8)[None], D)[:, 0].to(dtype)
        model = NativeModel(embed, LayerWeights(weights), final_norm, embed, rope_table, Hq, EPS)
        got = draft_chain(logits, model, kv.to(dtype), cache_seqlens, gamma=1, block_table=table, strict=strict)
        want = [_first_max(r, strict) for r in logits.float().tolist()]
        assert got[:, 0].tolist() == want, (V, got[:, 0].tolist(), want)
