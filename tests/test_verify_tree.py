"""verify_tree: exact cases, invariants, and chi-squared tests of the emitted tokens' joint distribution.

The distribution tests build a tiny "language model" (random logits per context, V=4), draft trees from a draft
model exactly as ``draft_sampling`` says, run one verify step for many rows at once, finish each row's first three
tokens autoregressively from the exact target, and compare the joint of (x1, x2, x3) with the exact product of
HF-warped conditionals (transformers' own warpers: an implementation independent of ours). A planted bug (no
residual update after a rejection) must fail the same test, so the test is shown to have power.
"""

from __future__ import annotations

import importlib
import math
import os

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from spec_kernels._ext import load_ext  # noqa: E402
from spec_kernels._sampling import RowParams, keep_threshold, keep_threshold_ref, transform_probs  # noqa: E402
from spec_kernels.verify_tree.ref import _transform_row_ref  # noqa: E402

vt = importlib.import_module("spec_kernels.verify_tree")
vt_cpu = importlib.import_module("spec_kernels.verify_tree.cpu")
vt_triton = importlib.import_module("spec_kernels.verify_tree.triton")
verify_tree, PAD_NODE = vt.verify_tree, vt.PAD_NODE


def _interpreted() -> bool:
    if not vt_triton.triton_available():
        return False
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(vt_triton._verify_tree_kernel, InterpretedFunction)


TRITON = pytest.mark.skipif(
    not (_interpreted() or torch.cuda.is_available()),
    reason="spec_kernels was imported before TRITON_INTERPRET=1 was set (set it in conftest.py)",
)
BACKENDS = ["torch", "native", pytest.param("triton", marks=TRITON)]
# a CUDA parametrisation: `pytest -m cuda` (bench/gpu.sh) selects it; skipped where there is no GPU
CUDA = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
P_MIN = 1e-4  # chi2 acceptance: a correct sampler fails one test in 10^4
P_BUG = 1e-8  # the planted bug must be rejected far beyond that


def _warp_hf(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """HF's own warpers, in HF's order: the independent spec of the transform. logits [N, V] -> probs [N, V]."""
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    z = logits.double()
    warpers = [TemperatureLogitsWarper(temperature)]
    if top_k > 0:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1:
        warpers.append(TopPLogitsWarper(top_p))
    if min_p > 0:
        warpers.append(MinPLogitsWarper(min_p))
    for w in warpers:
        z = w(None, z)
    return torch.softmax(z, -1)


# --- tree fixtures ---------------------------------------------------------------------------------------------

# root -> {1, 2}; 1 -> {3, 4}; 2 -> {5}; node 6 is padding
PARENTS = [-1, 0, 0, 1, 1, 2, -1]


def _greedy_walk(logits: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor):
    """Brute-force greedy verification of one row, straight from the contract."""
    path, node = [0], 0
    while True:
        best = int(torch.nan_to_num(logits[node].double(), nan=-math.inf).argmax())
        nxt = [i for i in range(node + 1, len(parents)) if parents[i] == node and tokens[i] == best]
        if not nxt:
            return path, [int(tokens[i]) for i in path[1:]] + [best]
        node = nxt[0]
        path.append(node)


def _random_tree(B: int, T: int, V: int, gen: torch.Generator):
    parents = torch.full((B, T), -1, dtype=torch.int64)
    for i in range(1, T):
        parents[:, i] = torch.randint(0, i, (B,), generator=gen)
    pad = torch.rand(B, T, generator=gen) < 0.15
    pad[:, 0] = False
    parents[pad] = -1
    tokens = torch.randint(0, V, (B, T), generator=gen)
    return parents, tokens


def _check_invariants(res, tokens: torch.Tensor, parents: torch.Tensor, V: int):
    B, T = tokens.shape
    acc, out, num = res
    assert acc.dtype == out.dtype == num.dtype == torch.int64
    assert (acc[:, 0] == 0).all() and (num >= 1).all() and (num <= T).all()
    for b in range(B):
        n = int(num[b])
        assert (acc[b, n:] == PAD_NODE).all() and (out[b, n:] == PAD_NODE).all()
        path = acc[b, :n].tolist()
        for d in range(1, n):
            assert parents[b, path[d]] == path[d - 1]  # the path follows the tree
            assert out[b, d - 1] == tokens[b, path[d]]  # accepted drafts are emitted as drafted
        assert 0 <= out[b, n - 1] < V


# --- exact cases -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("V", [37, 1000])
def test_greedy_matches_brute_force(backend, V):
    if backend == "triton" and V > 100 and not torch.cuda.is_available():
        pytest.skip("interpreter: small V only")
    gen = torch.Generator().manual_seed(1)
    B, T = 3, 7
    logits = torch.randn(B, T, V, generator=gen)
    parents, tokens = _random_tree(B, T, V, gen)
    # plant matches so that paths go deep, plus a duplicate sibling that must not be taken twice
    for b in range(B):
        for i in range(1, T):
            if parents[b, i] >= 0 and (i + b) % 2 == 0:
                tokens[b, i] = logits[b, parents[b, i]].argmax()
    res = verify_tree(logits, tokens, parents, temperature=torch.zeros(B), backend=backend)
    _check_invariants(res, tokens, parents, V)
    for b in range(B):
        path, emitted = _greedy_walk(logits[b], tokens[b], parents[b])
        assert res.accepted_nodes[b, : len(path)].tolist() == path
        assert res.output_tokens[b, : len(path)].tolist() == emitted
        assert int(res.num_accepted[b]) == len(path)


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_hot_target_is_followed(backend):
    # a one-hot target: the child equal to its token is always accepted, every other child always rejected
    V, T = 11, 6
    parents = torch.tensor([[-1, 0, 0, 2, 2, 3]])
    tokens = torch.tensor([[0, 5, 7, 1, 9, 4]])
    target = torch.tensor([7, 0, 9, 2, 0, 3])  # node -> the only token the target allows after it
    logits = torch.full((1, T, V), -1e4)
    logits[0, torch.arange(T), target] = 10.0
    for probs in (None, torch.softmax(torch.randn(1, T, V), -1)):
        res = verify_tree(logits, tokens, parents, draft_probs=probs, seed=3, backend=backend)
        assert res.accepted_nodes[0].tolist() == [0, 2, 4, -1, -1, -1]
        assert res.output_tokens[0].tolist() == [7, 9, 0, -1, -1, -1]  # node 4 is a leaf: bonus = its target 0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["iid", "without_replacement"])
def test_draft_equal_to_target_accepts_everything(backend, mode):
    # q == p makes the accept probability 1: the whole chain is accepted and a bonus follows
    V, T = 23, 5
    logits = torch.randn(2, T, V)
    probs = torch.softmax(logits, -1)
    parents = torch.tensor([[-1, 0, 1, 2, 3]] * 2)
    tokens = torch.randint(0, V, (2, T))
    for seed in range(3):
        res = verify_tree(logits, tokens, parents, draft_probs=probs, draft_sampling=mode, seed=seed, backend=backend)
        assert res.num_accepted.tolist() == [T, T]
        assert (res.output_tokens[:, : T - 1] == tokens[:, 1:]).all()
        assert ((res.output_tokens[:, T - 1] >= 0) & (res.output_tokens[:, T - 1] < V)).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_child_rejected(backend):
    # the target gives the children's tokens zero mass (top-k keeps only tokens 0..2): all rejected, and the
    # recovered token comes from the residual, which also excludes the children
    V, T = 13, 4
    logits = torch.zeros(1, T, V)
    logits[0, 0, :3] = torch.tensor([3.0, 2.0, 1.0])
    parents = torch.tensor([[-1, 0, 0, 0]])
    tokens = torch.tensor([[0, 5, 0, 8]])
    tokens[0, 2] = 6
    probs = torch.full((1, T, V), 1.0 / V)
    for seed in range(4):
        for kw in (dict(), dict(draft_probs=probs)):
            res = verify_tree(logits, tokens, parents, top_k=3, seed=seed, backend=backend, **kw)
            assert res.num_accepted.tolist() == [1]
            assert res.output_tokens[0, 0] in (0, 1, 2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_invariants_random_trees(backend):
    small = backend == "triton" and not torch.cuda.is_available()
    B, T, V = (3, 6, 37) if small else (16, 26, 111)
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(B, T, V, generator=gen) * 3
    parents, tokens = _random_tree(B, T, V, gen)
    probs = torch.softmax(torch.randn(B, T, V, generator=gen), -1)
    temperature = torch.rand(B, generator=gen) + 0.2
    temperature[0] = 0.0
    kws = [dict(), dict(draft_probs=probs), dict(draft_probs=probs, draft_sampling="without_replacement")]
    for kw in kws[:1] if small else kws:
        res = verify_tree(logits, tokens, parents, temperature=temperature, top_p=0.9, seed=0, backend=backend, **kw)
        _check_invariants(res, tokens, parents, V)


@pytest.mark.parametrize("backend", BACKENDS)
def test_seeded_runs_are_bitwise_reproducible(backend):
    B, T, V = 3, 5, 37
    logits = torch.randn(B, T, V)
    parents, tokens = _random_tree(B, T, V, torch.Generator().manual_seed(2))
    probs = torch.softmax(torch.randn(B, T, V), -1)
    runs = [verify_tree(logits, tokens, parents, draft_probs=probs, seed=s, backend=backend) for s in (5, 5, 6)]
    for x, y in zip(runs[0], runs[1]):
        assert torch.equal(x, y)
    if backend != "triton":  # a different seed changes something (three rows' worth of samples)
        many = [verify_tree(logits, tokens, parents, draft_probs=probs, seed=s, backend=backend) for s in range(8)]
        assert len({tuple(r.output_tokens.flatten().tolist()) for r in many}) > 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_inf_logits_give_valid_ids(backend):
    B, T, V = 4, 3, 37
    logits = torch.randn(B, T, V)
    logits[0] = float("nan")
    logits[1, :, 5] = float("inf")
    logits[1, :, 9] = float("inf")
    logits[2] = float("-inf")
    logits[3, :, ::2] = float("nan")
    parents = torch.tensor([[-1, 0, 1]] * B)
    tokens = torch.randint(0, V, (B, T))
    for temperature in (0.0, 1.0):
        res = verify_tree(logits, tokens, parents, temperature=temperature, top_p=0.8, seed=0, backend=backend)
        _check_invariants(res, tokens, parents, V)
        assert res.output_tokens[1, int(res.num_accepted[1]) - 1] in (5, 9)  # +inf tokens share all the mass
        if temperature == 0.0:
            assert res.output_tokens[2, 0] == 0  # nothing finite: greedy id 0


# --- the position-keyed coupling (noise_seeds / positions / coupled) ------------------------------------------

COUPLING_FILTERS = {
    "none": {},
    "top_k": {"top_k": torch.tensor([5, 0, 40, 3])},
    "top_p": {"top_p": torch.tensor([0.8, 0.95, 1.0, 0.5])},
    "min_p": {"min_p": torch.tensor([0.1, 0.0, 0.3, 0.02])},
    "all": {"top_k": torch.tensor([30, 0, 8, 50]), "top_p": torch.tensor([0.9, 0.6, 1.0, 0.7]), "min_p": 0.01},
}


def _coupled_step(B: int, T: int, V: int, filters: dict, gen: torch.Generator):
    """A mixed batch: rows 0, 1, 3 (mod 4) coupled, row 2 (mod 4) plain sampled, row 1 greedy (a coupled flag on a
    greedy row must change nothing). The drafts follow the perturbed argmax at their parent most of the time, so
    coupled paths run deep. Returns the logits, tokens, parents and the verify kwargs."""
    from spec_kernels.rng import position_gumbel

    logits = torch.randn(B, T, V, generator=gen) * 2
    parents, tokens = _random_tree(B, T, V, gen)
    depth = torch.zeros(B, T, dtype=torch.int64)
    for i in range(1, T):
        depth[:, i] = torch.where(parents[:, i] >= 0, depth.gather(1, parents[:, i : i + 1].clamp(min=0))[:, 0] + 1, 0)
    positions = torch.randint(0, 4096, (B, 1), generator=gen) + depth  # [B, T]: L_b + depth
    noise_seeds = torch.randint(0, 2**62, (B,), generator=gen)
    temperature = torch.rand(B, generator=gen) + 0.5
    temperature[1] = 0.0
    filters = {
        k: v.repeat(B // 4) if isinstance(v, torch.Tensor) else torch.tensor([v] * B) for k, v in filters.items()
    }
    prm = RowParams(temperature, filters.get("top_k", torch.zeros(B, dtype=torch.int64)),
                    filters.get("top_p", torch.ones(B)), filters.get("min_p", torch.zeros(B)))  # fmt: skip
    log_p = transform_probs(logits.view(B * T, V), RowParams(*(x.repeat_interleave(T) for x in prm))).log()
    best = (log_p.view(B, T, V) + position_gumbel(noise_seeds, positions, V)).argmax(-1)  # [B, T]
    follow = (parents >= 0) & (torch.rand(B, T, generator=gen) < 0.8)
    tokens = torch.where(follow, best.gather(1, parents.clamp(min=0)), tokens)
    coupled = torch.arange(B) % 4 != 2
    kwargs = dict(temperature=temperature, seed=torch.arange(B) + 100, noise_seeds=noise_seeds, positions=positions,
                  coupled=coupled, **filters)  # fmt: skip
    return logits, tokens, parents, kwargs


@pytest.mark.parametrize("filt", [pytest.param(f, marks=CUDA) for f in ("none", "all")])
@pytest.mark.parametrize("B,T,V", [(8, 26, 111), (4, 5, 32000), (1, 64, 151936)])
def test_cuda_rows_match_the_cpu_reference(filt, B, T, V):
    """On CUDA tensors the default backend (Triton) walks the reference's path token for token for greedy and
    coupled rows, every per-row tensor on the device."""
    gen = torch.Generator().manual_seed(B * T + V)
    logits, tokens, parents, kwargs = _coupled_step(max(B, 4), T, V, COUPLING_FILTERS[filt], gen)
    logits, tokens, parents = logits[:B], tokens[:B], parents[:B]
    kwargs = {k: v[:B] if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    ref = verify_tree(logits, tokens, parents, **kwargs, backend="torch")
    on_gpu = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    res = verify_tree(logits.cuda(), tokens.cuda(), parents.cuda(), **on_gpu)
    exact = kwargs["coupled"] | (kwargs["temperature"] == 0)
    for a, b in zip(ref, res):
        assert b.device.type == "cuda" and torch.equal(a[exact], b.cpu()[exact])


@pytest.mark.parametrize("backend", ["native", pytest.param("triton", marks=TRITON)])
@pytest.mark.parametrize("filt", list(COUPLING_FILTERS))
@pytest.mark.parametrize("B,T,V", [(8, 26, 111), (4, 1, 32000), (4, 5, 32000)])
def test_coupled_rows_match_reference(backend, filt, B, T, V):
    """Coupled and greedy rows: token for token the reference's Gumbel-max walk, with every filter, in a batch
    mixed with plain sampled rows (which keep their own streams: the coupling leaves them as they were)."""
    interpreted = backend == "triton" and not torch.cuda.is_available()
    if interpreted and V > 1000 and (T > 1 or filt not in ("none", "all")):
        pytest.skip("interpreter: V=32000 for T=1 without and with every filter only")
    gen = torch.Generator().manual_seed(B * T + V)
    logits, tokens, parents, kwargs = _coupled_step(B, T, V, COUPLING_FILTERS[filt], gen)
    ref = verify_tree(logits, tokens, parents, **kwargs, backend="torch")
    res = verify_tree(logits, tokens, parents, **kwargs, backend=backend)
    _check_invariants(res, tokens, parents, V)
    exact = kwargs["coupled"] | (kwargs["temperature"] == 0)
    for a, b in zip(ref, res):
        assert torch.equal(a[exact], b[exact])
    if T > 1:
        assert int(ref.num_accepted[exact].max()) >= 3, "the coupled paths must run deep for this test to bite"
    plain = {k: v for k, v in kwargs.items() if k not in ("noise_seeds", "positions", "coupled")}
    alone = verify_tree(logits, tokens, parents, **plain, backend=backend)
    for a, b in zip(alone, res):
        assert torch.equal(a[~kwargs["coupled"]], b[~kwargs["coupled"]])


@pytest.mark.parametrize("backend", BACKENDS)
def test_coupled_sample_is_the_position_gumbel_argmax(backend):
    """Flat logits (the uniform target): a coupled row's token is argmax_x g_t(x), the noise of
    ``rng.position_gumbel`` at (seed, t), which the draft model proposes with; and it moves with the position."""
    from spec_kernels.rng import position_gumbel

    B, V = 32, 111
    gen = torch.Generator().manual_seed(5)
    noise_seeds = torch.randint(0, 2**62, (B,), generator=gen)
    positions = torch.randint(0, 10**6, (B, 1), generator=gen)
    logits, tokens, parents = torch.zeros(B, 1, V), torch.zeros(B, 1, dtype=torch.int64), torch.full((B, 1), -1)
    res = verify_tree(logits, tokens, parents, noise_seeds=noise_seeds, positions=positions, backend=backend)
    assert torch.equal(res.output_tokens[:, 0], position_gumbel(noise_seeds, positions, V)[:, 0].argmax(-1))
    moved = verify_tree(logits, tokens, parents, noise_seeds=noise_seeds, positions=positions + 1, backend=backend)
    assert (moved.output_tokens[:, 0] != res.output_tokens[:, 0]).any()


@TRITON
def test_in_kernel_uniform_is_bitwise_rng():
    """The Triton hash (uint64 arithmetic) gives rng.position_uniform's float32 uniforms bit for bit."""
    import triton
    import triton.language as tl

    from spec_kernels.rng import position_uniform

    @triton.jit
    def _uniforms_kernel(seeds_ptr, positions_ptr, out_ptr, V, BLOCK_V: tl.constexpr):
        b = tl.program_id(0)
        key = vt_triton._node_key(tl.load(seeds_ptr + b), tl.load(positions_ptr + b))
        offs = tl.arange(0, BLOCK_V)
        tl.store(out_ptr + b * V + offs, vt_triton._position_uniform(key, offs), mask=offs < V)

    seeds = torch.tensor([0, 1, -1, 2**63 - 1, -(2**63), 123456789, 2**62 + 5], dtype=torch.int64)
    positions = torch.tensor([0, 7, 2**40, 1, 999, -3, 31], dtype=torch.int64)
    V = 1000
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    out = torch.empty(len(seeds), V, device=dev)
    _uniforms_kernel[(len(seeds),)](seeds.to(dev), positions.to(dev), out, V, BLOCK_V=1024)
    assert torch.equal(out.cpu(), position_uniform(seeds, positions[:, None], V)[:, 0])


def test_native_uniform_is_bitwise_the_torch_hash():
    """The CPU's one-pass hash (``rng_uniform``, C++) gives the torch ops' float32 uniforms bit for bit, at every key
    (the int64 extremes too) and counter, including those whose 24 bits round at + 0.5 in float32."""
    from spec_kernels import rng

    keys = torch.tensor([0, 1, -1, 2**63 - 1, -(2**63), 123456789, 2**62 + 5], dtype=torch.int64)
    for n in (1, 7, 49152):
        native = rng.uniform(keys, (n,))
        assert native.shape == (len(keys), n) and native.dtype == torch.float32
        assert torch.equal(native, rng.uniform_ref(keys, n))
    assert torch.equal(rng.uniform(keys[2:5], (3, 4)), rng.uniform_ref(keys[2:5], 12).view(3, 3, 4))
    assert rng.uniform(keys, (0,)).shape == (len(keys), 0)
    u = rng.uniform(torch.arange(64, dtype=torch.int64), (4096,))
    assert 0.0 < float(u.min()) and float(u.max()) < 1.0 and abs(float(u.mean()) - 0.5) < 0.01


@pytest.mark.parametrize("backend", ["torch", "native", pytest.param("triton", marks=TRITON)])
@pytest.mark.parametrize(
    "change,match",
    [
        (lambda a: {**a, "positions": None}, "go together"),
        (lambda a: {**a, "noise_seeds": None}, "go together"),
        (lambda a: {**a, "noise_seeds": torch.zeros(3, dtype=torch.int64)}, "noise_seeds"),
        (lambda a: {**a, "positions": torch.zeros(2, 3)}, "positions"),
        (lambda a: {**a, "coupled": torch.ones(2)}, "coupled"),
    ],
)
def test_bad_coupling_args_raise(backend, change, match):
    logits, tokens, parents = _ok_args()
    ok = dict(noise_seeds=torch.zeros(2, dtype=torch.int64), positions=torch.zeros(2, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match=match):
        verify_tree(logits, tokens, parents, **change(ok), backend=backend)


# --- the transform ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "t,k,p,m", [(1.0, 0, 1.0, 0.0), (0.7, 5, 1.0, 0.0), (1.3, 0, 0.8, 0.0), (1.0, 0, 1.0, 0.2), (0.9, 20, 0.6, 0.05)]
)
def test_transform_matches_hf_warpers(t, k, p, m):
    logits = torch.randn(6, 50) * 2
    want = _warp_hf(logits, t, k, p, m)
    for row in range(6):
        assert torch.allclose(_transform_row_ref(logits[row], t, k, p, m), want[row], atol=1e-12)
    dtypes = (torch.float32, torch.int64, torch.float32, torch.float32)
    params = RowParams(*(torch.full((6,), v, dtype=d) for v, d in zip((t, k, p, m), dtypes)))
    assert torch.allclose(transform_probs(logits, params).double(), want, atol=1e-6)


@pytest.mark.parametrize("V", [7, 111, 5000])
def test_the_native_threshold_keeps_what_the_torch_one_keeps(V):
    """``keep_threshold`` on the CPU (one C++ function, the native steps' own) keeps the entries its torch reference
    keeps: every filter alone and together, k past the candidates (1,024) and past V, ties, -inf entries, and top-p
    rows whose candidates hold too little mass (a flat row of 5,000: the search falls back to the whole row). The
    two sum the masses in different orders, so an entry whose mass before it is top_p to within float32 rounding
    (top_p 0.999999) may fall either side."""
    g = torch.Generator().manual_seed(V)
    rows = []
    for k, p, m in [(0, 1.0, 0.0), (1, 1.0, 0.0), (3, 1.0, 0.0), (0, 0.5, 0.0), (0, 0.95, 0.0), (0, 0.999999, 0.0),
                    (0, 1.0, 0.1), (5, 0.8, 0.02), (1500, 0.9, 0.0), (V, 0.7, 0.0), (V + 3, 1.0, 0.3)]:  # fmt: skip
        for scale in (0.05, 1.0, 4.0):
            rows.append((k, p, m, scale))
    z = torch.stack([torch.randn(V, generator=g) * scale for *_, scale in rows])  # [N, V]
    z[::4, : V // 3] = z[::4, V // 3 : 2 * (V // 3)]  # ties
    z[1::5, ::7] = -math.inf
    z[2::6] = z[2::6].round()  # many ties at the boundaries
    dtypes = (torch.int64, torch.float32, torch.float32)
    params = RowParams(
        torch.ones(len(rows)), *(torch.tensor([r[i] for r in rows], dtype=d) for i, d in enumerate(dtypes))
    )
    native, ref = keep_threshold(z, params), keep_threshold_ref(z, params)
    differ = (z >= native[:, None]) != (z >= ref[:, None])  # [N, V]
    rows_differ = differ.any(-1).nonzero().squeeze(1).tolist()
    assert len(rows_differ) <= 1
    for i in rows_differ:
        p = torch.softmax(torch.where(z[i] >= min(ref[i], native[i]), z[i], -math.inf).double(), -1)  # [V]
        before = (p[None, :] * (z[i][None, :] > z[i][:, None])).sum(-1)  # [V]: the mass of the entries above each
        assert rows[i][1] == 0.999999 and bool(((before - 0.999999).abs() < 1e-5)[differ[i]].all())
    with pytest.raises(ValueError, match="NaN"):
        keep_threshold(torch.tensor([[0.0, math.nan]]), params.rows(torch.tensor([0])))


def test_top_k_and_top_p_keep_ties():
    logits = torch.tensor([[2.0, 1.0, 1.0, 1.0, 0.0]])
    params = RowParams(torch.ones(1), torch.tensor([2]), torch.ones(1), torch.zeros(1))
    assert (transform_probs(logits, params)[0] > 0).tolist() == [True, True, True, True, False]
    assert (_transform_row_ref(logits[0], 1.0, 2, 1.0, 0.0) > 0).tolist() == [True, True, True, True, False]
    # top-p: 2.0 alone holds < 0.5 of the mass, so the first 1.0 is needed, and with it its ties
    params = RowParams(torch.ones(1), torch.zeros(1, dtype=torch.int64), torch.tensor([0.5]), torch.zeros(1))
    assert (transform_probs(logits, params)[0] > 0).tolist() == [True, True, True, True, False]


# --- distribution ----------------------------------------------------------------------------------------------

V_SMALL = 4
CTX_GEN = torch.Generator().manual_seed(1234)
TARGET = [torch.randn(V_SMALL**d, V_SMALL, generator=CTX_GEN) * 1.2 for d in range(3)]  # logits per context
DRAFT = [torch.softmax(torch.randn(V_SMALL**d, V_SMALL, generator=CTX_GEN), -1) for d in range(3)]
FILTERS = {"none": (1.0, 0, 1.0, 0.0), "filtered": (0.8, 3, 0.85, 0.1)}


def _ctx(prefix: list[torch.Tensor]) -> torch.Tensor:
    """Context id of a token prefix (depth d): a base-V number."""
    c = torch.zeros_like(prefix[0]) if prefix else None
    for x in prefix:
        c = c * V_SMALL + x
    return c


def _draft_step(B: int, mode: str, gen: torch.Generator):
    """Draw B trees of shape PARENTS from the draft model exactly as ``mode`` says; return their target logits."""
    T = len(PARENTS)
    depth = [0, 1, 1, 2, 2, 2, 0]
    tokens = torch.zeros(B, T, dtype=torch.int64)
    ctx = torch.zeros(B, T, dtype=torch.int64)  # context id of each node: its path's tokens in base V
    logits = torch.zeros(B, T, V_SMALL)
    probs = torch.zeros(B, T, V_SMALL)
    logits[:, 0], probs[:, 0] = TARGET[0][0], DRAFT[0][0]
    for par in range(T):  # topological: a node's context is known before its children are drawn
        kids = [i for i in range(T) if PARENTS[i] == par]
        if not kids:
            continue
        if mode == "deterministic":  # any fixed rule: here the draft's top tokens, then a duplicate
            order = probs[:, par].argsort(-1, descending=True)
            for j, kid in enumerate(kids):
                tokens[:, kid] = order[:, j]
        else:
            drawn = torch.multinomial(probs[:, par], len(kids), replacement=(mode == "iid"), generator=gen)
            tokens[:, kids] = drawn
        for kid in kids:
            ctx[:, kid] = ctx[:, par] * V_SMALL + tokens[:, kid]
            logits[:, kid] = TARGET[depth[kid]][ctx[:, kid]]
            probs[:, kid] = DRAFT[depth[kid]][ctx[:, kid]]
    parents = torch.tensor([PARENTS] * B)
    return logits, tokens, parents, (None if mode == "deterministic" else probs)


def _exact_joint(filt) -> np.ndarray:
    t, k, p, m = filt
    p1 = _warp_hf(TARGET[0], t, k, p, m)[0]  # [V]
    p2 = _warp_hf(TARGET[1], t, k, p, m)  # [V, V]
    p3 = _warp_hf(TARGET[2], t, k, p, m)  # [V*V, V]
    joint = p1[:, None, None] * p2[:, :, None] * p3.view(V_SMALL, V_SMALL, V_SMALL)
    return joint.flatten().numpy()


def _sample_joint(backend: str, mode: str, filt, B: int, seed: int) -> np.ndarray:
    """Counts of the first three emitted tokens over B rows: one verify step, then the exact target."""
    gen = torch.Generator().manual_seed(seed)
    logits, tokens, parents, probs = _draft_step(B, mode, gen)
    t, k, p, m = filt
    draft_sampling = "without_replacement" if mode == "without_replacement" else "iid"
    res = verify_tree(
        logits, tokens, parents, draft_probs=probs, draft_sampling=draft_sampling,
        temperature=t, top_k=k, top_p=p, min_p=m, seed=seed, backend=backend,
    )  # fmt: skip
    out = res.output_tokens[:, :3].clone()  # [B, 3], -1 past the emitted tokens
    for d in range(3):  # continue autoregressively from the exact target where the step stopped
        need = out[:, d] < 0
        if need.any():
            ctx = _ctx([out[need, j] for j in range(d)]) if d else torch.zeros(int(need.sum()), dtype=torch.int64)
            dist = _warp_hf(TARGET[d][ctx], t, k, p, m).float()
            out[need, d] = torch.multinomial(dist, 1, generator=gen).squeeze(1)
    codes = (out[:, 0] * V_SMALL + out[:, 1]) * V_SMALL + out[:, 2]
    return np.bincount(codes.numpy(), minlength=V_SMALL**3)


def _chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    n = counts.sum()
    expected = probs * n
    big = expected >= 5  # pool the rare cells so chi2's approximation holds
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] == 0:
        assert obs[-1] == 0, "a token outside the target's support was emitted"
        obs, exp = obs[:-1], exp[:-1]
    return chisquare(obs, exp * obs.sum() / exp.sum()).pvalue


MODES = ["iid", "without_replacement", "deterministic"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("filt", list(FILTERS))
def test_native_distribution_is_exact(mode, filt):
    counts = _sample_joint("native", mode, FILTERS[filt], B=60_000, seed=11)
    assert _chi2_pvalue(counts, _exact_joint(FILTERS[filt])) > P_MIN


@pytest.mark.parametrize("mode", MODES)
def test_planted_bug_is_caught(mode, monkeypatch):
    # no residual update after a rejection: the next sibling and the recovered token see the unchanged p
    monkeypatch.setattr(vt_cpu, "_residual", lambda p, q, x: p)
    counts = _sample_joint("native", mode, FILTERS["none"], B=60_000, seed=11)
    assert _chi2_pvalue(counts, _exact_joint(FILTERS["none"])) < P_BUG


@pytest.mark.parametrize("mode", MODES)
def test_reference_distribution_is_exact(mode):
    counts = _sample_joint("torch", mode, FILTERS["filtered"], B=1500, seed=12)
    assert _chi2_pvalue(counts, _exact_joint(FILTERS["filtered"])) > P_MIN


@TRITON
@pytest.mark.parametrize("mode", MODES)
def test_triton_distribution_is_exact(mode):
    big = torch.cuda.is_available()
    filt = FILTERS["filtered"]
    counts = _sample_joint("triton", mode, filt, B=60_000 if big else 40, seed=13)
    assert _chi2_pvalue(counts, _exact_joint(filt)) > P_MIN


# --- errors ----------------------------------------------------------------------------------------------------


def _ok_args(B=2, T=3, V=5):
    return torch.randn(B, T, V), torch.zeros(B, T, dtype=torch.int64), torch.tensor([[-1, 0, 1]] * B)


@pytest.mark.parametrize("backend", ["torch", "native", pytest.param("triton", marks=TRITON)])
@pytest.mark.parametrize(
    "change,match",
    [
        (lambda a: {**a, "target_logits": a["target_logits"][0]}, "target_logits"),
        (lambda a: {**a, "draft_tokens": a["draft_tokens"][:, :2]}, "draft_tokens"),
        (lambda a: {**a, "parents": a["parents"].float()}, "parents"),
        (lambda a: {**a, "parents": torch.tensor([[-1, 0, 2]] * 2)}, "topological"),
        (lambda a: {**a, "parents": torch.tensor([[0, 0, 1]] * 2)}, "topological"),
        (lambda a: {**a, "draft_tokens": torch.tensor([[0, 9, 0]] * 2)}, "draft_tokens"),
        (lambda a: {**a, "draft_probs": torch.rand(2, 3, 6)}, "mismatch"),
        (lambda a: {**a, "draft_sampling": "beam"}, "draft_sampling"),
        (lambda a: {**a, "temperature": torch.tensor([1.0, -0.5])}, "temperature"),
        (lambda a: {**a, "top_p": torch.tensor([0.0, 0.5])}, "top_p"),
        (lambda a: {**a, "top_p": 1.5}, "top_p"),
        (lambda a: {**a, "top_k": -1}, "top_k"),
        (lambda a: {**a, "min_p": 2.0}, "min_p"),
        (lambda a: {**a, "temperature": torch.ones(3)}, "temperature"),
    ],
)
def test_bad_input_raises(backend, change, match):
    logits, tokens, parents = _ok_args()
    args = change(dict(target_logits=logits, draft_tokens=tokens, parents=parents))
    with pytest.raises(ValueError, match=match):
        verify_tree(**args, backend=backend)


def test_unknown_backend_raises():
    with pytest.raises(ValueError, match="backend"):
        verify_tree(*_ok_args(), backend="cuda-magic")


def test_ref_and_native_agree_with_int32_parents_and_padding():
    logits, tokens, parents = _ok_args(B=2, T=3, V=5)
    parents = torch.tensor([[-1, 0, -1], [-1, -1, -1]], dtype=torch.int32)
    for backend in ("torch", "native"):
        res = verify_tree(logits, tokens, parents, temperature=0.0, backend=backend)
        assert res.accepted_nodes[1].tolist() == [0, -1, -1]
        assert res.output_tokens[1, 0] == logits[1, 0].argmax()


@pytest.mark.parametrize("backend", BACKENDS)
def test_per_row_seeds_ignore_batch_composition(backend):
    """A [B] seed tensor: row b's result depends on its own seed alone, not on its neighbours or its index."""
    g = torch.Generator().manual_seed(3)
    B, T, V = 4, 5, 11
    logits = torch.randn(B, T, V, generator=g)
    tokens = torch.randint(0, V, (B, T), generator=g)
    parents = torch.tensor([-1, 0, 0, 1, 2]).expand(B, T)
    probs = torch.softmax(torch.randn(B, T, V, generator=g), -1)
    temp = torch.full((B,), 0.8)
    seeds = torch.tensor([11, 22, 33, 44])
    full = verify_tree(logits, tokens, parents, draft_probs=probs, temperature=temp, seed=seeds, backend=backend)
    perm = torch.tensor([2, 0, 3, 1])
    sub = verify_tree(logits[perm], tokens[perm], parents[perm], draft_probs=probs[perm], temperature=temp[perm],
                      seed=seeds[perm], backend=backend)  # fmt: skip
    for a, b in zip(full, sub):
        assert torch.equal(a[perm], b)
    with pytest.raises(ValueError, match="seed"):
        verify_tree(logits, tokens, parents, temperature=temp, seed=torch.tensor([1, 2]), backend=backend)


# --- the all-greedy CPU walk (spec_kernels::verify_greedy) ------------------------------------------------------


def _random_greedy_case(gen, B, T, V, match=0.6):
    logits = torch.randn(B, T, V, generator=gen)
    parents = torch.full((B, T), -1, dtype=torch.int64)
    for b in range(B):
        for i in range(1, T):
            parents[b, i] = int(torch.randint(0, i, (1,), generator=gen))
    tokens = torch.randint(0, V, (B, T), generator=gen)
    best = logits.argmax(-1)
    hit = torch.rand(B, T, generator=gen) < match
    tokens = torch.where(hit & (parents >= 0), best.gather(1, parents.clamp(min=0)), tokens)
    return logits, tokens, parents


@pytest.mark.parametrize("B, T, V", [(1, 1, 4096), (3, 6, 50), (2, 26, 111), (4, 16, 32000)])
def test_greedy_walk_equals_reference(B, T, V):
    """The one-call C++ walk that verify_tree takes for all-greedy CPU batches equals the reference, on random trees
    where most children carry their parent's argmax (so paths run deep)."""
    gen = torch.Generator().manual_seed(B * 1000 + T)
    for _ in range(20 if V < 10_000 else 3):
        logits, tokens, parents = _random_greedy_case(gen, B, T, V)
        temperature = torch.zeros(B)
        got = verify_tree(logits, tokens, parents, temperature=temperature)
        direct = torch.ops.spec_kernels.verify_greedy(logits, tokens, parents)
        ref = vt.verify_tree_ref(logits, tokens, parents, temperature=temperature)
        for a, b, c in zip(got, direct, ref):
            assert torch.equal(a, c) and torch.equal(b, c)


def test_greedy_walk_defers_to_the_general_path():
    """Rows the C++ walk cannot settle go to the general path: a NaN in a visited row is sanitised there, and a
    malformed tree raises its error there."""
    load_ext()
    gen = torch.Generator().manual_seed(5)
    logits, tokens, parents = _random_greedy_case(gen, 2, 5, 40)
    logits[1, 0, 3] = float("nan")
    temperature = torch.zeros(2)
    assert int(torch.ops.spec_kernels.verify_greedy(logits, tokens, parents)[2][1]) == 0
    got = verify_tree(logits, tokens, parents, temperature=temperature)
    ref = vt.verify_tree_ref(logits, tokens, parents, temperature=temperature)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    bad = parents.clone()
    bad[0, 2] = 3  # not topological
    with pytest.raises(ValueError, match="topological"):
        verify_tree(logits, tokens, bad, temperature=temperature)
    out_of_vocab = tokens.clone()
    out_of_vocab[0, 1] = 40
    with pytest.raises(ValueError, match="draft_tokens"):
        verify_tree(logits, out_of_vocab, parents, temperature=temperature)


# --- one node, exact outcome probabilities ---------------------------------------------------------------------
#
# A root with two children, V=4: each rule of the glossary shows in which (accepted node, first token) outcomes can
# occur and how often, worked out by hand. The target is w at temperature 2 with top-k 3, so p = [.2, .3, .5, 0]
# (token 3 is cut: a residual built from the untransformed p would emit it); the draft q = [.5, .25, .25, 0].
#   child 1 (token 0) is accepted with p/q = 0.4; after its rejection the residual is r1 = norm(max(p - q, 0)) =
#   [0, 1/6, 5/6, 0], and without replacement the draft becomes q' = [0, .5, .5, 0].
#   "iid_duplicate", children (0, 0): r1(0) = 0, so child 2 is never accepted; then r2 = norm(max(r1 - q, 0)) =
#       [0, 0, 1, 0] (max(p - q, 0) instead of max(r1 - q, 0) would keep token 1): the recovered token is 2.
#   "iid", children (0, 1): child 2 accepted with r1(1)/q(1) = 2/3, then r2 = [0, 0, 1, 0].
#   "without_replacement", children (0, 1): child 2 accepted with r1(1)/q'(1) = 1/3 (an unrenormalised q' gives
#       2/3), then norm(max(r1 - q', 0)) = [0, 0, 1, 0].
# Point masses (draft_probs=None) on p = [.5, .3, .2, 0] (w = [.5, .3, .2, .1]):
#   "point_mass", children (0, 1): 0 accepted with .5, then 1 with .3 / (1 - .5) (not .3), else token 2.
#   "point_mass_duplicate", children (0, 0): the second 0 is never accepted; the recovered token is drawn from p
#       without 0: [0, .6, .4, 0].
# Outcome keys: (accepted_nodes[:, 1], output_tokens[:, 0]); -1 = nothing accepted.
ONE_NODE = {
    "iid_duplicate": ("iid", [0, 0], {(1, 0): 0.4, (-1, 2): 0.6}),
    "iid": ("iid", [0, 1], {(1, 0): 0.4, (2, 1): 0.4, (-1, 2): 0.2}),
    "without_replacement": ("without_replacement", [0, 1], {(1, 0): 0.4, (2, 1): 0.2, (-1, 2): 0.4}),
    "point_mass": (None, [0, 1], {(1, 0): 0.5, (2, 1): 0.3, (-1, 2): 0.2}),
    "point_mass_duplicate": (None, [0, 0], {(1, 0): 0.5, (-1, 1): 0.3, (-1, 2): 0.2}),
}


def _one_node_counts(backend: str, case: str, B: int, seed: int, verify_as: str | None = None) -> dict:
    mode, kids, _ = ONE_NODE[case]
    w = torch.tensor([0.2, 0.3, 0.5, 0.1] if mode is not None else [0.5, 0.3, 0.2, 0.1])
    logits = torch.zeros(B, 3, 4)
    logits[:, 0] = 2.0 * w.log()  # temperature 2 undoes the factor 2; top-k 3 cuts token 3
    tokens = torch.tensor([[0, *kids]] * B)
    parents = torch.tensor([[-1, 0, 0]] * B)
    probs = None
    if mode is not None:
        probs = torch.full((B, 3, 4), 0.25)
        probs[:, 0] = torch.tensor([0.5, 0.25, 0.25, 0.0])
    sampling = verify_as or mode or "iid"
    res = verify_tree(logits, tokens, parents, draft_probs=probs, draft_sampling=sampling, temperature=2.0, top_k=3,
                      seed=seed, backend=backend)  # fmt: skip
    keys = zip(res.accepted_nodes[:, 1].tolist(), res.output_tokens[:, 0].tolist())
    counts: dict = {}
    for key in keys:
        counts[key] = counts.get(key, 0) + 1
    return counts


def _one_node_pvalue(counts: dict, expected: dict) -> float:
    """chi2 p-value of the outcome counts against their exact probabilities; 0 when an impossible one occurred."""
    if not set(counts) <= set(expected):
        return 0.0
    obs = np.array([counts.get(k, 0) for k in expected], dtype=float)
    return chisquare(obs, np.array(list(expected.values())) * obs.sum()).pvalue


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(ONE_NODE))
def test_one_node_outcomes_are_exact(backend, case):
    """Siblings, residuals, the draft without replacement and the recovered token, on one node whose outcome
    probabilities are known exactly (see ONE_NODE): impossible outcomes never occur, and the others occur as often
    as they should (chi2)."""
    # interpreted Triton: 60 rows (~3 s) show the impossible outcomes; the frequencies need the 4000 of a GPU run
    B = 60 if backend == "triton" and not torch.cuda.is_available() else 4000
    assert _one_node_pvalue(_one_node_counts(backend, case, B, seed=21), ONE_NODE[case][2]) > P_MIN


def test_one_node_planted_bugs_are_caught(monkeypatch):
    # the draft's rejected sibling kept (children drawn without replacement, verified as iid draws: ONE_NODE's "iid"
    # probabilities), and no residual after a rejection (the next sibling and the recovered token see p itself)
    wr = "without_replacement"
    assert _one_node_pvalue(_one_node_counts("native", wr, 4000, seed=21, verify_as="iid"), ONE_NODE[wr][2]) < P_BUG
    monkeypatch.setattr(vt_cpu, "_residual", lambda p, q, x: p)
    for case in ("iid_duplicate", "point_mass"):
        assert _one_node_pvalue(_one_node_counts("native", case, 4000, seed=21), ONE_NODE[case][2]) < P_BUG


def test_greedy_ties_go_to_the_first_maximum():
    """Integer logits, so most rows hold several maxima: every greedy path (the one-call C++ walk, the root-only
    argmax, the general native walk, the reference) takes the first index of the maximum, as plain decoding's
    torch.argmax does, and so accepts the child carrying it, never one carrying a later tied maximum."""
    gen = torch.Generator().manual_seed(9)
    B, T, V = 4, 8, 111
    logits = torch.randint(0, 3, (B, T, V), generator=gen).float()
    parents = torch.tensor([[-1, 0, 0, 1, 1, 2, 3, 3]] * B)
    tied = logits == logits.amax(-1, keepdim=True)  # [B, T, V]
    first = tied.int().argmax(-1)  # [B, T]
    last = V - 1 - tied.flip(-1).int().argmax(-1)
    assert (first != last).all(), "every row must hold a tie for this test to bite"
    # children: a later tied maximum first (a wrong tie-break takes it), then the first maximum
    tokens = torch.zeros(B, T, dtype=torch.int64)
    for i in range(1, T):
        par = parents[0, i]
        tokens[:, i] = last[:, par] if i in (1, 3, 6) else first[:, par]
    want = [_greedy_walk(logits[b], tokens[b], parents[b]) for b in range(B)]
    assert all(len(path) >= 3 for path, _ in want)
    runs = [
        verify_tree(logits, tokens, parents, temperature=torch.zeros(B)),  # the C++ walk
        verify_tree(logits, tokens, parents, temperature=0.0, backend="native"),  # the general native walk
        verify_tree(logits, tokens, parents, temperature=0.0, backend="torch"),
        verify_tree(logits[:, :1], tokens[:, :1], parents[:, :1], temperature=0.0, backend="native"),  # root only
    ]
    if _interpreted() or torch.cuda.is_available():
        runs.append(verify_tree(logits, tokens, parents, temperature=0.0, backend="triton"))
    for res in runs:
        for b, (path, emitted) in enumerate(want):
            n = int(res.num_accepted[b])
            assert res.output_tokens[b, :n].tolist() == emitted[:n] and res.accepted_nodes[b, :n].tolist() == path[:n]
            if res.accepted_nodes.shape[1] == T:
                assert n == len(path)
