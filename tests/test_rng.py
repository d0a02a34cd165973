"""The coupling's Gumbel noise on the CPU (``rng_gumbel``, csrc/rng_cpu.h): close to -log(-log u) in float64, and the
same float for an entry whichever shape, batch or path computes it (the native steps' sampled rows compute single
entries of it, the regular step whole rows)."""

from __future__ import annotations

import pytest
import torch

from spec_kernels import rng


def test_gumbel_is_minus_log_minus_log_of_the_uniforms():
    keys = torch.tensor([3, -7, 1 << 40], dtype=torch.int64)
    u = rng.uniform(keys, (5000,)).double()
    exact = -torch.log(-torch.log(u))  # float64
    g = rng.gumbel(keys, (5000,))
    assert g.dtype == torch.float32 and g.shape == (3, 5000)
    ulp = torch.finfo(torch.float32).eps * exact.abs().clamp(min=1.0)
    assert bool(((g.double() - exact).abs() <= 4 * ulp).all())
    assert float(g.max()) <= 17.33 and float(g.min()) >= -2.86  # the bounds perturbed_argmax relies on


@pytest.mark.parametrize("n", [1, 7, 8, 15, 16, 33, 4097])
def test_an_entry_is_the_same_float_in_any_shape(n):
    """Entry i of a key's row is one float whether the row has n entries or more, alone or in a batch: the vector
    body and the scalar tail compute it alike."""
    keys = torch.tensor([11, 12], dtype=torch.int64)
    full = rng.gumbel(keys, (4100,))
    assert torch.equal(rng.gumbel(keys, (n,)), full[:, :n])
    assert torch.equal(rng.gumbel(keys[1:], (n,))[0], full[1, :n])


def test_position_gumbel_is_gumbel_of_the_noise_keys():
    seeds = torch.tensor([5, 9], dtype=torch.int64)
    positions = torch.tensor([[0, 3], [17, 18]], dtype=torch.int64)
    g = rng.position_gumbel(seeds, positions, 64)  # [B, T, V]
    keys = rng.noise_keys(seeds, positions)  # [B, T]
    for b in range(2):
        for t in range(2):
            assert torch.equal(g[b, t], rng.gumbel(keys[b, t, None], (64,))[0])
    u = rng.position_uniform(seeds, positions, 64).double()
    assert torch.allclose(g.double(), -torch.log(-torch.log(u)), rtol=1e-6, atol=1e-6)


def test_no_uniform_reaches_one():
    """(k + 0.5) / 2^24 rounds to 1 at k = 2^24 - 1, whose noise was infinite (the entry won whatever its logit);
    the uniforms stop at 1 - 2^-24. Seed 7 at position 3694 draws that k at entry 3509 of 4096."""
    seeds, positions = torch.tensor([7]), torch.tensor([[3694]])
    u = rng.position_uniform(seeds, positions, 4096)[0, 0]
    assert float(u[3509]) == rng.UNIFORM_MAX and float(u.max()) < 1.0
    ref = rng.uniform_ref(rng.noise_keys(seeds, positions).reshape(-1), 4096)[0]  # the torch ops, any device
    assert torch.equal(ref, u)
    g = rng.position_gumbel(seeds, positions, 4096)[0, 0]
    assert 16.6 < float(g[3509]) <= 16.64 and bool(torch.isfinite(g).all())


def test_the_ops_trace_on_meta():
    from spec_kernels._ext import load_ext

    load_ext()
    for op in (torch.ops.spec_kernels.rng_uniform, torch.ops.spec_kernels.rng_gumbel):
        out = op(torch.zeros(3, dtype=torch.int64, device="meta"), 5)
        assert out.device.type == "meta" and out.shape == (3, 5) and out.dtype == torch.float32


def test_bad_keys_raise():
    from spec_kernels._ext import load_ext

    load_ext()
    with pytest.raises(RuntimeError, match="keys must be"):
        torch.ops.spec_kernels.rng_gumbel(torch.zeros(2, 2, dtype=torch.int64), 4)
    with pytest.raises(RuntimeError, match="n must be"):
        torch.ops.spec_kernels.rng_gumbel(torch.zeros(2, dtype=torch.int64), -1)


def test_every_instruction_set_draws_the_same_floats(tmp_path):
    """The AVX-512, AVX2 and scalar paths (``SPECDEC_CPU_ISA`` caps the one a process takes) give the same noise."""
    import os
    import subprocess
    import sys

    script = ("import sys, torch\nfrom spec_kernels import rng\n"
              "torch.save(rng.gumbel(torch.tensor([3, -7, 1 << 40]), (4100,)), sys.argv[1])\n")  # fmt: skip
    draws = []
    for isa in ("avx512", "avx2", "scalar"):
        out = tmp_path / f"{isa}.pt"
        subprocess.run([sys.executable, "-c", script, str(out)], check=True, env={**os.environ, "SPECDEC_CPU_ISA": isa})
        draws.append(torch.load(out))
    assert torch.equal(draws[0], draws[1]) and torch.equal(draws[0], draws[2])
