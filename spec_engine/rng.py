"""Counter-based random numbers on any device: a uniform is a pure function of (key, counter), with no generator state.

A drafter that samples children for B rows at once needs B independent, reproducible streams. A ``torch.Generator``
per row means one small kernel (and on CUDA, a generator object) per row; a hash of integers runs as a handful of
element-wise int64 ops over the whole ``[B, ...]`` block on the tensors' own device, never touches the host, and
gives a request the same numbers alone or in any batch. The mixer is SplitMix64's finaliser (Steele et al. 2014),
whose outputs pass BigCrush for consecutive counters; int64 multiplication wraps in torch as in C, and the right
shifts are made logical by masking off the sign extension.
"""

from __future__ import annotations

import torch

GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as a signed int64
_M1 = -4658895280553007687  # 0xBF58476D1CE4E5B9
_M2 = -7723592293110705685  # 0x94D049BB133111EB
_U64 = (1 << 64) - 1
UNIFORM_BITS = 24  # float32 holds 24 bits exactly: u = (k + 0.5) / 2^24, never 0 or 1


def _shr(x: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's ``>>`` is arithmetic)."""
    return (x >> n) & ((1 << (64 - n)) - 1)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser on an int64 tensor: a bijection that scrambles every input bit into every output bit."""
    x = (x ^ _shr(x, 30)) * _M1
    x = (x ^ _shr(x, 27)) * _M2
    return x ^ _shr(x, 31)


def mix_key(seed: int, counter: int) -> int:
    """Host-side mixing of two Python ints into one int64 key (a row's stream for one step): :func:`mix64` of
    ``(seed * 0x9E3779B1 + counter) mod 2^63 + GOLDEN`` in plain integers (~1 us, against ~20 us through a tensor)."""
    x = (((seed * 0x9E3779B1 + counter) & ((1 << 63) - 1)) + GOLDEN) & _U64
    x = ((x ^ (x >> 30)) * (_M1 & _U64)) & _U64
    x = ((x ^ (x >> 27)) * (_M2 & _U64)) & _U64
    x ^= x >> 31
    return x - (1 << 64) if x >= 1 << 63 else x  # as a signed int64


def uniform(keys: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """[B, *shape] float32 uniforms in (0, 1): entry (b, i...) is a function of ``keys[b]`` and the flat index i.

    Shapes: keys [B] int64 (on the output's device) -> [B, *shape].
    """
    n = 1
    for s in shape:
        n *= s
    counters = torch.arange(n, device=keys.device, dtype=torch.int64)  # [n]
    x = mix64(mix64(keys[:, None] + GOLDEN) + counters * GOLDEN)  # [B, n]
    k = _shr(x, 64 - UNIFORM_BITS)
    return ((k.to(torch.float32) + 0.5) * (1.0 / (1 << UNIFORM_BITS))).view(keys.shape[0], *shape)


def gumbel(keys: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """[B, *shape] standard Gumbel noise, -log(-log u), from :func:`uniform`."""
    return -torch.log(-torch.log(uniform(keys, shape)))
