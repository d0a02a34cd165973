"""Inputs that crashed a kernel (a fuzzing pass over spec_kernels' public ops: segfaults, an out-of-bounds read,
ids wrapped to another sequence's blocks) are refused with a clear error instead; and the step runners' ops work in
a fresh process, before anything else loaded the extension."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from spec_kernels import compact_kv_, linear, tree_attention
from spec_kernels._ext import load_ext
from spec_kernels._sampling import sample_from_weights


def test_compact_kv_refuses_a_node_whose_slot_overflows_and_block_ids_past_int32():
    cache, table = torch.zeros(2, 6, 4, 2, 4), torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    with pytest.raises(ValueError, match="past the cache"):
        compact_kv_(cache, torch.tensor([1, 2]), torch.tensor([[0, 2**63 - 1], [0, 1]]), torch.tensor([2, 2]),
                    block_table=table)  # fmt: skip
    with pytest.raises(ValueError, match="ids an int32 cannot"):  # (2^32 was read as block 0)
        compact_kv_(cache, torch.tensor([1, 2]), torch.tensor([[0, 2, 3], [0, 1, -1]]), torch.tensor([3, 2]),
                    block_table=torch.tensor([[2**32, 1], [2, 3]]))  # fmt: skip


@pytest.mark.parametrize("bad", [5, 10**6, -1])
@pytest.mark.parametrize("backend", ["triton", None])
def test_tree_attention_refuses_block_ids_outside_the_cache(bad, backend):
    q, k, v = torch.randn(2, 3, 4, 8), torch.randn(5, 4, 2, 8), torch.randn(5, 4, 2, 8)  # 5 blocks of 4 slots
    cache_seqlens, mask = (
        torch.tensor([2, 4], dtype=torch.int32),
        torch.ones(3, 3, dtype=torch.bool).tril().expand(2, 3, 3),
    )
    table = torch.tensor([[0, 1], [2, bad]], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"block_table holds ids outside \[0, num_blocks = 5\)"):
        tree_attention(q, k, v, cache_seqlens, mask.clone(), block_table=table, backend=backend)


def test_verify_greedy_refuses_an_empty_tree():
    load_ext()
    with pytest.raises(ValueError, match="T >= 1"):
        torch.ops.spec_kernels.verify_greedy(torch.randn(2, 0, 8), torch.zeros(2, 0, dtype=torch.long),
                                             torch.zeros(2, 0, dtype=torch.long))  # fmt: skip


def test_the_triton_linear_refuses_shapes_and_devices_it_would_read_past():
    with pytest.raises(ValueError, match=r"x \[\.\.\., K\]"):
        linear(torch.ones(1, 16), torch.ones(2, 8), backend="triton")  # (K 16 against a weight of K 8)
    with pytest.raises(ValueError, match="bias"):
        linear(torch.ones(1, 8), torch.ones(2, 8), torch.ones(1), backend="triton")


def test_a_draw_from_nan_weights_is_still_an_id():
    w = torch.full((2, 4), float("nan"))
    assert int(sample_from_weights(w, torch.tensor([0.3, 0.9])).max()) <= 3


def test_the_step_runners_ops_load_the_extension_in_a_fresh_process(tmp_path):
    """``plain_steps`` (and its siblings) looked ``torch.ops.spec_kernels.plain_steps`` up before the model's
    handle loaded the extension: in a fresh process every call failed with an AttributeError."""
    from tiny_models import make_model

    path = make_model(tmp_path / "m", "llama_gqa")
    code = f"""
import torch
from spec_engine.models import load_model
from spec_kernels.decoder_layers import plain_steps
m = load_model({str(path)!r}).fuse(max_positions=64)
kv = torch.zeros(m.config.num_hidden_layers, 2, 4, 16, m.config.num_key_value_heads, m.config.head_dim)
out = plain_steps(torch.tensor([1]), m.native, kv, torch.tensor([0], dtype=torch.int32), steps=3,
                   block_table=torch.tensor([[1]], dtype=torch.int32))
print(tuple(out.shape))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().endswith("(1, 3)")
