"""tree_attention: every backend against a float64 reference, with tolerances measured as docs/ARCHITECTURE.md says.

A backend passes when ``err(backend) <= 2 * err(tree_attention_ref in the same dtype) + ATOL[dtype]``, both errors
measured against ``tree_attention_ref`` run in float64.
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch
import torch.nn.functional as F

# The Triton interpreter is chosen when kernels are decorated (at import): set it before spec_kernels loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from spec_kernels.tree_attention.ref import tree_attention_ref  # noqa: E402

ta = importlib.import_module("spec_kernels.tree_attention")  # the module; the package re-exports the function
ta_triton = importlib.import_module("spec_kernels.tree_attention.triton")
tree_attention = ta.tree_attention

# Floor for outputs that are already at the dtype's rounding limit (|out| <= ~3): a quarter ulp at 1.
ATOL = {torch.float32: 1e-6, torch.float16: 2e-4, torch.bfloat16: 2e-3}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]

# a CUDA parametrisation: `pytest -m cuda` (bench/gpu.sh) selects it; skipped where there is no GPU
CUDA = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _interpreted() -> bool:
    """True when the Triton kernels were decorated under TRITON_INTERPRET=1 (CPU tensors can run them)."""
    if not ta_triton.triton_available():
        return False
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(ta_triton._tree_attention_kernel, InterpretedFunction)


INTERPRETER = pytest.mark.skipif(
    not _interpreted(), reason="spec_kernels was imported before TRITON_INTERPRET=1 was set (set it in conftest.py)"
)


# --- inputs -----------------------------------------------------------------------------------------------------


def random_tree_mask(B: int, T: int, gen: torch.Generator) -> torch.Tensor:
    """Trees from random parents (``parents[i] < i``); the mask is the ancestor closure plus the diagonal."""
    mask = torch.zeros(B, T, T, dtype=torch.bool)
    for b in range(B):
        for i in range(T):
            if i > 0:
                parent = int(torch.randint(0, i, (1,), generator=gen))
                mask[b, i] = mask[b, parent]
            mask[b, i, i] = True
    return mask


def causal_mask(B: int, T: int) -> torch.Tensor:
    return torch.tril(torch.ones(T, T, dtype=torch.bool)).expand(B, T, T).clone()


def make_inputs(
    cache_seqlens: list[int],
    T: int,
    Hq: int,
    Hkv: int,
    D: int,
    dtype: torch.dtype,
    *,
    block_size: int | None = None,
    mask: torch.Tensor | None = None,
    seed: int = 0,
):
    """Random q and cache. Slots past ``L_b + T`` hold large garbage, so reading them would show. With
    ``block_size``, the cache is paged through a shuffled block table holding the same logical contents."""
    gen = torch.Generator().manual_seed(seed)
    B = len(cache_seqlens)
    S = max(cache_seqlens) + T + 5
    q = torch.randn(B, T, Hq, D, generator=gen).to(dtype)
    k = torch.randn(B, S, Hkv, D, generator=gen)
    v = torch.randn(B, S, Hkv, D, generator=gen)
    for b, length in enumerate(cache_seqlens):
        k[b, length + T :] = 1e3
        v[b, length + T :] = 1e3
    k, v = k.to(dtype), v.to(dtype)
    cache_seqlens = torch.tensor(cache_seqlens, dtype=torch.int32)
    if mask is None:
        mask = random_tree_mask(B, T, gen)
    if block_size is None:
        return q, k, v, cache_seqlens, mask, None
    max_blocks = -(-S // block_size)
    num_blocks = B * max_blocks + 3
    block_table = torch.randperm(num_blocks, generator=gen)[: B * max_blocks].view(B, max_blocks).int()
    k_paged = torch.full((num_blocks, block_size, Hkv, D), 1e3, dtype=dtype)
    v_paged = k_paged.clone()
    pos = torch.arange(max_blocks * block_size)
    valid = pos < S
    for b in range(B):
        blocks, offsets = block_table[b, pos // block_size].long(), pos % block_size
        k_paged[blocks[valid], offsets[valid]] = k[b]
        v_paged[blocks[valid], offsets[valid]] = v[b]
    return q, k_paged, v_paged, cache_seqlens, mask, block_table


def check_against_fp64(out: torch.Tensor, q, k, v, cache_seqlens, mask, block_table, scale=None, **variant) -> None:
    """Measured tolerances (docs/ARCHITECTURE.md): ``err(out) <= 2 * err(same-dtype torch) + ATOL``, errors vs a
    float64 reference. ``variant``: softcap / window, as the op takes them."""
    exact = tree_attention_ref(
        q.double(), k.double(), v.double(), cache_seqlens, mask, block_table=block_table, softmax_scale=scale,
        **variant,
    )  # fmt: skip
    same_dtype = tree_attention_ref(q, k, v, cache_seqlens, mask, block_table=block_table, softmax_scale=scale,
                                    **variant)  # fmt: skip
    assert out.dtype == q.dtype and out.shape == q.shape
    assert torch.isfinite(out).all()
    err = (out.double() - exact).abs().max().item()
    err_torch = (same_dtype.double() - exact).abs().max().item()
    assert err <= 2 * err_torch + ATOL[q.dtype], f"err {err:.3g} vs torch {err_torch:.3g} ({q.dtype})"


# --- native CPU path (the default on CPU) ----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("D", [64, 80, 128])
@pytest.mark.parametrize("paged", [False, True])
def test_native_matches_reference(dtype, group, D, paged):
    # ragged lengths, including 0; random trees with T=7
    inputs = make_inputs([0, 37, 90], 7, 2 * group, 2, D, dtype, block_size=16 if paged else None, seed=D + group)
    check_against_fp64(tree_attention(*inputs[:5], block_table=inputs[5]), *inputs)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("paged", [False, True])
def test_native_t64_equal_lengths(dtype, paged):
    inputs = make_inputs([300, 300], 64, 8, 2, 64, dtype, block_size=32 if paged else None, seed=1)
    check_against_fp64(tree_attention(*inputs[:5], block_table=inputs[5]), *inputs)


@pytest.mark.parametrize("dtype", DTYPES)
def test_empty_prefix(dtype):
    inputs = make_inputs([0, 0], 9, 4, 4, 64, dtype, seed=2)
    check_against_fp64(tree_attention(*inputs[:5]), *inputs)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("paged", [False, True])
def test_t1_is_decode_attention(dtype, paged):
    """T=1 is plain decode attention over the prefix plus the new token (SDPA on repeated K/V)."""
    q, k, v, cache_seqlens, mask, table = make_inputs([5, 64, 33], 1, 8, 2, 80, dtype, block_size=8 if paged else None)
    out = tree_attention(q, k, v, cache_seqlens, mask, block_table=table)
    check_against_fp64(out, q, k, v, cache_seqlens, mask, table)
    dense = make_inputs([5, 64, 33], 1, 8, 2, 80, dtype)  # same seed: the same logical contents, contiguous
    for b, length in enumerate(cache_seqlens.tolist()):
        keys = dense[1][b, : length + 1].double().repeat_interleave(4, dim=1).transpose(0, 1)  # [Hq, L+1, D]
        values = dense[2][b, : length + 1].double().repeat_interleave(4, dim=1).transpose(0, 1)
        expected = F.scaled_dot_product_attention(q[b].double().transpose(0, 1), keys, values)  # [Hq, 1, D]
        tol = 2 * ATOL[dtype] + (4e-3 if dtype == torch.bfloat16 else 5e-4 if dtype == torch.float16 else 0)
        torch.testing.assert_close(out[b].double(), expected.transpose(0, 1), atol=tol, rtol=0)


def test_causal_prefill_large_t():
    """Prefill: a causal mask over a long chunk, ragged with one empty prefix, on the native path."""
    inputs = make_inputs([0, 50], 300, 8, 2, 64, torch.float32, mask=causal_mask(2, 300), seed=3)
    check_against_fp64(tree_attention(*inputs[:5]), *inputs)


def test_softmax_scale():
    inputs = make_inputs([20, 3], 5, 4, 2, 64, torch.float32, seed=4)
    check_against_fp64(tree_attention(*inputs[:5], softmax_scale=0.3), *inputs, scale=0.3)


BACKENDS = ["torch", "native", pytest.param("triton", marks=INTERPRETER)]


VARIANTS = [{"softcap": 2.0}, {"window": 7}, {"window": 1}, {"softcap": 5.0, "window": 20}]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", VARIANTS, ids=str)
@pytest.mark.parametrize("paged", [False, True])
def test_softcap_and_window(backend, dtype, variant, paged):
    """Gemma's attention: soft-capped scores and a sliding window, on trees over ragged prefixes (a window shorter
    than the prefix, and one reaching into it), on every backend."""
    inputs = make_inputs([30, 4, 0], 6, 4, 2, 24, dtype, block_size=8 if paged else None, seed=11)
    out = tree_attention(*inputs[:5], block_table=inputs[5], backend=backend, **variant)
    check_against_fp64(out, *inputs, **variant)


def test_softcap_and_window_mean_what_they_say():
    """The reference's semantics, against HF's: a window of 1 sees only the node itself; a window past every
    position, or a cap far above every score, changes nothing; a node at L_b + depth sees prefix positions
    > L_b + depth - window; the cap is tanh's."""
    q, k, v, cache_seqlens, mask, _ = make_inputs([12, 5], 5, 4, 2, 16, torch.float64, seed=3)
    plain = tree_attention_ref(q, k, v, cache_seqlens, mask)
    assert torch.equal(tree_attention_ref(q, k, v, cache_seqlens, mask, window=100), plain)
    torch.testing.assert_close(tree_attention_ref(q, k, v, cache_seqlens, mask, softcap=1e6), plain)
    alone = tree_attention_ref(q, k, v, cache_seqlens, mask, window=1)  # [B, T, Hq, D]
    for b, L in enumerate(cache_seqlens.tolist()):
        torch.testing.assert_close(alone[b], v[b, L : L + 5].repeat_interleave(2, dim=1))
    # row 0 of sequence 0 (the root, depth 0, at position 12) with window 3 sees positions 10, 11 and itself
    keys = torch.tensor([10, 11, 12])
    scores = torch.einsum("hd,shd->hs", q[0, 0], k[0, keys].repeat_interleave(2, dim=1)) * 16**-0.5
    want = torch.einsum("hs,shd->hd", torch.softmax(torch.tanh(scores / 0.5) * 0.5, -1),
                        v[0, keys].repeat_interleave(2, dim=1))  # fmt: skip
    torch.testing.assert_close(tree_attention_ref(q, k, v, cache_seqlens, mask, window=3, softcap=0.5)[0, 0], want)
    for bad in ({"softcap": 0.0}, {"window": 0}, {"window": 2.5}):
        with pytest.raises(ValueError, match="softcap|window"):
            tree_attention(q.float(), k.float(), v.float(), cache_seqlens, mask, **bad)


@pytest.mark.parametrize("backend", BACKENDS)
def test_padding_rows_no_nan(backend):
    """Padding rows see only themselves; a row that sees nothing (L_b = 0, empty mask row) gives zeros."""
    q, k, v, cache_seqlens, mask, _ = make_inputs([0, 12], 4, 4, 2, 16, torch.float32, seed=5)
    mask[:, 2:] = torch.eye(4, dtype=torch.bool)[2:]  # padding rows: diagonal only
    mask[0, 3] = False  # sees nothing at all
    out = tree_attention(q, k, v, cache_seqlens, mask, backend=backend)
    assert torch.isfinite(out).all()
    assert (out[0, 3] == 0).all()
    check_against_fp64(out, q, k, v, cache_seqlens, mask, None)
    # a diagonal-only row with L_b = 0 is exactly its own value vector
    torch.testing.assert_close(out[0, 2], v[0, 2].repeat_interleave(2, dim=0))


@pytest.mark.parametrize("ragged", ["auto", "batched", "loop"])
def test_stale_nan_slots_are_not_read(ragged):
    q, k, v, cache_seqlens, mask, _ = make_inputs([3, 30], 4, 4, 2, 16, torch.float32, seed=6)
    k[0, 3 + 4 :] = float("nan")
    v[0, 3 + 4 :] = float("nan")
    plan = ta._native_plan(k, cache_seqlens, mask, None, 2, ragged)
    assert torch.isfinite(ta._native_tree_attention(q, k, v, plan, 0.25)).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("paged", [False, True])
def test_native_ragged_batched_and_looped_agree(dtype, paged):
    """Ragged lengths: one padded SDPA call and one call per sequence both match the fp64 reference."""
    inputs = make_inputs([0, 5, 61, 33], 6, 6, 2, 48, dtype, block_size=8 if paged else None, seed=11)
    q, k, v, cache_seqlens, mask, table = inputs
    for ragged in ("batched", "loop"):
        plan = ta._native_plan(k, cache_seqlens, mask, table, 3, ragged)
        assert len(plan.calls) == (1 if ragged == "batched" else 4)
        check_against_fp64(ta._native_tree_attention(q, k, v, plan, 48**-0.5), *inputs)


def test_native_ragged_auto_picks_by_padded_size():
    q, k, v, cache_seqlens, mask, _ = make_inputs([4, 20, 9], 2, 4, 2, 16, torch.float32, seed=12)
    assert [c.seqs for c in ta._native_plan(k, cache_seqlens, mask, None, 2).calls] == [slice(0, 3)]  # one batched call
    padded = 3 * 22 * 2 * 16  # B * (max L_b + T) * Hkv * D
    calls = ta._native_plan(k, cache_seqlens, mask, None, 2, max_batched_elements=padded - 1).calls  # no longer fits
    assert [c.seqs for c in calls] == [slice(b, b + 1) for b in range(3)]


@pytest.mark.parametrize("paged", [False, True])
def test_plan_shared_across_calls(paged):
    """One plan serves every call with the same lengths, mask and table (two "layers" with different q, K, V)."""
    layers = [make_inputs([0, 17, 40], 5, 4, 2, 32, torch.float32, block_size=8 if paged else None, seed=s)
              for s in (20, 21)]  # fmt: skip
    cache_seqlens, mask, table = layers[0][3:]
    plan = ta.plan_tree_attention(layers[0][1], cache_seqlens, mask, num_q_heads=4, block_table=table)
    assert isinstance(plan, ta.TreeAttentionPlan)
    for q, k, v, *_ in layers:
        out = tree_attention(q, k, v, cache_seqlens, mask, block_table=table, plan=plan)
        torch.testing.assert_close(out, tree_attention(q, k, v, cache_seqlens, mask, block_table=table), rtol=0, atol=0)
        check_against_fp64(out, q, k, v, cache_seqlens, mask, table)
    q, k, v = layers[0][:3]
    with pytest.raises(ValueError, match="plan was made for another path or other shapes"):
        tree_attention(q[:, :4], k, v, cache_seqlens, mask[:, :4, :4], block_table=table, plan=plan)
    with pytest.raises(ValueError, match="takes the triton path"):  # a native plan handed to the Triton path
        tree_attention(q, k, v, cache_seqlens, mask, block_table=table, plan=plan, backend="triton")
    assert ta.plan_tree_attention(k, cache_seqlens, mask, num_q_heads=4, block_table=table, backend="torch") is None
    with pytest.raises(ValueError, match="block_table too short|cache too short"):
        ta.plan_tree_attention(k, cache_seqlens + 10**6, mask, num_q_heads=4, block_table=table)


# --- Triton kernel ----------------------------------------------------------------------------------------------


TRITON_CASES = [
    # (cache_seqlens, T, D, block_size)
    ([0, 40], 6, 16, None),
    ([17, 3], 1, 24, None),
    ([33, 0], 5, 24, 8),
    ([9, 26], 6, 16, 16),
]


@INTERPRETER
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", TRITON_CASES, ids=str)
def test_triton_interpreter(dtype, case):
    cache_seqlens, T, D, block_size = case
    inputs = make_inputs(cache_seqlens, T, 4, 2, D, dtype, block_size=block_size, seed=T + D)
    check_against_fp64(tree_attention(*inputs[:5], block_table=inputs[5], backend="triton"), *inputs)


@INTERPRETER
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("paged", [False, True])
def test_triton_split_prefix(dtype, paged):
    """Flash-decoding: 3 prefix splits (one empty for the short sequence) merged by log-sum-exp."""
    q, k, v, cache_seqlens, mask, table = make_inputs([70, 2], 3, 8, 2, 16, dtype, block_size=16 if paged else None)
    plan = ta_triton._device_plan(k, cache_seqlens, mask, table, 4)
    out = torch.ops.spec_kernels.tree_attention_triton(q, k, v, plan.cache_seqlens, plan.tree_keys, plan.tree_lens,
                                                       plan.tile_shared, plan.tile_lens, plan.block_table, 16**-0.5,
                                                       3)  # fmt: skip
    check_against_fp64(out, q, k, v, cache_seqlens, mask, table)
    # a window leaves the early splits with nothing to see (their log-sum-exp -inf, merged with weight 0)
    variant = {"softcap": 4.0, "window": 9}
    out = torch.ops.spec_kernels.tree_attention_triton(q, k, v, plan.cache_seqlens, plan.tree_keys, plan.tree_lens,
                                                       plan.tile_shared, plan.tile_lens, plan.block_table, 16**-0.5,
                                                       3, *variant.values())  # fmt: skip
    check_against_fp64(out, q, k, v, cache_seqlens, mask, table, **variant)


@INTERPRETER
def test_triton_gqa_8_and_multiword_mask():
    """Group of 8 heads per KV head, and T=70 nodes (a node's keys span two tiles of the tree part)."""
    inputs = make_inputs([4], 70, 8, 1, 16, torch.float16, seed=7)
    check_against_fp64(tree_attention(*inputs[:5], backend="triton"), *inputs)


@INTERPRETER
@pytest.mark.parametrize("paged", [False, True])
def test_triton_plan_shared_across_calls(paged):
    """The Triton path's plan (int32 lengths, packed mask, the length check once) serves every layer's call with
    the same result as an unplanned call."""
    layers = [make_inputs([0, 17, 40], 5, 4, 2, 32, torch.float32, block_size=8 if paged else None, seed=s)
              for s in (22, 23)]  # fmt: skip
    cache_seqlens, mask, table = layers[0][3:]
    plan = ta.plan_tree_attention(layers[0][1], cache_seqlens, mask, num_q_heads=4, block_table=table, backend="triton")
    assert isinstance(plan, ta.DevicePlan) and plan.tree_keys.dtype == torch.int32
    for q, k, v, *_ in layers:
        out = tree_attention(q, k, v, cache_seqlens, mask, block_table=table, plan=plan, backend="triton")
        unplanned = tree_attention(q, k, v, cache_seqlens, mask, block_table=table, backend="triton")
        torch.testing.assert_close(out, unplanned, rtol=0, atol=0)
        check_against_fp64(out, q, k, v, cache_seqlens, mask, table)
    q, k, v = layers[0][:3]
    with pytest.raises(ValueError, match="plan was made for another path or other shapes"):
        tree_attention(q[:, :4], k, v, cache_seqlens, mask[:, :4, :4], block_table=table, plan=plan, backend="triton")


def _lone_token_outputs(q, k, v, cache_seqlens, mask, backend="triton", **variant) -> torch.Tensor:
    """Plain decoding's view of each tree node: a 1-node call (batch of one) over a cache holding the node's own
    sequence (the prefix, then the tree nodes it sees in node order, itself last)."""
    out = torch.empty_like(q)
    for b in range(q.shape[0]):
        L = int(cache_seqlens[b])
        for t in range(q.shape[1]):
            keys = torch.cat([torch.arange(L), L + torch.nonzero(mask[b, t]).flatten()])
            out[b, t] = tree_attention(
                q[b : b + 1, t : t + 1], k[b : b + 1, keys], v[b : b + 1, keys],
                torch.tensor([len(keys) - 1], dtype=torch.int32), torch.ones(1, 1, 1, dtype=torch.bool),
                backend=backend, **variant,
            )[0, 0]  # fmt: skip
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("variant", [{}, {"window": 6}, {"softcap": 3.0}], ids=str)
def test_native_16bit_tree_nodes_equal_lone_tokens_bitwise(dtype, variant):
    """Batch invariance of the native path in 16-bit dtypes (where greedy speculation must equal plain decoding):
    reduced in float64, every tree node's output is bit for bit a lone token's at the same position, whatever T and
    the batch, windowed and soft-capped too."""
    q, k, v, cache_seqlens, mask, _ = make_inputs([37, 130, 0], 9, 6, 2, 32, dtype, seed=5)
    mask[1] = causal_mask(1, 9)[0]
    verify = tree_attention(q, k, v, cache_seqlens, mask, backend="native", **variant)
    check_against_fp64(verify, q, k, v, cache_seqlens, mask, None, **variant)
    assert torch.equal(verify, _lone_token_outputs(q, k, v, cache_seqlens, mask, "native", **variant))


@INTERPRETER
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["trees", "causal", "mixed"])
def test_triton_tree_nodes_equal_lone_tokens_bitwise(dtype, kind, monkeypatch):
    """Batch invariance, the contract greedy speculation in 16-bit dtypes relies on: every tree node's output is bit
    for bit plain decoding's for the same token at the same position, whatever T, the batch or the cache capacity,
    with sequences that cross tiles and flash-decoding splits (SPLIT_LEN cut to 64 positions here, and the combine
    merging 2 splits at a time: one call's rows merge 3, a lone token's 1 to 3). Group 3: a tile
    holds 5 nodes, which walk their sequences in turn (trees) or together (causal chunks, chains: one K/V tile load
    for all), or each as its sequence asks ("mixed": one causal sequence in a batch of trees). A planted bug (split
    lengths that follow the capacity, as flash-decoding's usually do) is caught in float32."""
    monkeypatch.setattr(ta_triton, "SPLIT_LEN", 64)
    monkeypatch.setattr(ta_triton, "MAX_SPLITS", 2)
    q, k, v, cache_seqlens, mask, _ = make_inputs([37, 130, 0], 9, 6, 2, 32, dtype, seed=5)
    if kind != "trees":
        mask[1] = causal_mask(1, 9)[0]
    if kind == "causal":
        mask[:] = causal_mask(3, 9)
    plan = ta_triton._device_plan(k, cache_seqlens, mask, None, 3)
    assert plan.tile_shared[1].all() == (kind != "trees") and plan.tile_shared.all() == (kind == "causal")
    verify = tree_attention(q, k, v, cache_seqlens, mask, backend="triton")
    check_against_fp64(verify, q, k, v, cache_seqlens, mask, None)
    assert torch.equal(verify, _lone_token_outputs(q, k, v, cache_seqlens, mask))

    if dtype != torch.float32:
        return  # a case this small rounds the planted bug's fp32 differences away in bfloat16 outputs
    # planted: split lengths of 1 or 2 tiles by the capacity's parity (flash-decoding usually splits by capacity)
    monkeypatch.setattr(ta_triton, "_split_len", lambda capacity, block_n, n: block_n * (1 + capacity % 2))
    planted = tree_attention(q, k, v, cache_seqlens, mask, backend="triton")
    assert not torch.equal(planted, _lone_token_outputs(q, k, v, cache_seqlens, mask))


@INTERPRETER
def test_triton_empty_batch():
    q, k = torch.zeros(0, 3, 4, 16), torch.zeros(0, 8, 2, 16)
    for backend in ("triton", "native"):
        out = tree_attention(q, k, k, torch.zeros(0, dtype=torch.int32), torch.zeros(0, 3, 3, dtype=torch.bool),
                             backend=backend)  # fmt: skip
        assert out.shape == (0, 3, 4, 16)


def test_tree_key_lists():
    """Each node's list: the nodes its mask row allows, in node order (the ancestors from the root, itself last)."""
    mask = random_tree_mask(2, 70, torch.Generator().manual_seed(8))
    keys, lens = ta_triton.tree_key_lists(mask)  # [2, 70, 70], [2, 70]
    for b in range(2):
        for t in range(70):
            seen = torch.nonzero(mask[b, t]).flatten()
            assert lens[b, t] == len(seen) and torch.equal(keys[b, t, : len(seen)].long(), seen)


def test_fake_tensor_shape():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k = torch.empty(2, 3, 8, 80, dtype=torch.bfloat16), torch.empty(2, 9, 2, 80, dtype=torch.bfloat16)
        out = torch.ops.spec_kernels.tree_attention_triton(
            q,
            k,
            k,
            torch.zeros(2, dtype=torch.int32),
            torch.zeros(2, 3, 3, dtype=torch.int32),
            torch.ones(2, 3, dtype=torch.int32),
            torch.ones(2, 1, dtype=torch.int32),
            torch.ones(2, 1, dtype=torch.int32),
            None,
            0.1,
            0,
        )
    assert out.shape == (2, 3, 8, 80) and out.dtype == torch.bfloat16


@pytest.mark.parametrize(
    "dtype",
    [pytest.param(d, marks=CUDA) for d in DTYPES],
)
@pytest.mark.parametrize("paged", [False, True])
def test_triton_cuda(dtype, paged):
    inputs = make_inputs([0, 130, 1000], 64, 32, 8, 128, dtype, block_size=16 if paged else None)
    inputs = tuple(x.cuda() if x is not None else None for x in inputs)
    out = tree_attention(*inputs[:5], block_table=inputs[5])
    check_against_fp64(out.cpu(), *(x.cpu() if x is not None else None for x in inputs))


# --- bad input --------------------------------------------------------------------------------------------------


def _valid():
    return make_inputs([4, 6], 3, 4, 2, 16, torch.float32)


@pytest.mark.parametrize(
    "mutate, error, match",
    [
        (
            lambda a: {
                **a,
                "k_cache": a["k_cache"][:, :, :1].expand(-1, -1, 3, -1),
                "v_cache": a["v_cache"][:, :, :1].expand(-1, -1, 3, -1),
            },
            ValueError,
            "multiple of Hkv",
        ),
        (lambda a: {**a, "k_cache": a["k_cache"].half()}, TypeError, "share a dtype"),
        (lambda a: {**a, "q": a["q"].double()}, TypeError, "float32, float16 or bfloat16"),
        (lambda a: {**a, "tree_mask": a["tree_mask"].int()}, TypeError, "tree_mask must be bool"),
        (lambda a: {**a, "tree_mask": a["tree_mask"][:, :2]}, ValueError, r"tree_mask must be \[B, T, T\]"),
        (lambda a: {**a, "cache_seqlens": a["cache_seqlens"].float()}, TypeError, "cache_seqlens"),
        (lambda a: {**a, "cache_seqlens": torch.tensor([4, 12], dtype=torch.int32)}, ValueError, "too short"),
        (lambda a: {**a, "cache_seqlens": torch.tensor([-1, 2], dtype=torch.int32)}, ValueError, ">= 0"),
        (lambda a: {**a, "block_table": torch.zeros(2, 1, dtype=torch.int32)}, ValueError, "block_table too short"),
        (lambda a: {**a, "block_table": torch.zeros(2, 9, dtype=torch.float32)}, TypeError, "block_table"),
        (lambda a: {**a, "tree_mask": a["tree_mask"].to("meta")}, ValueError, "one device"),
        (lambda a: {**a, "v_cache": a["v_cache"][:, :-1]}, ValueError, "same 4-d shape"),
        (lambda a: {**a, "backend": "cuda"}, ValueError, "unknown backend"),
    ],
)
def test_bad_input(mutate, error, match):
    q, k, v, cache_seqlens, mask, _ = _valid()
    args = {"q": q, "k_cache": k, "v_cache": v, "cache_seqlens": cache_seqlens, "tree_mask": mask}
    args = mutate(args)
    if "block_table" in args and args["block_table"] is not None and args["block_table"].dtype == torch.int32:
        # paged layout: a cache of 4 blocks of 4 slots, too few for L_b + T through a 1-block table
        args["k_cache"], args["v_cache"] = torch.zeros(4, 4, 2, 16), torch.zeros(4, 4, 2, 16)
    with pytest.raises(error, match=match):
        tree_attention(**args)


def test_head_dim_too_large():
    q, k, v, cache_seqlens, mask, _ = make_inputs([2], 1, 2, 1, 272, torch.float32)
    with pytest.raises(ValueError, match="exceeds"):
        tree_attention(q, k, v, cache_seqlens, mask)


def test_triton_needs_interpreter_on_cpu(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q, k, v, cache_seqlens, mask, _ = _valid()
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        tree_attention(q, k, v, cache_seqlens, mask, backend="triton")
