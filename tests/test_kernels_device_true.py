"""Every public op on ``meta`` tensors: the GPU path with no GPU, proven free of host syncs.

Meta tensors support every op and view but raise on any read of data (``.item()``, ``.tolist()``, ``bool(t)``) and
on a CPU/meta mix. With ``backend=None`` an op takes the same path on meta as on CUDA (launcher checks, then the
custom op, which returns its fake output), so an op that completes here reads nothing on the host on CUDA either.
"""

from __future__ import annotations

import importlib

import pytest
import torch

import spec_kernels._ext as ext
from spec_kernels import compact_kv_, plan_tree_attention, tree_attention, verify_tree
from spec_kernels._backend import resolve_backend

pytest.importorskip("triton")

META = torch.device("meta")
B, T, HQ, HKV, D, V = 3, 5, 4, 2, 16, 37
BLOCK_SIZE, MAX_BLOCKS, S = 4, 6, 24


@pytest.fixture(autouse=True)
def _no_debug_checks(monkeypatch):
    monkeypatch.delenv("SPECDEC_DEBUG_CHECKS", raising=False)


def _attention_inputs(dtype: torch.dtype, paged: bool, device=META) -> dict:
    if paged:
        cache_shape = (B * MAX_BLOCKS, BLOCK_SIZE, HKV, D)
        block_table = torch.empty(B, MAX_BLOCKS, dtype=torch.int32, device=device)
    else:
        cache_shape, block_table = (B, S, HKV, D), None
    return dict(
        q=torch.empty(B, T, HQ, D, dtype=dtype, device=device),
        k_cache=torch.empty(cache_shape, dtype=dtype, device=device),
        v_cache=torch.empty(cache_shape, dtype=dtype, device=device),
        cache_seqlens=torch.empty(B, dtype=torch.int32, device=device),
        tree_mask=torch.empty(B, T, T, dtype=torch.bool, device=device),
        block_table=block_table,
    )


def test_meta_takes_the_device_path():
    assert resolve_backend("tree_attention", None, META) == "triton"
    assert resolve_backend("tree_attention", "triton", META) == "triton"
    assert resolve_backend("compact_kv_", None, META, has_triton=False) == "native"
    assert resolve_backend("tree_attention", None, torch.device("cpu")) == "native"


@pytest.mark.parametrize("backend", [None, "triton"])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_tree_attention_on_meta(dtype, paged, backend):
    a = _attention_inputs(dtype, paged)
    plan = plan_tree_attention(
        a["k_cache"], a["cache_seqlens"], a["tree_mask"], num_q_heads=HQ, block_table=a["block_table"], backend=backend
    )
    assert plan.cache_seqlens.device == META and plan.tree_keys.device == META  # the Triton path's plan, on the device
    for shared in (None, plan):
        out = tree_attention(
            a["q"], a["k_cache"], a["v_cache"], a["cache_seqlens"], a["tree_mask"], block_table=a["block_table"],
            backend=backend, plan=shared,
        )  # fmt: skip
        assert out.device == META and out.shape == (B, T, HQ, D) and out.dtype == dtype


def test_tree_attention_native_refuses_meta():
    a = _attention_inputs(torch.float32, False)
    with pytest.raises(RuntimeError, match="CPU path"):
        tree_attention(*(a[k] for k in ("q", "k_cache", "v_cache", "cache_seqlens", "tree_mask")), backend="native")


def _verify_inputs(with_draft: bool, logits_dtype=torch.float32, device=META) -> tuple[tuple, dict]:
    logits = torch.empty(B, T, V, dtype=logits_dtype, device=device)
    tokens = torch.empty(B, T, dtype=torch.int64, device=device)
    parents = torch.empty(B, T, dtype=torch.int64, device=device)
    probs = torch.empty(B, T, V, dtype=torch.float32, device=device) if with_draft else None
    return (logits, tokens, parents), {"draft_probs": probs}


SAMPLED = {
    "greedy": lambda: {"temperature": torch.zeros(B, device=META)},
    "greedy_scalar": lambda: {"temperature": 0.0},
    "sampled_int_seed": lambda: {"temperature": torch.ones(B, device=META), "seed": 7},
    "filtered_row_seeds": lambda: {
        "temperature": torch.ones(B, device=META),
        "top_k": torch.zeros(B, dtype=torch.int64, device=META),
        "top_p": torch.ones(B, device=META),
        "min_p": torch.zeros(B, device=META),
        "seed": torch.zeros(B, dtype=torch.int64, device=META),
    },
    "filtered_scalars": lambda: {"temperature": 0.7, "top_k": 5, "top_p": 0.9, "min_p": 0.05},
    "coupled_rows": lambda: {
        "temperature": torch.ones(B, device=META),
        "top_k": torch.zeros(B, dtype=torch.int64, device=META),
        "seed": torch.zeros(B, dtype=torch.int64, device=META),
        "noise_seeds": torch.zeros(B, dtype=torch.int64, device=META),
        "positions": torch.zeros(B, T, dtype=torch.int64, device=META),
        "coupled": torch.ones(B, dtype=torch.bool, device=META),
    },
    "coupled_every_row": lambda: {
        "temperature": 0.8,
        "noise_seeds": torch.zeros(B, dtype=torch.int64, device=META),
        "positions": torch.zeros(B, T, dtype=torch.int64, device=META),
    },
    "defaults_no_seed": lambda: {},
}


@pytest.mark.parametrize("params", list(SAMPLED))
@pytest.mark.parametrize("draft", ["none", "iid", "without_replacement"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_verify_tree_on_meta(dtype, draft, params):
    args, kwargs = _verify_inputs(draft != "none", dtype)
    if draft != "none":
        kwargs["draft_sampling"] = draft
    res = verify_tree(*args, **kwargs, **SAMPLED[params]())
    assert [t.device for t in res] == [META] * 3
    assert [t.dtype for t in res] == [torch.int64] * 3
    assert res.accepted_nodes.shape == (B, T) and res.output_tokens.shape == (B, T) and res.num_accepted.shape == (B,)


def test_verify_tree_native_refuses_meta():
    args, kwargs = _verify_inputs(False)
    with pytest.raises(RuntimeError, match="meta"):
        verify_tree(*args, **kwargs, backend="native")


def _compact_inputs(paged: bool, device=META) -> tuple[tuple, dict]:
    planes = 4
    if paged:
        cache = torch.empty(planes, B * MAX_BLOCKS, BLOCK_SIZE, HKV, D, device=device)
        table = {"block_table": torch.empty(B, MAX_BLOCKS, dtype=torch.int32, device=device)}
    else:
        cache, table = torch.empty(planes, B, S, HKV, D, device=device), {}
    cache_seqlens = torch.empty(B, dtype=torch.int32, device=device)
    accepted = torch.empty(B, T, dtype=torch.int64, device=device)
    num = torch.empty(B, dtype=torch.int64, device=device)
    return (cache, cache_seqlens, accepted, num), table


@pytest.mark.parametrize("backend", [None, "native"])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_compact_kv_on_meta(monkeypatch, paged, backend):
    def no_build():
        raise AssertionError("compact_kv_ on meta tensors must not need the C++ extension")

    monkeypatch.setattr(ext, "load_ext", no_build)
    args, kwargs = _compact_inputs(paged)
    assert compact_kv_(*args, **kwargs, backend=backend) is None


def test_two_devices_raise():
    a = _attention_inputs(torch.float32, True)
    a["block_table"] = torch.zeros(B, MAX_BLOCKS, dtype=torch.int32)  # CPU among meta tensors
    with pytest.raises(ValueError, match="one device"):
        tree_attention(**a)
    with pytest.raises(ValueError, match="one device"):
        plan_tree_attention(
            a["k_cache"], a["cache_seqlens"], a["tree_mask"], num_q_heads=HQ, block_table=a["block_table"]
        )

    (logits, tokens, parents), kwargs = _verify_inputs(True)
    with pytest.raises(ValueError, match="parents is on cpu"):
        verify_tree(logits, tokens, torch.zeros(B, T, dtype=torch.int64), **kwargs)
    with pytest.raises(ValueError, match="draft_probs is on cpu"):
        verify_tree(logits, tokens, parents, draft_probs=torch.zeros(B, T, V))
    with pytest.raises(ValueError, match="temperature is on cpu"):
        verify_tree(logits, tokens, parents, temperature=torch.ones(B))
    with pytest.raises(ValueError, match="seed is on cpu"):
        verify_tree(logits, tokens, parents, temperature=1.0, seed=torch.zeros(B, dtype=torch.int64))
    seeds = torch.zeros(B, dtype=torch.int64, device=META)
    with pytest.raises(ValueError, match="positions is on cpu"):
        verify_tree(logits, tokens, parents, noise_seeds=seeds, positions=torch.zeros(B, T, dtype=torch.int64))

    (cache, cache_seqlens, accepted, num), _ = _compact_inputs(False)
    with pytest.raises(ValueError, match="one device"):
        compact_kv_(cache, cache_seqlens, accepted, torch.zeros(B, dtype=torch.int64))


def test_queued_value_checks_fire(monkeypatch):
    """The device path's ``torch._assert_async`` checks, run on CPU tensors (where they raise at once)."""
    sampling = importlib.import_module("spec_kernels._sampling")
    ta = importlib.import_module("spec_kernels.tree_attention")  # the package's attribute is the function

    monkeypatch.setattr(sampling, "host_value_checks", lambda device: False)
    monkeypatch.setattr(ta, "host_value_checks", lambda device: False)
    logits = torch.zeros(1, 3, V)
    tokens = torch.tensor([[0, 1, V]])  # node 2's token is out of range
    with pytest.raises(RuntimeError, match="draft_tokens"):
        verify_tree(logits, tokens, torch.tensor([[-1, 0, 1]]), temperature=0.0, backend="native")
    a = _attention_inputs(torch.float32, False, device=torch.device("cpu"))
    a["cache_seqlens"] = torch.full((B,), S - T + 1, dtype=torch.int32)  # L_b + T overruns the cache
    with pytest.raises(RuntimeError, match="too short"):
        tree_attention(**a)


def test_debug_checks_read_values_on_the_device_path(monkeypatch):
    """``SPECDEC_DEBUG_CHECKS=1`` makes the device path read values on the host: on meta that read raises."""
    monkeypatch.setenv("SPECDEC_DEBUG_CHECKS", "1")
    args, kwargs = _verify_inputs(False)
    with pytest.raises((RuntimeError, NotImplementedError), match="meta"):
        verify_tree(*args, **kwargs)
