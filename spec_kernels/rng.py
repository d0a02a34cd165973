"""Counter-based random numbers on any device: a uniform is a pure function of (key, counter), with no generator state.

A drafter that samples children for B rows at once needs B independent, reproducible streams. A ``torch.Generator``
per row means one small kernel (and on CUDA, a generator object) per row; a hash of integers runs as a handful of
element-wise int64 ops over the whole ``[B, ...]`` block on the tensors' own device, never touches the host, and
gives a request the same numbers alone or in any batch. The mixer is SplitMix64's finaliser (Steele et al. 2014),
whose outputs pass BigCrush for consecutive counters; int64 multiplication wraps in torch as in C, and the right
shifts are made logical by masking off the sign extension.

The position-keyed Gumbel noise of the coupling (``spec_engine/coupling.py``) lives here too, because verify_tree
regenerates it inside its kernels: ``_gumbel_tile`` in spec_kernels/verify_tree.py is the same hash in Triton's
uint64 arithmetic and must stay bit-identical to :func:`position_uniform` (tests/test_verify_tree.py checks it).
"""

from __future__ import annotations

import torch

GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as a signed int64
_M1 = -4658895280553007687  # 0xBF58476D1CE4E5B9
_M2 = -7723592293110705685  # 0x94D049BB133111EB
_U64 = (1 << 64) - 1
UNIFORM_BITS = 24  # u = (k + 0.5) / 2^24 of the top 24 bits k, never 0
UNIFORM_MAX = 1.0 - 2.0**-24  # ... and at most this: k + 0.5 needs 25 bits, and k = 2^24 - 1 rounds to u = 1, whose
# noise -log(-log u) is infinite (that entry won whatever its logit: about V / 2^24 of a coupled row's tokens)


def _wrap(x):
    """An int64 tensor as it is (torch wraps like C), or a Python int reduced to a signed int64."""
    return x if isinstance(x, torch.Tensor) else ((x + (1 << 63)) & _U64) - (1 << 63)


def _shr(x, n: int):
    """Logical right shift of an int64 (torch's and Python's ``>>`` are arithmetic)."""
    return (x >> n) & ((1 << (64 - n)) - 1)


def mix64(x):
    """SplitMix64's finaliser on an int64 tensor or a Python int (as a signed int64; a Python int is ~20x cheaper
    than through a tensor): a bijection that scrambles every input bit into every output bit."""
    x = _wrap((x ^ _shr(x, 30)) * _M1)
    x = _wrap((x ^ _shr(x, 27)) * _M2)
    return x ^ _shr(x, 31)


def mix_key(seed: int, counter: int) -> int:
    """Host-side mixing of two Python ints into one int64 key (a row's stream for one step): :func:`mix64` of
    ``(seed * 0x9E3779B1 + counter) mod 2^63 + GOLDEN``."""
    return mix64(_wrap(((seed * 0x9E3779B1 + counter) & ((1 << 63) - 1)) + GOLDEN))


def _to_unit(x: torch.Tensor) -> torch.Tensor:
    """The top UNIFORM_BITS of int64 hashes as float32 uniforms (k + 0.5) / 2^24, at most UNIFORM_MAX."""
    k = _shr(x, 64 - UNIFORM_BITS)
    return ((k.to(torch.float32) + 0.5) * (1.0 / (1 << UNIFORM_BITS))).clamp_(max=UNIFORM_MAX)


def uniform(keys: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """[B, *shape] float32 uniforms in (0, 1): entry (b, i...) is a function of ``keys[b]`` and the flat index i.

    Shapes: keys [B] int64 (on the output's device) -> [B, *shape]. On the CPU one C++ pass (``rng_uniform``,
    csrc/rng_cpu.cpp: a V-wide row of the coupling's noise in ~1/10 of the dozen torch ops below), bit for bit.
    """
    n = 1
    for s in shape:
        n *= s
    if keys.device.type == "cpu" and keys.dtype == torch.int64:
        from spec_kernels._ext import load_ext

        load_ext()
        return torch.ops.spec_kernels.rng_uniform(keys, n).view(keys.shape[0], *shape)
    return uniform_ref(keys, n).view(keys.shape[0], *shape)


def uniform_ref(keys: torch.Tensor, n: int) -> torch.Tensor:
    """:func:`uniform` in torch ops, any device: [B] int64 keys -> [B, n]."""
    counters = torch.arange(n, device=keys.device, dtype=torch.int64)  # [n]
    x = mix64(mix64(keys[:, None] + GOLDEN) + counters * GOLDEN)  # [B, n]
    return _to_unit(x)


def gumbel(keys: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """[B, *shape] standard Gumbel noise, -log(-log u), from :func:`uniform`. On the CPU one C++ pass
    (``rng_gumbel``), its log exact to ~2 ulp and the same float on every path (csrc/rng_cpu.h: the native steps'
    sampled rows compute single entries of it, which torch.log's vector body and scalar tail would not match)."""
    if keys.device.type == "cpu" and keys.dtype == torch.int64:
        from spec_kernels._ext import load_ext

        load_ext()
        n = 1
        for s in shape:
            n *= s
        return torch.ops.spec_kernels.rng_gumbel(keys, n).view(keys.shape[0], *shape)
    return -torch.log(-torch.log(uniform(keys, shape)))


def noise_keys(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[B, T] int64 keys of the coupling's noise at ``positions`` [B, T] for rows with request ``seeds`` [B] int64."""
    return mix64(mix64(seeds)[:, None] + positions * GOLDEN)


def position_uniform(seeds: torch.Tensor, positions: torch.Tensor, V: int) -> torch.Tensor:
    """[B, T, V] the uniforms U(s, t, x) behind :func:`position_gumbel`."""
    B, T = positions.shape
    return uniform(noise_keys(seeds, positions).reshape(-1), (V,)).view(B, T, V)


def position_gumbel(seeds: torch.Tensor, positions: torch.Tensor, V: int) -> torch.Tensor:
    """[B, T, V] the coupling's Gumbel noise g_t(x) = -log(-log U(s, t, x)) for every row and position in
    ``positions`` [B, T]: a pure function of (seed, position, x), whatever the batch, step or drafter."""
    B, T = positions.shape
    return gumbel(noise_keys(seeds, positions).reshape(-1), (V,)).view(B, T, V)


def row_uniforms(seeds: torch.Tensor, n: int) -> torch.Tensor:
    """[B] int seeds -> [B, n] float32 uniforms in [0, 1), counter-based: mix64(seed * GOLDEN + (i + 1) * C) with
    C = 0xD1B54A32D192ED03, top 24 bits. Element (b, i) depends on seeds[b] and i only: not on B, n or the row's place
    in the batch. (verify_tree's per-row streams: a separate sequence from :func:`uniform`'s.)"""
    counters = torch.arange(1, n + 1, device=seeds.device, dtype=torch.int64)  # [n]
    x = mix64(seeds.to(torch.int64)[:, None] * GOLDEN + counters * _wrap(0xD1B54A32D192ED03))  # [B, n]
    return _shr(x, 64 - UNIFORM_BITS).to(torch.float32) * (1.0 / (1 << UNIFORM_BITS))
