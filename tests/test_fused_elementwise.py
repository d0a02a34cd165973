"""Tests of spec_kernels.fused_elementwise: the Triton kernels (under TRITON_INTERPRET=1 here, on CUDA in bench/gpu.sh)
against their references and a float64 one, batch invariance bit for bit, and the device layer loop running them.

Tolerances are measured: err(kernel) <= 2 * err(torch, same dtype) + ATOL[dtype], both against float64. RoPE has no
reduction and no transcendental function: in 16-bit dtypes it equals the reference bit for bit (each product and the
sum rounded where torch's ops round). Batch invariance is exact: row i of an M-row call is the 1-row call's.
"""

from __future__ import annotations

import functools
import importlib

import pytest
import torch
import torch.nn.functional as F

from spec_kernels.decoder_layers.ref import LAYER_FIELDS, decoder_layer_loop
from spec_kernels.fused_elementwise import DEVICE_OPS, ElementwiseOps, add_rms_norm, layer_ops, rope_qk, silu_mul
from spec_kernels.fused_elementwise.ref import REFERENCE_OPS, add_rms_norm_ref, rope_qk_ref, silu_mul_ref
from spec_kernels.linear.ref import linear_ref
from spec_kernels.tree_attention.ref import tree_attention_ref

pytest.importorskip("triton")
fe_triton = importlib.import_module("spec_kernels.fused_elementwise.triton")

CUDA = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _interpreted() -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(fe_triton._add_rms_norm_kernel, InterpretedFunction)


INTERPRETED = pytest.mark.skipif(not _interpreted(), reason="needs Triton's interpreter (TRITON_INTERPRET=1)")
DEVICES = [pytest.param("cpu", marks=INTERPRETED), pytest.param("cuda", marks=CUDA)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Slack on top of 2x torch's own error: float32 sums of squares in another order (~1 ulp of the output); in 16-bit
# dtypes both errors are the output's rounding and the slack is 0.
ATOL = {torch.float32: 1e-6, torch.float16: 0.0, torch.bfloat16: 0.0}
EPS = 1e-5


def _err(out: torch.Tensor, ref64: torch.Tensor) -> float:
    return (out.double() - ref64).abs().max().item()


def _norm_inputs(num_rows: int, n: int, dtype: torch.dtype, device: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed + n)
    x = torch.randn(num_rows, n, generator=g)
    residual = torch.randn(num_rows, n, generator=g) * 3
    weight = torch.rand(n, generator=g) + 0.5
    return x.to(device, dtype), residual.to(device, dtype), weight.to(device, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [576, 80, 5000])  # SmolLM2's hidden size, a head's D, two tiles (MAX_ROW_TILE 4096)
def test_add_rms_norm_matches_reference(device, dtype, n):
    x, residual, weight = _norm_inputs(23, n, dtype, device)
    out, h = add_rms_norm(x, residual, weight, EPS, backend="triton")
    want_out, want_h = add_rms_norm_ref(x, residual, weight, EPS)
    assert out.dtype == want_out.dtype and h.dtype == dtype
    assert torch.equal(h, want_h)  # the residual add is exact: one rounding, as torch's
    h64 = h.double()
    ref64 = F.rms_norm(h64, (n,), eps=EPS) * weight.double()
    assert _err(out, ref64) <= 2 * _err(want_out, ref64) + ATOL[dtype]
    alone, same = add_rms_norm(x, None, weight, EPS, backend="triton")
    assert same is x
    ref64 = F.rms_norm(x.double(), (n,), eps=EPS) * weight.double()
    assert _err(alone, ref64) <= 2 * _err(add_rms_norm_ref(x, None, weight, EPS)[0], ref64) + ATOL[dtype]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_float32_weight(device, dtype):
    """Gemma-style float32 weights on 16-bit rows: the product in float32, as the reference promotes it."""
    x, residual, _ = _norm_inputs(5, 96, dtype, device)
    weight = torch.rand(96, generator=torch.Generator().manual_seed(1)).to(device) + 0.5
    out, _ = add_rms_norm(x, residual, weight, EPS, backend="triton")
    want, _ = add_rms_norm_ref(x, residual, weight, EPS)
    assert out.dtype == want.dtype == torch.float32
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [576, 5000])
def test_add_rms_norm_is_batch_invariant(device, dtype, n):
    """Row i of an M-row call is bitwise the 1-row call's and any slice's, with and without the residual."""
    x, residual, weight = _norm_inputs(64, n, dtype, device, seed=7)
    out, h = add_rms_norm(x, residual, weight, EPS, backend="triton")
    for rows in (slice(0, 1), slice(3, 8), slice(17, 64)):
        part, part_h = add_rms_norm(x[rows], residual[rows], weight, EPS, backend="triton")
        assert torch.equal(part, out[rows]) and torch.equal(part_h, h[rows])
    for i in (0, 31, 63):
        assert torch.equal(
            add_rms_norm(x[i : i + 1], residual[i : i + 1], weight, EPS, backend="triton")[0], out[i : i + 1]
        )
        assert torch.equal(add_rms_norm(x[i : i + 1], None, weight, EPS, backend="triton")[0],
                           add_rms_norm(x, None, weight, EPS, backend="triton")[0][i : i + 1])  # fmt: skip


@INTERPRETED
def test_planted_tile_by_row_count_is_caught(monkeypatch):
    """The invariance check has teeth: a norm whose reduction tile changes with the number of rows (as a split chosen
    by shape would) parts a row from its 1-row call."""
    g = torch.Generator().manual_seed(3)
    # rows whose squares span a wide range (one large value, the rest near 2): any other order of the sum shows
    x = torch.cat([torch.full((8, 1), 1e4), 1.9 + torch.rand(8, 575, generator=g) / 100], dim=1)
    residual, weight = torch.randn(8, 576, generator=g) / 100, torch.rand(576, generator=g) + 0.5
    out, _ = add_rms_norm(x, residual, weight, EPS, backend="triton")  # one tile of 1024 columns
    monkeypatch.setattr(fe_triton, "row_tile", lambda n: 64)  # the planted bug: the 1-row calls reduce by 64
    alone = [add_rms_norm(x[i : i + 1], residual[i : i + 1], weight, EPS, backend="triton")[0] for i in range(8)]
    assert not all(torch.equal(a, out[i : i + 1]) for i, a in enumerate(alone))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1536, 111])
def test_silu_mul_matches_reference_and_is_batch_invariant(device, dtype, n):
    g = torch.Generator().manual_seed(n)
    gate_up = (torch.randn(3, 7, 2 * n, generator=g) * 3).to(device, dtype)
    out = silu_mul(gate_up, backend="triton")  # [3, 7, n]
    assert out.shape == (3, 7, n) and out.dtype == dtype
    gate, up = gate_up.double().chunk(2, dim=-1)
    ref64 = F.silu(gate) * up
    assert _err(out, ref64) <= 2 * _err(silu_mul_ref(gate_up), ref64) + ATOL[dtype]
    assert torch.equal(silu_mul(gate_up[1:2, 4:5], backend="triton"), out[1:2, 4:5])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (8, 2, 128), (7, 1, 80)])  # SmolLM2, Llama-3-8B, Qwen-like
def test_rope_qk_matches_reference(device, dtype, hq, hkv, d):
    """q and k as views of one qkv row (read in place); 16-bit outputs are the reference's bit for bit."""
    g = torch.Generator().manual_seed(d)
    B, T = 2, 5
    qkv = torch.randn(B, T, (hq + 2 * hkv) * d, generator=g).to(device, dtype)
    q = qkv[..., : hq * d].reshape(B, T, hq, d)
    k = qkv[..., hq * d : (hq + hkv) * d].reshape(B, T, hkv, d)
    angles = torch.rand(B, T, d // 2, generator=g).repeat(1, 1, 2) * 6
    cos, sin = angles.cos().to(device, dtype), angles.sin().to(device, dtype)
    got_q, got_k = rope_qk(q, k, cos, sin, backend="triton")
    want_q, want_k = rope_qk_ref(q, k, cos, sin)
    assert got_q.is_contiguous() and got_k.shape == k.shape
    if dtype == torch.float32:  # (a GPU may contract a product and the sum into one FMA)
        torch.testing.assert_close((got_q, got_k), (want_q, want_k), rtol=1e-6, atol=1e-6)
    else:
        assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    one_q, one_k = rope_qk(q[1:, 3:4], k[1:, 3:4], cos[1:, 3:4], sin[1:, 3:4], backend="triton")
    assert torch.equal(one_q, got_q[1:, 3:4]) and torch.equal(one_k, got_k[1:, 3:4])


def test_dispatch_meta_and_cpu():
    """backend=None: the Triton custom ops on meta (the simulated GPU: fake outputs), the references on CPU."""
    x = torch.empty(2, 3, 64, device="meta", dtype=torch.bfloat16)
    w = torch.empty(64, device="meta", dtype=torch.bfloat16)
    out, h = add_rms_norm(x, x, w, EPS)
    assert out.shape == h.shape == x.shape and out.device.type == "meta" and h is not x
    assert add_rms_norm(x, None, w, EPS)[1] is x
    assert silu_mul(torch.empty(2, 3, 10, device="meta")).shape == (2, 3, 5)
    q, k = rope_qk(torch.empty(2, 3, 4, 8, device="meta"), torch.empty(2, 3, 2, 8, device="meta"),
                   torch.empty(2, 3, 8, device="meta"), torch.empty(2, 3, 8, device="meta"))  # fmt: skip
    assert q.shape == (2, 3, 4, 8) and k.shape == (2, 3, 2, 8) and q.device.type == "meta"
    xc, wc = torch.randn(4, 16), torch.rand(16)
    for got, want in zip(add_rms_norm(xc, xc, wc, EPS), add_rms_norm_ref(xc, xc, wc, EPS)):
        assert torch.equal(got, want)
    with pytest.raises(ValueError, match="no native backend"):
        silu_mul(xc, backend="native")
    with pytest.raises(ValueError, match="unknown backend"):
        silu_mul(xc, backend="cuda")


def test_layer_ops_switch(monkeypatch):
    """``SPECDEC_FUSED_ELEMENTWISE=0`` runs the references in the device loop (the unfused comparison)."""
    monkeypatch.delenv("SPECDEC_FUSED_ELEMENTWISE", raising=False)
    assert layer_ops() is DEVICE_OPS
    monkeypatch.setenv("SPECDEC_FUSED_ELEMENTWISE", "0")
    assert layer_ops() is REFERENCE_OPS


def _layer_inputs(dtype: torch.dtype, qk_norm: bool, gen: torch.Generator):
    """Two layers of a small GQA model, a paged cache with a 6-token prefix, a 4-node tree per row."""
    B, T, H, Hq, Hkv, D, inter, L = 2, 4, 48, 6, 2, 8, 40, 2
    weights = []
    for _ in range(L):
        norms = [torch.rand(D, generator=gen) + 0.5, torch.rand(D, generator=gen) + 0.5] if qk_norm else [None, None]
        weights += [torch.rand(H, generator=gen) + 0.5, torch.randn((Hq + 2 * Hkv) * D, H, generator=gen) / H**0.5,
                    None, torch.randn(H, Hq * D, generator=gen) / (Hq * D) ** 0.5, torch.rand(H, generator=gen) + 0.5,
                    torch.randn(2 * inter, H, generator=gen) / H**0.5,
                    torch.randn(H, inter, generator=gen) / inter**0.5, *norms, None, None, None]  # fmt: skip
    weights = [None if w is None else w.to(dtype) for w in weights]
    kv_cache = (torch.randn(L, 2, 8, 4, Hkv, D, generator=gen)).to(dtype)  # [L, 2, blocks, block_size, Hkv, D]
    block_table = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]], dtype=torch.int32)
    cache_seqlens = torch.tensor([6, 3], dtype=torch.int32)
    parents = [-1, 0, 0, 1]
    tree_mask = torch.zeros(T, T, dtype=torch.bool)
    for i, p in enumerate(parents):
        tree_mask[i] = tree_mask[p] if p >= 0 else tree_mask[i]
        tree_mask[i, i] = True
    tree_mask = tree_mask.expand(B, T, T).contiguous()
    angles = torch.rand(B, T, D // 2, generator=gen).repeat(1, 1, 2) * 6
    rope = torch.stack((angles.cos(), angles.sin())).to(dtype)  # [2, B, T, D]
    hidden = torch.randn(B, T, H, generator=gen).to(dtype)
    return hidden, weights, (torch.rand(H, generator=gen) + 0.5).to(dtype), kv_cache, cache_seqlens, rope, tree_mask, \
        block_table, Hq  # fmt: skip


@INTERPRETED
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_layer_loop_with_fused_kernels(dtype, qk_norm):
    """The layer loop with the Triton kernels against the loop with the references: the same K/V written (RoPE is
    exact in bf16, within rounding in fp32) and hidden states within the dtype's rounding; the loop's layer-0 input
    norm takes the embeddings with no residual."""
    gen = torch.Generator().manual_seed(5)
    hidden, weights, final_norm, kv_cache, cache_seqlens, rope, mask, table, hq = _layer_inputs(dtype, qk_norm, gen)
    triton_ops = ElementwiseOps(*(functools.partial(op, backend="triton") for op in DEVICE_OPS))

    def run(ops):
        cache = kv_cache.clone()

        def attend(q, k_cache, v_cache, window):
            return tree_attention_ref(q, k_cache, v_cache, cache_seqlens, mask, block_table=table)

        out = decoder_layer_loop(hidden, weights, final_norm, cache, cache_seqlens, rope, mask, table, hq, EPS,
                                 linear_ref, attend, None, ops)  # fmt: skip
        return out, cache

    want, want_cache = run(REFERENCE_OPS)
    got, got_cache = run(triton_ops)
    tol = {torch.float32: 1e-5, torch.bfloat16: 4e-2}[dtype]
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    torch.testing.assert_close(got_cache, want_cache, rtol=tol, atol=tol)
    assert [LAYER_FIELDS.index("q_norm")] and len(weights) == 2 * len(LAYER_FIELDS)
