"""decoder_layers with Gemma's layer (``LayerVariant``: sliding windows, a query scale, soft-capped scores, GELU-tanh,
float32 sandwich norms, a local RoPE): the native C++ stack against the float64 reference, tree nodes bitwise plain
decoding's with a window that binds, and the variant's errors. The model-level parity with HF is tests/test_families.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_decoder_layers import CONFIGS, EPS, LAYERS, H, make_problem, make_weights, rope_rows

from spec_kernels.decoder_layers import LayerVariant, decoder_layers
from spec_kernels.decoder_layers.ref import LAYER_FIELDS, decoder_layers_ref

# layer 0 slides over 4 positions (it binds: the prefixes below are longer), layer 1 sees everything
GEMMA = LayerVariant(windows=(4, 0), softmax_scale=0.3, softcap=1.5, activation="gelu_tanh", float32_norms=True)


def gemma_weights(name, seed=0):
    """make_weights' layers with float32 sandwich norms (Gemma's 1 + w)."""
    Hq, Hkv, D, bias, qk_norm = CONFIGS[name]
    weights, final_norm = make_weights(Hq, Hkv, D, bias, qk_norm, seed)
    g = torch.Generator().manual_seed(seed + 7)
    n = len(LAYER_FIELDS)
    for i in range(LAYERS):
        for field in ("attn_out_norm", "mlp_out_norm"):
            weights[i * n + LAYER_FIELDS.index(field)] = 1 + 0.2 * torch.randn(H, generator=g)
    return weights, final_norm


def run(backend, weights, final_norm, hidden, kv, lens, rope, mask, table, Hq, dtype, variant=GEMMA, local=None):
    """Matrices in dtype, norms in float32 (float64 for the exact reference), as a Gemma model holds them."""
    norm_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    cast = [None if w is None else w.to(norm_dtype if w.dim() == 1 else dtype) for w in weights]
    kv = kv.to(dtype).clone()
    local = None if local is None else local.to(dtype)
    out = (decoder_layers_ref if backend == "ref" else decoder_layers)(
        hidden.to(dtype), cast, final_norm.to(norm_dtype), kv, lens, rope.to(dtype), mask, num_heads=Hq, eps=EPS,
        block_table=table, variant=variant, rope_local=local, **({} if backend == "ref" else {"backend": backend}),
    )  # fmt: skip
    return out, kv


def local_rope(lens, mask, D):
    """The sliding layers' own RoPE (another base, as Gemma 3's local layers)."""
    positions = lens.long()[:, None] + mask.sum(-1) - 1
    inv = 1.0 / (100 ** (torch.arange(0, D, 2).float() / D))
    emb = torch.cat((positions.float()[..., None] * inv,) * 2, dim=-1)
    return torch.stack((emb.cos(), emb.sin()))


@pytest.mark.parametrize("name", ["llama_gqa", "qwen3_qk_norm", "mha"])
@pytest.mark.parametrize("cache_seqlens, T, mask", [([9, 2, 6], 5, "tree"), ([7], 12, "causal")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_gemma_matches_float64_reference(name, cache_seqlens, T, mask, dtype):
    Hq, Hkv, D, *_ = CONFIGS[name]
    weights, final_norm = gemma_weights(name)
    hidden, kv, lens, rope, tree, table = make_problem(Hq, Hkv, D, cache_seqlens, T, paged=True, mask=mask)
    local = local_rope(lens, tree, D)
    problem = (hidden, kv, lens, rope, tree, table, Hq)
    if dtype == torch.bfloat16:  # the exact result of the bfloat16 inputs
        hidden, kv, rope, local = hidden.bfloat16(), kv.bfloat16(), rope.bfloat16(), local.bfloat16()
        weights = [w if w is None or w.dim() == 1 else w.bfloat16() for w in weights]  # (norms stay float32)
    exact, _ = run("ref", weights, final_norm, hidden, kv, lens, rope, tree, table, Hq, torch.float64, local=local)
    same, _ = run("ref", weights, final_norm, *problem, dtype, local=local)
    native, _ = run("native", weights, final_norm, *problem, dtype, local=local)
    err_torch = (same.double() - exact).abs().max().item()
    err_native = (native.double() - exact).abs().max().item()
    assert err_native <= 2 * err_torch + (1e-5 if dtype == torch.float32 else 1e-3), (err_native, err_torch)
    if dtype != torch.float32:
        return
    # each part of the variant moves the output here (so a native path that dropped one would fail above)
    for part in (dict(windows=None), dict(softcap=None), dict(softmax_scale=None), dict(activation="silu")):
        other, _ = run("native", weights, final_norm, *problem, dtype, variant=dataclasses.replace(GEMMA, **part),
                       local=local)  # fmt: skip
        assert (other.double() - native.double()).abs().max() > 10 * err_native + 1e-3, part
    no_local, _ = run("native", weights, final_norm, *problem, dtype)
    assert (no_local.double() - native.double()).abs().max() > 10 * err_native + 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["llama_gqa", "mha"])  # (mha: D 32, several rows a KV head: row sets, windowed)
def test_gemma_tree_nodes_equal_plain_decoding_bitwise(name, dtype):
    """A tree whose node indices are not its depths (node 2 at depth 1, node 3 at depth 2), verified in one pass
    over prefixes longer than layer 0's window: each node's hidden state is bitwise the one plain decoding of its
    path gives it. A window counted from the node's index instead of its depth would see other positions."""
    Hq, Hkv, D, *_ = CONFIGS[name]
    weights, final_norm = gemma_weights(name)
    parents = [-1, 0, 0, 2, 1, 3, 3, 5]
    T, B = len(parents), 2
    hidden, kv, lens, _, _, table = make_problem(Hq, Hkv, D, [9, 13], T, paged=True, mask="causal")
    tree = torch.zeros(T, T, dtype=torch.bool)
    for i, p in enumerate(parents):
        tree[i] = tree[p] if p >= 0 else tree[i]
        tree[i, i] = True
    tree = tree.expand(B, T, T).clone()
    depth = tree.sum(-1) - 1  # [B, T]
    rope, local = rope_rows(lens.long()[:, None] + depth, D), local_rope(lens, tree, D)
    together, _ = run("native", weights, final_norm, hidden, kv, lens, rope, tree, table, Hq, dtype, local=local)
    for leaf in (4, 6, 7):
        path = [leaf]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        path.reverse()
        cache = kv.to(dtype).clone()
        for step, node in enumerate(path):  # plain decoding of the path, the cache growing by one
            one = torch.ones(B, 1, 1, dtype=torch.bool)
            at = lens + step
            out, cache = run("native", weights, final_norm, hidden[:, node : node + 1], cache, at,
                             rope[:, :, node : node + 1], one, table, Hq, dtype,
                             local=local[:, :, node : node + 1])  # fmt: skip
            assert torch.equal(out[:, 0], together[:, node]), (leaf, node)


@pytest.mark.parametrize("lens", [[4], [6]])
def test_a_row_that_sees_no_node_under_a_window(lens):
    """A mask row with no node (depth -1: the prefix alone, from L - window) under a window that binds: the native
    stack widens that position too (it read an unwritten one before) and matches the reference."""
    Hq, Hkv, D, *_ = CONFIGS["d80_group5"]
    weights, final_norm = gemma_weights("d80_group5")
    hidden, kv, lens, rope, tree, table = make_problem(Hq, Hkv, D, lens, 4, paged=True, mask="causal")
    tree[:, 3] = False
    exact, _ = run("ref", weights, final_norm, hidden, kv, lens, rope, tree, table, Hq, torch.float64)
    native, _ = run("native", weights, final_norm, hidden, kv, lens, rope, tree, table, Hq, torch.float32)
    torch.testing.assert_close(native.double(), exact, rtol=1e-4, atol=1e-4)


def test_layer_weights_take_float32_norms_beside_any_matrices():
    """The native op takes float32 norm vectors beside bfloat16 matrices (Gemma's 1 + w); with no dense matrix (a
    GGUF file's blocks and float32 norms) either dtype of activations; mixed dense dtypes, none."""
    from spec_kernels.decoder_layers import LayerWeights

    matrix, norm = torch.ones(4, 4, dtype=torch.bfloat16), torch.ones(4)
    assert LayerWeights([norm, matrix]).takes(torch.bfloat16) and not LayerWeights([norm, matrix]).takes(torch.float32)
    assert LayerWeights([norm, None]).takes(torch.bfloat16) and LayerWeights([norm]).takes(torch.float32)
    assert not LayerWeights([matrix, torch.ones(4, 4)]).takes(torch.bfloat16)
    layers = LayerWeights([norm, matrix.clone()])
    layers[1].data = layers[1].data.float()  # (as Module.to converts a parameter in place)
    assert not layers.takes(torch.bfloat16)


def test_variant_errors_are_clear():
    Hq, Hkv, D, *_ = CONFIGS["llama_gqa"]
    weights, final_norm = gemma_weights("llama_gqa")
    hidden, kv, lens, rope, tree, table = make_problem(Hq, Hkv, D, [3, 4], 2, paged=True)
    kwargs = dict(num_heads=Hq, eps=EPS, block_table=table)
    with pytest.raises(ValueError, match="windows has 1 entries for 2 layers"):
        decoder_layers(hidden, weights, final_norm, kv, lens, rope, tree, **kwargs, variant=LayerVariant(windows=(4,)))
    with pytest.raises(ValueError, match="activation"):
        LayerVariant(activation="relu")
    with pytest.raises(ValueError, match="softcap"):
        LayerVariant(softcap=0.0)
    with pytest.raises(ValueError, match="rope_local must be like rope"):
        decoder_layers(hidden, weights, final_norm, kv, lens, rope, tree, **kwargs, rope_local=rope[:, :1])
    half = [w.bfloat16() if w is not None and w.dim() == 1 and w is weights[0] else w for w in weights]
    with pytest.raises(TypeError, match="input_norm must be Float like hidden, got BFloat16"):
        decoder_layers(hidden, half, final_norm, kv, lens, rope, tree, **kwargs, backend="native")
    uneven = list(weights)
    uneven[len(LAYER_FIELDS) + LAYER_FIELDS.index("mlp_out_norm")] = None
    with pytest.raises(ValueError, match="mlp_out_norm must be given in every layer or in none"):
        decoder_layers(hidden, uneven, final_norm, kv, lens, rope, tree, **kwargs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_runner_tree_pass_equals_the_layers_op(tmp_path, dtype):
    """Gemma 3's native handle (the step runners' forwards: the embedding's scale, the variant, the local RoPE table)
    gives a tree's nodes the hidden states ``decoder_layers`` gives them, bit for bit: the streams entering the last
    layer of a 6-node tree whose indices are not its depths, after a 20-token prefix (past the window of 8)."""
    from tiny_models import make_model

    from spec_engine.models import load_model
    from spec_kernels.decoder_layers import tree_step

    # (hidden 48: sqrt(48) scales the embedding inexactly, so its rounding shows)
    model = load_model(make_model(tmp_path / "g3", "gemma3", layers=6, hidden=48, norm_noise=0.2), dtype=dtype).fuse(64)
    assert model.native is not None and model.native.variant.windows == (8, 8, 8, 8, 8, 0)
    cfg, L, last = model.config, 20, 5
    kv = torch.zeros(cfg.num_hidden_layers, 2, 1, 64, cfg.num_key_value_heads, cfg.head_dim, dtype=dtype)
    prompt = torch.randint(0, cfg.vocab_size, (1, L), generator=torch.Generator().manual_seed(3))
    causal = torch.ones(1, L, L, dtype=torch.bool).tril()
    model(prompt, torch.arange(L)[None], kv, torch.zeros(1, dtype=torch.int32), causal)  # the prefix's K/V
    parents = torch.tensor([[-1, 0, 0, 2, 1, 3]])
    T = parents.shape[1]
    tokens = torch.randint(0, cfg.vocab_size, (1, T), generator=torch.Generator().manual_seed(4))
    mask = torch.zeros(1, T, T, dtype=torch.bool)
    for i in range(T):
        j = i
        while j >= 0:
            mask[0, i, j], j = True, int(parents[0, j])
    lens = torch.tensor([L], dtype=torch.int32)
    positions = L + mask.sum(-1) - 1  # [1, T]
    _, want = model._decoder(tokens, positions, kv.clone(), lens, mask, None, capture=[last])
    result = tree_step(model.native, tokens, parents, lens, kv.clone(), capture=[last])
    assert result is not None
    assert torch.equal(result[1], want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_runner_plain_steps_equal_regular_steps(tmp_path, dtype):
    """Gemma 3's plain steps in one native call (``plain_steps``: a token a forward, its window binding past 8
    positions) give the tokens regular steps (``decoder_layers`` and the logits' argmax, one step at a time) give."""
    from tiny_models import make_model

    from spec_engine.models import load_model
    from spec_kernels.decoder_layers import plain_steps

    path = make_model(tmp_path / "g3", "gemma3", layers=6, hidden=48, norm_noise=0.2, logit_scale=4.0)
    model = load_model(path, dtype=dtype).fuse(64)
    cfg, L, K = model.config, 12, 16
    kv = torch.zeros(cfg.num_hidden_layers, 2, 1, 64, cfg.num_key_value_heads, cfg.head_dim, dtype=dtype)
    prompt = torch.randint(0, cfg.vocab_size, (1, L + 1), generator=torch.Generator().manual_seed(5))
    causal = torch.ones(1, L, L, dtype=torch.bool).tril()
    model(prompt[:, :L], torch.arange(L)[None], kv, torch.zeros(1, dtype=torch.int32), causal)  # the prefix's K/V
    native = plain_steps(prompt[:, L], model.native, kv.clone(), torch.tensor([L], dtype=torch.int32), steps=K)
    regular, cache, token = [], kv.clone(), prompt[:, L : L + 1]
    for d in range(K):
        one = torch.ones(1, 1, 1, dtype=torch.bool)
        hidden = model(token, torch.tensor([[L + d]]), cache, torch.tensor([L + d], dtype=torch.int32), one)
        token = model.logits(hidden)[:, -1].argmax(-1, keepdim=True)
        regular.append(int(token))
    assert native[0].tolist() == regular


def test_softcap_is_tanh_within_two_ulps():
    """``softcap`` (the C++ function every CPU path caps Gemma 2's logits and scores with): cap tanh(z / cap) within
    2 ulp of float64's on both of tanh's branches (below and above |z / cap| = 0.625), odd bit for bit, +-inf, NaN
    and zeros kept, bfloat16 read as float32; the reference (torch's tanh) within the same."""
    from spec_kernels.fused_elementwise import softcap
    from spec_kernels.fused_elementwise.ref import softcap_ref

    z = torch.linspace(-400, 400, 100_001)  # [N]
    for cap in (5.0, 30.0):
        got = softcap(z, cap)
        exact = torch.tanh(z.double() / cap) * cap
        nonzero = z != 0
        rel = ((got.double() - exact).abs() / exact.abs())[nonzero]
        assert rel.max() <= 2 * 2**-23, (cap, rel.max())
        assert torch.equal(softcap(-z, cap), -got)
        torch.testing.assert_close(softcap_ref(z, cap), got, rtol=4 * 2**-23, atol=0)
    special = torch.tensor([float("inf"), -float("inf"), float("nan"), 0.0, -0.0])
    out = softcap(special, 30.0)
    assert out[:2].tolist() == [float("inf"), -float("inf")] and out[2].isnan() and out[3:].tolist() == [0.0, 0.0]
    half = torch.randn(7, 33, generator=torch.Generator().manual_seed(0)).bfloat16() * 40
    assert torch.equal(softcap(half, 30.0), softcap(half.float(), 30.0))
    assert torch.equal(softcap(z, 5.0, backend="torch"), softcap_ref(z, 5.0))
    meta = softcap(torch.empty(3, 9, device="meta", dtype=torch.bfloat16), 30.0, backend="native")
    assert meta.shape == (3, 9) and meta.dtype == torch.float32  # the op's Meta kernel
    for cap in (0.0, float("inf")):
        with pytest.raises(ValueError, match="cap must be finite and > 0"):
            softcap(z, cap)
    with pytest.raises(ValueError, match="takes float32 / bfloat16 CPU"):
        softcap(z.double(), 5.0, backend="native")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("mode", ["greedy", "seeded", "saturated"])
def test_gemma2_native_steps_read_the_capped_logits(tmp_path, monkeypatch, dtype, mode):
    """Gemma 2 on the native step runners: plain chains (``plain_steps``) emit the tokens one-token regular steps
    emit, and a draft model's greedy speculative chains (``spec_chain``) the steps, drafts and acceptances of
    regular speculative steps; greedy, seeded (top-p), and with a cap that saturates (0.05: the largest logits all
    cap to one value, so the first of them wins, not the largest: an argmax that skipped the cap would differ). The
    runners argmax and sample through the C++ cap ``GemmaForCausalLM.logits`` applies. Planted bug: the handles
    built without the cap change the tokens (seeded, saturated)."""
    from test_native_steps import STEP_METRICS
    from tiny_models import make_model, make_noisy_copy

    import spec_engine.models.gemma as gemma_mod
    from spec_engine import LLM, SamplingParams
    from spec_engine.engine import EngineConfig
    from spec_engine.step import PLAIN_CHAIN, REGULAR, SPEC_CHAIN

    cap = 0.05 if mode == "saturated" else 5.0
    target = make_model(tmp_path / "g2", "gemma2", layers=3, norm_noise=0.2, logit_scale=4.0,
                        final_logit_softcapping=cap)  # fmt: skip
    draft = make_noisy_copy(target, tmp_path / "draft", noise=0.05)
    prompts = [{"prompt_token_ids": p} for p in ([5, 17, 3, 60, 42, 7, 5, 17, 3], [1, 2, 3, 4, 1, 2], [77])]
    sampled = {"temperature": 0.8, "seed": 3, "top_p": 0.9} if mode == "seeded" else {}
    params = SamplingParams(max_tokens=24, ignore_eos=True, **sampled)

    def run(llm, **config):
        llm.engine.reconfigure(EngineConfig(**config))
        llm.engine.plan_history.clear()
        out = llm.generate(prompts, params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in out], out, {p.path for p in llm.engine.plan_history}

    llm = LLM(str(target), dtype=dtype)
    assert llm.engine.runner.native_target is not None and llm.target.config.final_logit_softcapping == cap
    want, _, paths = run(llm, plain_chain=1)
    assert paths == {REGULAR}
    got, _, paths = run(llm, plain_chain=16)
    assert PLAIN_CHAIN in paths and got == want
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}
    speculative = LLM(str(target), dtype=dtype, speculative_config=spec)
    regular, ref, _ = run(speculative, spec_chain_steps=0)
    got, out, paths = run(speculative, spec_chain_steps=4)
    assert regular == got == want and sum(o.metrics["num_accepted"] for o in out) > 0
    if not sampled:  # (a draft model's sampled rows take regular steps)
        assert SPEC_CHAIN in paths
        for a, b in zip(out, ref):
            assert {k: a.metrics[k] for k in STEP_METRICS} == {k: b.metrics[k] for k in STEP_METRICS}
    if mode != "greedy":  # the planted bug: the runners read the logits uncapped
        real = gemma_mod.native_model
        monkeypatch.setattr(gemma_mod, "native_model", lambda *a, **kw: real(*a, **{**kw, "final_softcap": 0.0}))
        assert run(LLM(str(target), dtype=dtype), plain_chain=16)[0] != want
