"""EAGLE draft heads (spec_engine/drafters/eagle.py): lossless like every drafter, and loadable in the published
layouts.

- greedy: token for token the plain target's output, for chains, static trees, EAGLE-2's dynamic tree and adaptive
  depth, in a batch;
- seeded sampling: the same tokens as plain decoding (the position-keyed coupling);
- sampled rows: the first two tokens follow the target's exact joint distribution (chi2, as
  test_engine_sampling.py), and a planted bug (children taken greedily, reported as drawn from q) is caught;
- loading: tiny heads written name by name in the EAGLE-1 (``fc`` + ``layers.0.*``) and EAGLE-3 (``midlayer.*``,
  ``d2t``) layouts, and clear errors for heads that do not fit the target.
"""

from __future__ import annotations

import json
import lzma

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from test_engine_sampling import PROMPT, chi2_pvalue, exact_joint
from tiny_models import make_model

from spec_engine import LLM, SamplingParams
from spec_engine.drafters.eagle import EagleDrafter, EagleHead
from spec_engine.drafters.eagle_checkpoint import load_eagle_head, save_eagle_head
from spec_engine.models import ModelConfig, load_model
from spec_engine.models.llama import cache_slots
from spec_engine.training.eagle_loss import ttt_loss
from spec_engine.training.train_eagle import head_config, init_head
from spec_engine.tree import causal_mask
from spec_kernels.decoder_layers import NativeHead, eagle3_draft, plain_steps, spec_chain

PROMPTS = [[5, 17, 3, 60, 42, 7, 5, 17, 3], [1, 2, 3, 4, 1, 2], [77]]
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER = 64, 4, 2, 16, 128  # tiny_models' llama_gqa at hidden 64


def train_head(target_dir, out, *, steps: int, vocab: int, seed: int = 0):
    """A head of the recipe's variant (normed), trained briefly by its own loss on random windows."""
    target = load_model(target_dir)
    cfg = head_config(target.config, 512, None)
    head = EagleHead(ModelConfig.from_dict(cfg), "eagle", target, normed=True)
    init_head(head, seed)
    opt = torch.optim.AdamW(head.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        loss = ttt_loss(head, target, torch.randint(0, vocab, (4, 24), generator=g), 2, 0.5)
        opt.zero_grad()
        loss.backward()
        opt.step()
    save_eagle_head(head, cfg, out, dtype=torch.float32)
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle")
    target = make_model(root / "target", "llama_gqa", logit_scale=4.0)
    return target, train_head(target, root / "head", steps=4, vocab=96)


def _llm(models, spec: dict | None, **kw) -> LLM:
    target, head = models
    if spec is not None:
        spec = {"method": "eagle", "model": str(head), **spec}
    return LLM(str(target), speculative_config=spec, max_model_len=128, **kw)


def _generate(llm: LLM, params: SamplingParams) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def plain_greedy(models):
    return _generate(_llm(models, None), SamplingParams(max_tokens=24))


GREEDY = {
    "chain1": {"num_speculative_tokens": 1},
    "chain4": {"num_speculative_tokens": 4},
    "tree[2,2,1]": {"num_speculative_tokens": 3, "tree": [2, 2, 1]},
    "dynamic": {"num_speculative_tokens": 3, "tree": "dynamic"},  # EAGLE-2: 4 nodes per level, parents chosen
    "adaptive": {},
    "adaptive-dynamic": {"tree": "dynamic", "eagle_topk": 2},
}


@pytest.mark.parametrize("name", list(GREEDY))
def test_greedy_matches_plain(models, plain_greedy, name):
    llm = _llm(models, GREEDY[name])
    assert _generate(llm, SamplingParams(max_tokens=24)) == plain_greedy
    stats = llm.engine.stats
    adaptive = name.startswith("adaptive")
    assert stats["num_accepted"] > 0 if not adaptive else stats["num_drafted"] > 0  # the head really drafted


def test_adaptive_runs_the_head_over_a_prompt_only_at_its_first_drafted_step(models, monkeypatch):
    """Under the adaptive controller the head does not run over a prompt at prefill (only the target's features
    are kept): its first drafted step catches the head's cache up, in chunks, a cost the controller prices, so a row
    it never drafts never pays it. The tokens stay plain decoding's on a prompt of several catch-up chunks."""
    target, head = models
    prompt = [(7 * i + 3) % 90 + 1 for i in range(300)]
    params = SamplingParams(max_tokens=16)
    plain = LLM(str(target), max_model_len=512).generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    llm = LLM(str(target), speculative_config={"method": "eagle", "model": str(head)}, max_model_len=512)
    prefilled, fed = [], []
    real_prefill, real_prefix = EagleDrafter.prefill, EagleDrafter._forward_prefix

    def prefill(self, input_ids, *args, **kw):
        prefilled.append(input_ids.shape[1])
        return real_prefill(self, input_ids, *args, **kw)

    def forward_prefix(self, tokens, *args, **kw):
        fed.append(tokens.shape[1])
        return real_prefix(self, tokens, *args, **kw)

    monkeypatch.setattr(EagleDrafter, "prefill", prefill)
    monkeypatch.setattr(EagleDrafter, "_forward_prefix", forward_prefix)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    assert out[0].outputs[0].token_ids == plain[0].outputs[0].token_ids
    assert prefilled == []  # the prompt's features only
    assert llm.engine.stats["num_drafted"] > 0 and sum(fed) >= len(prompt) - 1  # fed at the first drafted step
    assert max(fed) <= 128  # in catch-up chunks


@pytest.mark.parametrize("tree", [[2, 1], "dynamic"], ids=["tree[2,1]", "dynamic"])
def test_seeded_sampling_matches_plain(models, tree):
    params = SamplingParams(max_tokens=24, temperature=0.8, seed=7, ignore_eos=True)
    plain = _generate(_llm(models, None), params)
    assert _generate(_llm(models, {"num_speculative_tokens": 3, "tree": tree}), params) == plain


# --- losslessness of sampled rows (chi2 against the exact joint of the first two tokens) -------------------------

V = 6
N = 3000
P_MIN, P_BUG = 1e-4, 1e-8


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle_small")
    target = make_model(root / "target", "llama_gqa", vocab_size=V, hidden=32, logit_scale=2.0)
    return target, train_head(target, root / "head", steps=4, vocab=V)


def _sample_joint(small, spec: dict, temperature: float = 1.0, coupled: bool = False, seeded: bool = True,
                  filters: dict | None = None) -> tuple[np.ndarray, LLM]:  # fmt: skip
    """The counts of the first two tokens of N requests, seeded unless ``seeded`` is False (``coupled``: through the
    position-keyed coupling, or unseeded as the engine chooses, 4 tokens each and all admitted at once, so that native
    steps at depth 2 run them: a call waits while a request does; else rejection sampling, 2 tokens); ``filters``:
    their top_k, top_p, min_p."""
    target, head = small
    llm = LLM(str(target), speculative_config={"method": "eagle", "model": str(head), **spec}, max_model_len=32,
              max_num_seqs=N if coupled else 512)  # fmt: skip
    params = [SamplingParams(max_tokens=4 if coupled else 2, temperature=temperature, seed=1000 + i if seeded else None,
                             invariant=coupled if seeded else None, ignore_eos=True, **(filters or {}))
              for i in range(N)]  # fmt: skip
    counts = np.zeros(V * V)
    for o in llm.generate([{"prompt_token_ids": PROMPT}] * N, params, use_tqdm=False):
        a, b = o.outputs[0].token_ids[:2]
        counts[a * V + b] += 1
    return counts, llm


SAMPLED = {
    "chain2": {"num_speculative_tokens": 2},
    "tree[2,2]": {"num_speculative_tokens": 2, "tree": [2, 2]},
    "tree[2,2]-iid": {"num_speculative_tokens": 2, "tree": [2, 2], "draft_sampling": "iid"},
    "tree[3,1]-deterministic": {"num_speculative_tokens": 2, "tree": [3, 1], "draft_sampling": "deterministic"},
    "dynamic": {"num_speculative_tokens": 2, "tree": "dynamic", "eagle_topk": 3},  # point-mass proposals
}


@pytest.mark.parametrize("spec", list(SAMPLED.values()), ids=list(SAMPLED))
def test_sampled_first_two_tokens_follow_the_target(small, spec):
    counts, llm = _sample_joint(small, spec)
    assert llm.engine.stats["num_accepted"] > N // 4, "the head must be accepted often for this test to bite"
    assert chi2_pvalue(counts, exact_joint(small[0], 1.0, 1.0)) > P_MIN


def test_planted_bug_is_rejected(small, monkeypatch):
    """Children taken greedily but reported as drawn from q: chi2 must see the bias."""
    monkeypatch.setattr(EagleDrafter, "_draw_children", lambda self, q, b, *rest: q.topk(b, dim=-1).indices)
    counts, _ = _sample_joint(small, {"num_speculative_tokens": 2})
    assert chi2_pvalue(counts, exact_joint(small[0], 1.0, 1.0)) < P_BUG


# --- the published layouts ----------------------------------------------------------------------------------------


def _layer(prefix: str, attn_in: int, g: torch.Generator) -> dict:
    def w(*shape):
        return torch.randn(*shape, generator=g) * 0.08

    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    return {
        f"{prefix}.self_attn.q_proj.weight": w(q, attn_in),
        f"{prefix}.self_attn.k_proj.weight": w(kv, attn_in),
        f"{prefix}.self_attn.v_proj.weight": w(kv, attn_in),
        f"{prefix}.self_attn.o_proj.weight": w(HIDDEN, q),
        f"{prefix}.mlp.gate_proj.weight": w(INTER, HIDDEN),
        f"{prefix}.mlp.up_proj.weight": w(INTER, HIDDEN),
        f"{prefix}.mlp.down_proj.weight": w(HIDDEN, INTER),
        f"{prefix}.post_attention_layernorm.weight": torch.ones(HIDDEN),
    }


def write_published_head(path, layout: str, *, vocab: int = 96, hidden: int = HIDDEN, draft_vocab: int = 40):
    """A tiny head with the names, shapes and config fields of published checkpoints (EAGLE-1: yuhuili/EAGLE-*;
    EAGLE-3: yuhuili/EAGLE3-*), built name by name, not through EagleHead."""
    g = torch.Generator().manual_seed(1)
    cfg = {"model_type": "llama", "hidden_size": hidden, "intermediate_size": INTER, "num_hidden_layers": 1,
           "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "vocab_size": vocab,
           "rms_norm_eps": 1e-6, "max_position_embeddings": 512, "torch_dtype": "float16"}  # fmt: skip
    if layout == "eagle":
        cfg["architectures"] = ["LlamaForCausalLM"]
        state = {"fc.weight": torch.randn(hidden, 2 * hidden, generator=g) * 0.08, "fc.bias": torch.zeros(hidden),
                 "embed_tokens.weight": torch.randn(vocab, hidden, generator=g)}  # fmt: skip
        state |= _layer("layers.0", hidden, g)
    else:
        cfg |= {"architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": draft_vocab}
        d2t = torch.arange(draft_vocab) * 2 - torch.arange(draft_vocab)  # draft token i -> target token 2i
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[d2t + torch.arange(draft_vocab)] = True
        state = {"fc.weight": torch.randn(hidden, 3 * hidden, generator=g) * 0.08, "norm.weight": torch.ones(hidden),
                 "lm_head.weight": torch.randn(draft_vocab, hidden, generator=g), "d2t": d2t, "t2d": t2d,
                 "midlayer.input_layernorm.weight": torch.ones(hidden),
                 "midlayer.hidden_norm.weight": torch.ones(hidden)}  # fmt: skip
        state |= _layer("midlayer", 2 * hidden, g)
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v if v.dtype in (torch.int64, torch.bool) else v.half() for k, v in state.items()},
              str(path / "model.safetensors"))  # fmt: skip
    (path / "config.json").write_text(json.dumps(cfg))
    return path


@pytest.mark.parametrize("layout", ["eagle", "eagle3"])
def test_published_layouts_load_and_stay_lossless(models, plain_greedy, tmp_path, layout):
    target, _ = models
    head_dir = write_published_head(tmp_path / layout, layout)
    head = load_eagle_head(head_dir, load_model(target))
    assert head.layout == layout
    logits = head.logits(torch.randn(2, 3, HIDDEN))
    assert logits.shape == (2, 3, 96)
    if layout == "eagle3":  # the reduced vocabulary lands on target tokens 0, 2, 4, ...; the rest is -inf
        assert head.target_layers == (1, 1, 0)  # vLLM's (2, L // 2, L - 3), kept inside a 2-layer target
        assert torch.isinf(logits[..., 1::2]).all() and torch.isfinite(logits[..., 0:80:2]).all()
    llm = LLM(str(target), speculative_config={"method": "eagle", "model": str(head_dir), "num_speculative_tokens": 3,
                                               "tree": [2, 1]}, max_model_len=128)  # fmt: skip
    assert _generate(llm, SamplingParams(max_tokens=24)) == plain_greedy


def _head_op_by_op(head, tokens, start, last, fcache, kv, table, gamma):
    """``eagle3_draft``'s result the torch way: the head's forward over the entries (features gathered from the
    cache), the roots' outputs [B, H], then its chain level by level, each node's feature its parent's output."""
    B, T = tokens.shape
    positions = start.long()[:, None] + torch.arange(T)  # [B, T]
    blocks, offsets = cache_slots((positions - 1).clamp(min=0), fcache.shape[2], table)
    feats = fcache[0, blocks, offsets] * (positions >= 1)[..., None]  # [B, T, H]
    out = head(tokens, feats, positions, kv, start, causal_mask(B, T, "cpu"), table)  # [B, T, H]
    out = out[torch.arange(B), last]  # [B, H]: the roots'
    prev, root, chain = out, start.long() + last, []  # [B, H], [B]
    for d in range(1, gamma + 1):
        chain.append(head.logits(prev).argmax(-1))  # [B]
        if d < gamma:
            pos = (root + d)[:, None]  # [B, 1]
            one = torch.ones(B, 1, 1, dtype=torch.bool)  # [B, 1, 1]: the node sees itself and the whole prefix
            prev = head(chain[-1][:, None], prev[:, None], pos, kv, pos[:, 0].int(), one, table)[:, 0]
    return out, torch.stack(chain, dim=1)


@pytest.mark.parametrize(
    "dtype, norm_before_residual",
    [(torch.float32, False), (torch.float32, True), (torch.bfloat16, False)],
    ids=["float32", "float32-norm_before_residual", "bfloat16"],
)
def test_native_eagle3_draft_matches_the_head_op_by_op(models, tmp_path, dtype, norm_before_residual):
    """The EAGLE-3 head's native op (entries from a paged feature cache, then a greedy chain on the draft
    vocabulary) against the head's torch ops: float32 to rounding, the same chain and cache; bfloat16 within twice
    the torch path's own bfloat16 error (both against float32)."""
    target_dir, _ = models
    head_dir = write_published_head(tmp_path / "eagle3", "eagle3")
    cfg = json.loads((head_dir / "config.json").read_text())
    (head_dir / "config.json").write_text(json.dumps(cfg | {"norm_before_residual": norm_before_residual}))
    g = torch.Generator().manual_seed(0)
    B, T, block_size, num_blocks, gamma = 2, 5, 4, 16, 3
    fcache32 = torch.randn(1, num_blocks, block_size, HIDDEN, generator=g)  # [1, blocks, block_size, H]
    table = torch.randperm(num_blocks, generator=g)[: B * 8].reshape(B, 8).int()  # [B, 8]: scattered blocks
    tokens = torch.randint(0, 96, (B, T), generator=g)
    start, last = torch.tensor([3, 0], dtype=torch.int32), torch.tensor([4, 2])  # row 1 starts at position 0

    def run(dtype, native):
        head = load_eagle_head(head_dir, load_model(target_dir).to(dtype), dtype=dtype).fuse(max_positions=64)
        assert head.native is not None
        kv = torch.zeros(1, 2, num_blocks, block_size, KV_HEADS, HEAD_DIM, dtype=dtype)
        fcache = fcache32.to(dtype)
        with torch.inference_mode():
            if native:
                out, chain, _ = eagle3_draft(
                    head.native, tokens, start, last, fcache, kv, gamma=gamma, block_table=table
                )
            else:
                out, chain = _head_op_by_op(head, tokens, start, last, fcache, kv, table, gamma)
        return out.float(), chain, kv.float()

    ref_out, ref_chain, ref_kv = run(torch.float32, native=False)
    out, chain, kv = run(dtype, native=True)
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
        assert chain.tolist() == ref_chain.tolist()
        torch.testing.assert_close(kv, ref_kv, atol=1e-5, rtol=1e-5)
    else:  # the chains may part at a near-tie: compare the roots' outputs
        torch_out, _, _ = run(dtype, native=False)
        assert (out - ref_out).abs().max() <= 2 * (torch_out - ref_out).abs().max() + 1e-2
    assert (chain % 2 == 0).all()  # the draft vocabulary's ids (target tokens 0, 2, 4, ...)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_eagle3_draft_entries_in_one_chunk_or_one_by_one(models, tmp_path, dtype):
    """Only each row's root runs the head's layer whole; the entries before it write their K/V alone. A chunk
    caught up in one call leaves the same cache, bit for bit, as the same entries fed one call at a time (each then
    its own root), and its root's output and chain are the last call's."""
    target_dir, _ = models
    head = load_eagle_head(write_published_head(tmp_path / "eagle3", "eagle3"), load_model(target_dir).to(dtype),
                           dtype=dtype).fuse(max_positions=64)  # fmt: skip
    g = torch.Generator().manual_seed(1)
    B, T, block_size, num_blocks, gamma = 2, 6, 4, 16, 3
    fcache = torch.randn(1, num_blocks, block_size, HIDDEN, generator=g).to(dtype)  # [1, blocks, block_size, H]
    table = torch.randperm(num_blocks, generator=g)[: B * 8].reshape(B, 8).int()  # [B, 8]
    tokens = torch.randint(0, 96, (B, T), generator=g)
    start = torch.tensor([5, 0], dtype=torch.int32)

    def run(one_by_one: bool):
        kv = torch.zeros(1, 2, num_blocks, block_size, KV_HEADS, HEAD_DIM, dtype=dtype)
        calls = [(t, t + 1) for t in range(T)] if one_by_one else [(0, T)]
        for a, b in calls:
            out, chain, _ = eagle3_draft(head.native, tokens[:, a:b].contiguous(), start + a,
                                         torch.full((B,), b - a - 1), fcache, kv, gamma=gamma if b == T else 0,
                                         block_table=table)  # fmt: skip
        return out, chain, kv

    out, chain, kv = run(one_by_one=False)
    ref_out, ref_chain, ref_kv = run(one_by_one=True)
    assert torch.equal(out, ref_out) and torch.equal(chain, ref_chain) and torch.equal(kv, ref_kv)


def test_native_eagle3_draft_rejects_bad_inputs(models, tmp_path):
    target_dir, _ = models
    head = load_eagle_head(write_published_head(tmp_path / "eagle3", "eagle3"), load_model(target_dir)).fuse(64)
    kv = torch.zeros(1, 2, 4, 8, KV_HEADS, HEAD_DIM)
    tokens, start, table = torch.zeros(1, 3, dtype=torch.int64), torch.zeros(1, dtype=torch.int32), torch.zeros(1, 4)
    with pytest.raises(ValueError, match="feature cache must be"):
        eagle3_draft(head.native, tokens, start, torch.zeros(1, dtype=torch.int64), torch.zeros(1, 4, 8, HIDDEN + 1),
                     kv, gamma=1, block_table=table.int())  # fmt: skip
    with pytest.raises(ValueError, match="last 3"):
        eagle3_draft(head.native, tokens, start, torch.full((1,), 3), torch.zeros(1, 4, 8, HIDDEN), kv, gamma=1,
                     block_table=table.int())  # fmt: skip
    with pytest.raises(ValueError, match="L_b = 30 and T = 3 but its cache holds 32"):
        eagle3_draft(head.native, tokens, start + 30, torch.zeros(1, dtype=torch.int64), torch.zeros(1, 4, 8, HIDDEN),
                     kv, gamma=1, block_table=table.int())  # fmt: skip


@pytest.mark.parametrize("spec", [{"num_speculative_tokens": 1}, {"num_speculative_tokens": 4}, {}],
                         ids=["chain1", "chain4", "adaptive"])  # fmt: skip
def test_native_eagle3_chains_match_plain(models, plain_greedy, tmp_path, spec):
    """Greedy chains of an EAGLE-3 head drafted by the native op (prefill and catch-up chunks, then each step's
    chain in one call) keep plain decoding's tokens."""
    target, _ = models
    spec = {"method": "eagle", "model": str(write_published_head(tmp_path / "eagle3", "eagle3")), **spec}
    llm = LLM(str(target), speculative_config=spec, max_model_len=128)
    assert llm.engine.drafter.model.native is not None
    assert _generate(llm, SamplingParams(max_tokens=24)) == plain_greedy
    stats = llm.engine.stats
    assert stats["num_drafted"] > 0
    if spec.get("num_speculative_tokens"):  # fixed depths: the engine's native steps (spec_chain) ran the head
        assert stats["num_regular_steps"] < stats["num_steps"] // 2


@pytest.mark.parametrize("spec", [{"num_speculative_tokens": 4}, {"num_speculative_tokens": 3, "tree": [2, 1, 1]},
                                  {}], ids=["chain4", "t211", "adaptive"])  # fmt: skip
def test_preempted_requests_keep_their_tokens_under_a_native_head(models, tmp_path, monkeypatch, spec):
    """Requests preempted for KV blocks (``Scheduler.make_room``) are prefilled again, prompt and output: the head's
    features and cache are rebuilt from those of the target's pass, and greedy and seeded (coupled) tokens are those
    of a cache that holds every request."""
    import spec_engine.llm as llm_mod

    target, _ = models
    spec = {"method": "eagle", "model": str(write_published_head(tmp_path / "eagle3", "eagle3")), **spec}
    prompts = [{"prompt_token_ids": p} for p in PROMPTS * 2]
    params = [SamplingParams(max_tokens=70 + 9 * i, ignore_eos=True, temperature=0.7 if i % 2 else 0.0, seed=i)
              for i in range(len(prompts))]  # fmt: skip

    def run(**kw):
        llm = LLM(str(target), speculative_config=spec, max_model_len=128, block_size=16, **kw)
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert llm.allocator.num_used == 0
        return [o.outputs[0].token_ids for o in outs], llm.engine.stats

    ample, ample_stats = run()
    monkeypatch.setattr(llm_mod, "plan_num_blocks", lambda *args: 12)  # two requests at their longest, about
    tight, tight_stats = run()
    assert ample_stats["num_preemptions"] == 0 and tight_stats["num_preemptions"] >= 2
    assert tight == ample and tight_stats["num_drafted"] > 0


@pytest.mark.parametrize("tree", [[2, 2, 1], [3, 1, 1]], ids=["t221", "t311"])
def test_eagle3_trees_run_natively_as_the_regular_step(models, plain_greedy, tmp_path, tree):
    """An EAGLE-3 head's static trees run in the engine's native steps (``spec_chain`` with the tree: the head's levels,
    the target's pass, the walk and the compaction in C++), and on the regular step verify in one native call
    (``tree_step``) that also returns the target's features: plain decoding's tokens, and the drafts and acceptances
    of the separate ops (``EngineConfig(native_tree_step=False)``), which read the features from the target's
    pass."""
    from spec_engine.engine import EngineConfig

    target, _ = models
    spec = {"method": "eagle", "model": str(write_published_head(tmp_path / "eagle3", "eagle3")),
            "num_speculative_tokens": 3, "tree": tree}  # fmt: skip
    params = SamplingParams(max_tokens=24)
    keys = ("num_steps", "num_drafted", "num_accepted", "accepted_length_hist")
    runs = []
    for steps, native in ((16, True), (0, True), (0, False)):
        llm = LLM(str(target), speculative_config=spec, max_model_len=128,
                  engine_config=EngineConfig(spec_chain_steps=steps, native_tree_step=native))  # fmt: skip
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == plain_greedy
        runs.append([{k: o.metrics[k] for k in keys} for o in outs])
        stats = llm.engine.stats
        assert stats["num_accepted"] > 0
        if steps:  # the native steps ran the trees
            assert stats["num_regular_steps"] < stats["num_steps"] // 2
    assert runs[0] == runs[1] == runs[2]


def test_a_tree_wider_than_the_native_calls_take_runs_regular_steps(models, plain_greedy, tmp_path):
    """A static tree of more nodes than spec_chain takes (SPEC_CHAIN_MAX_NODES, 1,024; the config allows 64 leaves at
    16 levels: 1,025 nodes) decodes on the regular step instead of failing the request: here the cap lowered to 8
    under an 11-node tree."""
    from spec_engine.step import SPEC_CHAIN

    target, _ = models
    spec = {"method": "eagle", "model": str(write_published_head(tmp_path / "eagle3", "eagle3")),
            "num_speculative_tokens": 3, "tree": [2, 2, 1]}  # fmt: skip
    llm = LLM(str(target), speculative_config=spec, max_model_len=128)
    llm.engine.runner.spec_chain_max_nodes = 8
    assert _generate(llm, SamplingParams(max_tokens=24)) == plain_greedy
    calls = [p.gamma for p in llm.engine.plan_history if p.path == SPEC_CHAIN]
    # (a row's last steps draft shallower trees, of 7 and 3 nodes: those still run natively)
    assert llm.engine.stats["num_drafted"] > 0 and 3 not in calls, "no native call may run the 11-node tree"


def test_native_sampled_chains_draw_as_the_level_by_level_path(models, tmp_path, monkeypatch):
    """A chain with sampled rows runs in one native call (eagle3_draft with each level's Gumbel noise): its draws
    are the level-by-level path's (the same keyed noise), so a batch of greedy and seeded (coupled) rows decodes
    the same tokens with the same drafts at every step either way (a coupled row's tokens do not depend on its
    drafts, so the steps line up). A planted bug (each level drawn with another level's noise) changes the drafts."""
    import spec_engine.drafters.eagle as eagle_module

    target, _ = models
    spec = {"method": "eagle", "model": str(write_published_head(tmp_path / "eagle3", "eagle3")),
            "num_speculative_tokens": 3}  # fmt: skip
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:2]] * 2
    params = [SamplingParams(max_tokens=20, temperature=t, seed=s, ignore_eos=True)
              for t, s in [(0.0, None), (0.7, 11), (0.9, 12), (0.0, None)]]  # fmt: skip
    calls, drafts = [], []
    real = eagle_module.eagle3_draft
    monkeypatch.setattr(eagle_module, "eagle3_draft", lambda *a, **k: calls.append("noise" in k) or real(*a, **k))
    propose = EagleDrafter.propose
    monkeypatch.setattr(EagleDrafter, "propose", lambda self, batch: drafts.append(propose(self, batch)) or drafts[-1])

    def run(native: bool) -> tuple[list, list]:
        drafts.clear()
        llm = LLM(str(target), speculative_config=spec, max_model_len=128)
        if not native:
            llm.engine.drafter.model.native = None  # every level as torch ops
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert llm.engine.stats["num_drafted"] > 0
        return [o.outputs[0].token_ids for o in outs], [d.tokens.tolist() for d in drafts]

    level_by_level = run(native=False)
    assert not any(calls)
    native = run(native=True)
    assert any(calls), "the sampled chains must have run natively"
    assert native == level_by_level
    honest = EagleDrafter._chain_noise

    def shifted(self, batch, depth):
        out = honest(self, batch, depth)
        out["noise"] = out["noise"].roll(1, dims=1).contiguous()
        return out

    monkeypatch.setattr(EagleDrafter, "_chain_noise", shifted)
    planted = run(native=True)
    assert planted[0] == native[0] and planted[1] != native[1]


@pytest.fixture(scope="module")
def small_eagle3(tmp_path_factory):
    """A 6-token target at the published head's width and an EAGLE-3 head over 3 of its tokens (0, 2, 4)."""
    root = tmp_path_factory.mktemp("eagle3_small")
    target = make_model(root / "target", "llama_gqa", vocab_size=V, hidden=HIDDEN, logit_scale=0.5)
    head = write_published_head(root / "head", "eagle3", vocab=V, draft_vocab=3)
    state = load_file(head / "model.safetensors")  # a flat q (its logits at ~1/10): greedy drafts are not draws
    state["lm_head.weight"] = state["lm_head.weight"] * 0.1
    save_file(state, str(head / "model.safetensors"))
    return target, head


def test_native_sampled_chains_are_lossless(small_eagle3, monkeypatch):
    """Unseeded sampled rows drafted by the native chain (a draw from the head's q at each level, q handed to
    rejection sampling) keep the target's exact joint of the first two tokens (chi2); drafts taken greedily but
    reported as drawn from q (the noise zeroed: a planted bug) are caught."""
    counts, llm = _sample_joint(small_eagle3, {"num_speculative_tokens": 2})
    assert llm.engine.drafter.model.native is not None
    assert llm.engine.stats["num_accepted"] > N // 10, "the head must be accepted often for this test to bite"
    assert chi2_pvalue(counts, exact_joint(small_eagle3[0], 1.0, 1.0)) > P_MIN
    honest = EagleDrafter._chain_noise

    def greedy_draws(self, batch, depth):
        out = honest(self, batch, depth)
        out["noise"] = torch.zeros_like(out["noise"])
        return out

    monkeypatch.setattr(EagleDrafter, "_chain_noise", greedy_draws)
    counts, _ = _sample_joint(small_eagle3, {"num_speculative_tokens": 2})
    assert chi2_pvalue(counts, exact_joint(small_eagle3[0], 1.0, 1.0)) < P_BUG


def test_native_sampled_chains_below_temperature_one_are_lossless(small_eagle3):
    """At temperature 0.3 the native chain draws from softmax(logits / 0.3), and the q it hands to verification must
    be taken at the same temperature (the temperature-1 test above cannot tell them apart)."""
    counts, llm = _sample_joint(small_eagle3, {"num_speculative_tokens": 2}, temperature=0.3)
    assert llm.engine.drafter.model.native is not None
    assert llm.engine.stats["num_accepted"] > N // 10, "the head must be accepted often for this test to bite"
    assert chi2_pvalue(counts, exact_joint(small_eagle3[0], 0.3, 1.0)) > P_MIN


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_native_coupled_chains_are_lossless(small_eagle3, temperature, monkeypatch):
    """Coupled rows in the engine's native steps (spec_chain's temperature and noise seeds: the target's perturbed
    argmax, the head's draws with the same noise) keep the target's exact joint of the first two tokens (chi2); a
    temperature handed to the native call off by half (a planted bug) is caught."""
    from spec_engine import runner as runner_module

    counts, llm = _sample_joint(small_eagle3, {"num_speculative_tokens": 2}, temperature, coupled=True)
    stats = llm.engine.stats
    assert stats["num_accepted"] > N // 10, "the head must be accepted often for this test to bite"
    assert stats["num_regular_steps"] <= 2, "the native steps must have run the rows"
    assert chi2_pvalue(counts, exact_joint(small_eagle3[0], temperature, 1.0)) > P_MIN
    honest = runner_module.StepRunner._sampling

    def halved(self, reqs):
        out = honest(self, reqs)
        return out | {"temperature": out["temperature"] * 0.5} if out else out

    monkeypatch.setattr(runner_module.StepRunner, "_sampling", halved)
    counts, _ = _sample_joint(small_eagle3, {"num_speculative_tokens": 2}, temperature, coupled=True)
    assert chi2_pvalue(counts, exact_joint(small_eagle3[0], temperature, 1.0)) < P_BUG


FILTERS = {"top_p": {"top_p": 0.7}, "top_k+min_p": {"top_k": 3, "min_p": 0.15},
           "all": {"top_k": 4, "top_p": 0.8, "min_p": 0.05}}  # fmt: skip


@pytest.mark.parametrize("filters", list(FILTERS.values()), ids=list(FILTERS))
def test_native_coupled_chains_with_filters_are_lossless(small_eagle3, filters, monkeypatch):
    """Coupled rows with top-k, top-p and min-p in the native steps (each node's perturbed argmax over the entries
    the filters keep, ``sampling::filtered_argmax``) keep the HF-warped target's exact joint of the first two tokens
    (chi2, and no pair the filters rule out: chi2_pvalue pools those cells away); the filters left out of the native
    call (a planted bug) are caught."""
    from spec_engine import runner as runner_module

    counts, llm = _sample_joint(small_eagle3, {"num_speculative_tokens": 2}, 0.8, coupled=True, filters=filters)
    stats = llm.engine.stats
    assert stats["num_accepted"] > N // 10, "the head must be accepted often for this test to bite"
    assert stats["num_regular_steps"] <= 2, "the native steps must have run the rows"
    exact = exact_joint(small_eagle3[0], 0.8, filters.get("top_p", 1.0), filters.get("top_k", 0),
                        filters.get("min_p", 0.0))  # fmt: skip
    assert chi2_pvalue(counts, exact) > P_MIN and counts[exact == 0].sum() == 0
    honest = runner_module.StepRunner._sampling

    def unfiltered(self, reqs):
        return {k: v for k, v in honest(self, reqs).items() if k not in ("top_k", "top_p", "min_p")}

    monkeypatch.setattr(runner_module.StepRunner, "_sampling", unfiltered)
    counts, _ = _sample_joint(small_eagle3, {"num_speculative_tokens": 2}, 0.8, coupled=True, filters=filters)
    assert counts[exact == 0].sum() > N // 20


def test_unseeded_requests_couple_where_the_native_steps_sample(small_eagle3, models):
    """An engine whose native calls sample coupled rows (a native EAGLE-3 head on the CPU) samples unseeded requests
    through the coupling, there (losslessly: chi2); ``EngineConfig(couple_unseeded=False)`` keeps rejection sampling,
    and so does an engine without such calls (an EAGLE-1 head). A request's own ``invariant`` always wins."""
    from spec_engine.engine import EngineConfig

    counts, llm = _sample_joint(small_eagle3, {"num_speculative_tokens": 2}, coupled=True, seeded=False)
    eng = llm.engine
    assert eng.couple_unseeded and eng.stats["num_regular_steps"] <= 2, "the native steps must have run the rows"
    assert chi2_pvalue(counts, exact_joint(small_eagle3[0], 1.0, 1.0)) > P_MIN
    target, head = small_eagle3
    spec = {"method": "eagle", "model": str(head), "num_speculative_tokens": 2}
    sampled = SamplingParams(max_tokens=4, temperature=1.0)
    assert eng.add_request(PROMPT, sampled).coupled
    assert not eng.add_request(PROMPT, SamplingParams(max_tokens=4, temperature=1.0, invariant=False)).coupled
    assert not eng.add_request(PROMPT, SamplingParams(max_tokens=4)).coupled  # greedy needs no noise
    off = LLM(str(target), speculative_config=spec, max_model_len=32,
              engine_config=EngineConfig(couple_unseeded=False)).engine  # fmt: skip
    assert not off.couple_unseeded and not off.add_request(PROMPT, sampled).coupled
    assert off.add_request(PROMPT, SamplingParams(max_tokens=4, temperature=1.0, invariant=True)).coupled
    eagle1 = _llm(models, {"num_speculative_tokens": 2}).engine  # an EAGLE-1 head: no native head calls
    assert not eagle1.couple_unseeded and not eagle1.add_request([5, 17], sampled).coupled
    # the native calls take filtered rows, but no sampled trees, and none at all with spec_chain_steps=0
    assert eng.add_request(PROMPT, SamplingParams(max_tokens=4, temperature=1.0, top_p=0.9)).coupled
    tree = LLM(str(target), speculative_config=spec | {"tree": [2, 1]}, max_model_len=32).engine
    off = LLM(str(target), speculative_config=spec, max_model_len=32, engine_config=EngineConfig(spec_chain_steps=0))
    assert not tree.couple_unseeded and not off.engine.couple_unseeded


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_native_coupled_steps_are_plain_samplings_tokens(models, plain_greedy, tmp_path, temperature):
    """Seeded rows (coupled) in the native steps, alone and beside greedy rows, with and without top-k, top-p and
    min-p: plain sampled decoding's tokens (no drafter), and the drafts and acceptances of the regular step
    (``spec_chain_steps=0``: eagle3_draft with the noise drawn in Python, verify_tree's coupled walk): the two compute
    the same noise and thresholds."""
    from spec_engine.engine import EngineConfig

    target, _ = models
    head = str(write_published_head(tmp_path / "eagle3", "eagle3"))
    filters = [{}, {"top_p": 0.9}, {"top_k": 20, "min_p": 0.02}, {"top_k": 40, "top_p": 0.95, "min_p": 0.01}]
    params = [SamplingParams(max_tokens=24, temperature=temperature, seed=7 + i, ignore_eos=True, **f)
              for i, f in enumerate(filters)] + [SamplingParams(max_tokens=24)]  # fmt: skip
    prompts = [{"prompt_token_ids": p} for p in PROMPTS + PROMPTS[:1] * 2]
    plain = LLM(str(target), max_model_len=128).generate(prompts, params, use_tqdm=False)
    keys = ("num_steps", "num_drafted", "num_accepted", "accepted_length_hist")
    runs = []
    for steps in (16, 0):
        llm = LLM(str(target), speculative_config={"method": "eagle", "model": head, "num_speculative_tokens": 3},
                  max_model_len=128, engine_config=EngineConfig(spec_chain_steps=steps))  # fmt: skip
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
        assert outs[-1].outputs[0].token_ids == plain_greedy[0]
        runs.append([{k: o.metrics[k] for k in keys} for o in outs])
        stats = llm.engine.stats
        assert stats["num_accepted"] > 0
        if steps:
            assert stats["num_regular_steps"] < stats["num_steps"] // 2, "the native steps must have run the rows"
    assert runs[0] == runs[1]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_plain_native_steps_store_a_heads_features(models, tmp_path, dtype):
    """A head's target decodes plainly in native chains (spec_chain at depth 0: the head idle, the target's captured
    streams through fc into the feature cache at each emitted position), so an undrafted stretch costs no regular
    Python step per token. Its tokens are plain_steps', and the features it stores are those the regular step
    stores (the target's forward_features through the head's fc) at positions 0 .. K - 1: one stored a position off,
    or from another layer's stream, differs."""
    target, _ = models
    spec = {"method": "eagle", "model": str(write_published_head(tmp_path / "eagle3", "eagle3"))}
    eng = LLM(str(target), speculative_config=spec, max_model_len=128, dtype=dtype).engine
    head = eng.drafter
    assert isinstance(eng.runner.native_draft, NativeHead)
    B, K, P = 2, 6, 16

    def cache(data):  # a contiguous cache of B rows of P positions
        return data.new_zeros(data.shape[0], 2, B, P, *data.shape[4:])

    roots, zero = torch.tensor([5, 60]), torch.zeros(B, dtype=torch.int64)
    features = head.features.new_zeros(1, B, P, head.features.shape[-1])  # [1, B, P, H]
    d_kv = cache(head.kv.data)
    steps, catch_up, _, _, _ = spec_chain(eng.runner.native_target, eng.runner.native_draft, roots[:, None],
                                          zero + 1, zero, cache(eng.kv.data), d_kv, None, zero + 100, zero[:0],
                                          gamma=0, max_steps=K, draft_features=features)  # fmt: skip
    tokens = steps[:, :, 1]  # [B, K]
    assert torch.equal(tokens, plain_steps(roots, eng.runner.native_target, cache(eng.kv.data), zero, steps=K))
    assert not d_kv.any() and catch_up.shape == (B, K + 1)  # the head did not run: its catch-up holds every token
    seq = torch.cat([roots[:, None], tokens[:, :-1]], dim=1)  # [B, K]: the tokens at positions 0 .. K - 1
    positions = torch.arange(K).expand(B, K)
    _, streams = eng.target.forward_features(seq, positions, cache(eng.kv.data), zero.int(), causal_mask(B, K, "cpu"),
                                             layers=head.target_layers)  # fmt: skip
    want = head.model.features(streams)  # [B, K, H]
    tol = 1e-5 if dtype == "float32" else 2e-2
    torch.testing.assert_close(features[0, :, :K], want, atol=tol, rtol=tol)
    assert not features[0, :, K:].any()


def test_mismatched_heads_raise_clear_errors(models, tmp_path):
    target, _ = models
    t = load_model(target)
    with pytest.raises(ValueError, match="vocab"):
        load_eagle_head(write_published_head(tmp_path / "vocab", "eagle", vocab=100), t)
    with pytest.raises(ValueError, match="hidden size"):
        load_eagle_head(write_published_head(tmp_path / "hidden", "eagle", hidden=32), t)
    with pytest.raises(ValueError, match="hidden size"):
        load_eagle_head(write_published_head(tmp_path / "hidden3", "eagle3", hidden=32), t)
    broken = write_published_head(tmp_path / "broken", "eagle")
    from safetensors.torch import load_file

    state = load_file(str(broken / "model.safetensors"))
    del state["layers.0.mlp.down_proj.weight"]
    save_file(state, str(broken / "model.safetensors"))
    with pytest.raises(ValueError, match="lacks 1 weights"):
        load_eagle_head(broken, t)
    with pytest.raises(ValueError, match="EAGLE head directory"):
        LLM(str(target), speculative_config={"method": "eagle"})
    with pytest.raises(FileNotFoundError):
        load_eagle_head(tmp_path / "nowhere", t)


def _set(name, value):
    return lambda d: d.__setitem__(name, value(d[name]) if callable(value) else value)


def _duplicate_first_id(d2t):
    d2t = d2t.clone()
    d2t[1] = d2t[0] - 1  # draft tokens 0 and 1 both map to target token d2t[0]
    return d2t


def _add_second_layer(state):
    layer = {k: v for k, v in state.items() if k.startswith("midlayer.")}
    state.update({k.replace("midlayer.", "layers.1."): v.clone() for k, v in layer.items()})


MALFORMED_HEADS = {  # edit of the weights, edit of config.json, the error's words
    "d2t float": (_set("d2t", lambda t: t.half()), None, "integer offsets"),
    "d2t bool": (_set("d2t", lambda t: t.bool()), None, "integer offsets"),
    "d2t duplicates": (_set("d2t", _duplicate_first_id), None, "same target token"),
    "int weights": (_set("fc.weight", lambda t: t.long()), None, "floating-point"),
    "NaN weights": (_set("fc.weight", lambda t: t * float("nan")), None, "NaN"),
    "draft vocab str": (None, _set("draft_vocab_size", "40"), "draft_vocab_size"),
    "target layers int": (None, _set("target_layers", 1), "target layers"),
    "target layers str": (None, _set("target_layers", ["0", "1", "1"]), "target layers"),
    "eagle_config str": (None, _set("eagle_config", "x"), "eagle_config"),
    "EAGLE-1 draft vocab": (_set("lm_head.weight", torch.zeros(40, HIDDEN)), _set("draft_vocab_size", 40), "d2t"),
    "a second layer": (_add_second_layer, None, "no place for"),
}


@pytest.mark.parametrize("name", list(MALFORMED_HEADS))
def test_malformed_heads_raise_clear_errors(models, tmp_path, name):
    """Malformed files give a ValueError naming the fault, not a traceback deep in torch, and never load a head
    that maps draft tokens otherwise than the file says (a float or bool d2t) or whose sampled drafts would be
    verified against the wrong q (two draft tokens on one target id, NaN weights)."""
    edit_state, edit_config, words = MALFORMED_HEADS[name]
    head_dir = write_published_head(tmp_path / "head", "eagle" if name.startswith("EAGLE-1") else "eagle3")
    if edit_state is not None:
        state = load_file(str(head_dir / "model.safetensors"))
        edit_state(state)
        save_file(state, str(head_dir / "model.safetensors"))
    if edit_config is not None:
        cfg = json.loads((head_dir / "config.json").read_text())
        edit_config(cfg)
        (head_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=words):
        load_eagle_head(head_dir, load_model(models[0]))


def test_an_int32_d2t_loads_as_int64(models, tmp_path):
    head_dir = write_published_head(tmp_path / "head", "eagle3")
    state = load_file(str(head_dir / "model.safetensors"))
    state["d2t"] = state["d2t"].int()
    save_file(state, str(head_dir / "model.safetensors"))
    head = load_eagle_head(head_dir, load_model(models[0]))
    assert head.d2t.dtype == torch.int64 and head.d2t.tolist() == list(range(40))


def test_a_tree_wider_than_the_heads_draft_vocabulary_is_refused(models, tmp_path):
    """An EAGLE-3 level of b children drawn without replacement from a draft vocabulary of fewer than b ids would
    draw some with q = 0 and verify them as if q proposed them (as a draft model's reduced vocabulary: the same
    check); EAGLE-2's dynamic tree takes its top-k as point masses and stays allowed."""
    head = str(write_published_head(tmp_path / "head", "eagle3", draft_vocab=4))
    with pytest.raises(ValueError, match="narrower than the tree"):
        LLM(str(models[0]), speculative_config={"method": "eagle", "model": head, "num_speculative_tokens": 1,
                                                "tree": [6]}, max_model_len=64)  # fmt: skip
    LLM(str(models[0]), speculative_config={"method": "eagle", "model": head, "num_speculative_tokens": 2,
                                            "tree": [4]}, max_model_len=64)  # fmt: skip
    LLM(str(models[0]), speculative_config={"method": "eagle", "model": head, "num_speculative_tokens": 2,
                                            "tree": "dynamic", "eagle_topk": 6}, max_model_len=64)  # fmt: skip


def test_training_recipe_end_to_end(tmp_path):
    """``python -m spec_engine.training.train_eagle --smoke`` on a tiny target: a head that loads in the normed variant,
    with its checkpoint left for a resumed run."""
    from tiny_models import make_tokenizer

    from spec_engine.training import train_eagle

    target = make_model(tmp_path / "target", "llama_gqa", vocab_size=300, hidden=32)
    make_tokenizer(target)
    out, work = tmp_path / "head", tmp_path / "work"
    report = train_eagle.main(["--target", str(target), "--out", str(out), "--work-dir", str(work), "--smoke"])
    assert len(report["held_out_top1_agreement_per_depth"]) == 3
    assert (work / "eagle.ckpt").is_file()
    head = load_eagle_head(out, load_model(target))
    assert head.normed and head.layout == "eagle"


def test_shipped_head_drafts_for_the_default_target():
    from spec_engine import default_model_paths
    from spec_engine.zoo import MODELS_DIR

    if not (MODELS_DIR / "eagle" / "config.json").is_file():
        pytest.skip("no shipped head yet (python -m spec_engine.training.train_eagle)")
    target, _ = default_model_paths()
    spec = {"method": "eagle", "model": str(MODELS_DIR / "eagle"), "num_speculative_tokens": 3}
    llm = LLM(target, speculative_config=spec, dtype="float32", max_model_len=128)
    ids = llm.encode("def fibonacci(n):\n    if n < 2:\n        return n\n")
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
    plain = LLM(target, dtype="float32", max_model_len=128).generate({"prompt_token_ids": ids}, params, use_tqdm=False)
    assert out.outputs[0].token_ids == plain[0].outputs[0].token_ids
    assert out.metrics["acceptance_rate"] > 0.3


def test_eagle3_recipe_end_to_end(tmp_path):
    """``train_eagle --layout eagle3 --smoke`` on a tiny target: an EAGLE-3 head with a reduced draft vocabulary and
    d2t that loads and drafts losslessly."""
    from tiny_models import make_tokenizer

    from spec_engine.training import train_eagle

    target = make_model(tmp_path / "target", "llama_gqa", vocab_size=300, hidden=32)
    make_tokenizer(target)
    out, work = tmp_path / "head", tmp_path / "work"
    argv = ["--target", str(target), "--out", str(out), "--work-dir", str(work), "--smoke", "--layout", "eagle3",
            "--draft-vocab", "64"]  # fmt: skip
    report = train_eagle.main(argv)
    assert len(report["history"][-1]["held_out_top1_agreement_per_depth"]) == 3
    assert (work / "eagle3.ckpt").is_file()
    head = load_eagle_head(out, load_model(target))
    assert head.layout == "eagle3" and head.draft_vocab_size == 64
    assert len(set((head.d2t + torch.arange(64)).tolist())) == 64
    ids = [5, 17, 3, 60, 42, 7]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    spec = {"method": "eagle", "model": str(out), "num_speculative_tokens": 3}
    drafted = LLM(str(target), speculative_config=spec, dtype="float32").generate({"prompt_token_ids": ids}, params)
    plain = LLM(str(target), dtype="float32").generate({"prompt_token_ids": ids}, params)
    assert drafted[0].outputs[0].token_ids == plain[0].outputs[0].token_ids

    # --init starts a new run from that head's trained weights: at learning rate 0 they come out unchanged.
    again = tmp_path / "head2"
    train_eagle.main([*argv[:2], "--out", str(again), "--work-dir", str(tmp_path / "work2"), *argv[6:], "--init",
                      str(out), "--lr", "0"])  # fmt: skip
    first, second = load_file(out / "model.safetensors"), load_file(again / "model.safetensors")
    assert torch.equal(first["fc.weight"], second["fc.weight"])
    assert torch.equal(first["midlayer.mlp.down_proj.weight"], second["midlayer.mlp.down_proj.weight"])
    with pytest.raises(ValueError, match="reads target layers"):
        config = json.loads((out / "config.json").read_text())
        config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [0, 0, 0]
        (out / "config.json").write_text(json.dumps(config))
        train_eagle.main([*argv[:2], "--out", str(again), "--work-dir", str(tmp_path / "work3"), *argv[6:], "--init",
                          str(out)])  # fmt: skip


def test_eagle3_data_sampled_answers_keep_the_targets_labels(tmp_path):
    """``eagle_data`` with a temperature writes sampled answers whose labels are still the target's greedy tokens
    (``next``), and the batched torch pass (``torch_features``, the GPU path) gives the engine pass's labels and
    streams; the training set takes both kinds of answers, its held-out split greedy ones only; data of another
    target is refused; ``--max-seconds`` ends a training run (here at once: after its first step)."""
    from tiny_models import make_tokenizer

    from spec_engine.drafters.eagle import eagle3_target_layers
    from spec_engine.training import eagle_data, train_eagle

    target = make_model(tmp_path / "target", "llama_gqa", vocab_size=300, hidden=32, layers=3, logit_scale=4.0)
    make_tokenizer(target)
    common = ["--target", str(target), "--limit", "6", "--batch", "3", "--max-tokens", "8", "--dtype", "float32"]
    eagle_data.main([*common, "--out", str(tmp_path / "greedy")])
    eagle_data.main([*common, "--out", str(tmp_path / "sampled"), "--temperature", "1.0", "--seed", "1"])
    greedy = [torch.load(f) for f in sorted((tmp_path / "greedy").glob("shard_*.pt"))]
    sampled = [torch.load(f) for f in sorted((tmp_path / "sampled").glob("shard_*.pt"))]
    assert [d["temperature"] for d in greedy + sampled] == [0.0, 0.0, 1.0, 1.0]
    model = load_model(target)
    layers = eagle3_target_layers(model.config.num_hidden_layers)
    differ = 0
    for d in greedy + sampled:
        off, plens = d["offsets"].tolist(), d["prompt_lens"].tolist()
        seqs = [d["tokens"][off[i] : off[i + 1]].long() for i in range(len(plens))]
        batched = eagle_data.answer_features(model, [s.tolist() for s in seqs], layers)  # the CPU's engine pass
        ids = torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True)
        streams, nxt = eagle_data.torch_features(model, ids, layers)  # the batched torch pass
        for i, s in enumerate(seqs):
            labels, answer = d["next"][off[i] : off[i + 1]].long(), s[plens[i] :]
            assert torch.equal(labels, batched[i][1].long()) and torch.equal(labels, nxt[i, : len(s)])
            torch.testing.assert_close(
                d["features"][off[i] : off[i + 1]].float(), streams[i, : len(s)].float(), atol=1e-2, rtol=8e-3
            )  # the shard holds bf16: one ulp apart
            if d["temperature"] == 0:
                assert torch.equal(labels[plens[i] - 1 : -1], answer)  # greedy: the answer's own next tokens
            else:
                differ += int((labels[plens[i] - 1 : -1] != answer).sum())
    assert differ > 0  # sampled answers leave the target's greedy path, their labels do not

    data = eagle_data.ShardSet([tmp_path / "greedy", tmp_path / "sampled"])
    data.reload()
    assert len(data.train) == 10 and len(data.held) == 1  # prompt 0 is held out: its greedy answer only
    for tokens, _, _, labels in data.train:
        assert len(labels) == len(tokens) - 1
    held_tokens, _, held_plen, held_labels = data.held[0]
    assert torch.equal(held_labels[held_plen - 1 :], held_tokens[held_plen:])

    work = tmp_path / "work"
    argv = ["--target", str(target), "--layout", "eagle3", "--data", str(tmp_path / "greedy"),
            str(tmp_path / "sampled"), "--work-dir", str(work), "--out", str(tmp_path / "head"), "--draft-vocab", "64",
            "--batch-size", "2", "--steps", "50", "--eval-every", "10", "--ckpt-every", "10"]  # fmt: skip
    for bad in (["--max-seconds", "-1"], ["--device", "cuda"] if not torch.cuda.is_available() else []):
        if bad:
            with pytest.raises(SystemExit):
                train_eagle.main([*argv, *bad])
    for bad in (["--temperature", "-0.5"], ["--max-seconds", "-1"], ["--kv-cache-gib", "0"]):
        with pytest.raises(SystemExit):
            eagle_data.main([*common, "--out", str(tmp_path / "never"), *bad])
    assert not (tmp_path / "never").exists()
    report = train_eagle.main([*argv, "--max-seconds", "0"])
    assert report["steps"] == 1 and report["history"][-1]["step"] == 1
    assert (tmp_path / "head" / "model.safetensors").is_file()

    # sampled answers alone: no held-out split (greedy answers only), so nothing is measured, and the run still
    # trains, checkpoints and exports (it crashed at its first evaluation and lost the run)
    alone = [*argv[:5], str(tmp_path / "sampled"), "--work-dir", str(tmp_path / "w_sampled"), "--out",
             str(tmp_path / "head_sampled"), *argv[11:]]  # fmt: skip
    report = train_eagle.main([*alone, "--steps", "10"])
    assert report["steps"] == 10 and report["history"][-1]["held_out_top1_agreement_per_depth"] == []
    exported = train_eagle.main([*alone, "--export"])
    assert exported["held_samples"] == 0 and exported["by_draft_vocab"][64]["held_out_coverage"] is None
    assert (tmp_path / "head_sampled" / "model.safetensors").is_file()

    # a fine-tune (--init) keeps its head's draft vocabulary, not one cut from its own data (here one kind's)
    head_d2t, cut_d2t = (
        load_file(d / "model.safetensors")["d2t"] for d in (tmp_path / "head", tmp_path / "head_sampled")
    )
    assert not torch.equal(head_d2t, cut_d2t)  # the two data cut different vocabularies
    tuned = [*alone[:6], "--work-dir", str(tmp_path / "w_tuned"), "--out", str(tmp_path / "head_tuned"), *alone[10:]]
    train_eagle.main([*tuned, "--steps", "2", "--init", str(tmp_path / "head")])
    assert torch.equal(load_file(tmp_path / "head_tuned" / "model.safetensors")["d2t"], head_d2t)
    exported = train_eagle.main([*tuned, "--export", "--out", str(tmp_path / "head_tuned_export")])
    assert torch.equal(load_file(tmp_path / "head_tuned_export" / "model.safetensors")["d2t"], head_d2t)
    assert train_eagle.init_vocab({"d2t": head_d2t.float()}, 32) is None  # another K: the run cuts its own
    foreign = tmp_path / "head_foreign"  # a head whose vocabulary reaches past this target's 300 ids
    foreign.mkdir()
    (foreign / "config.json").write_text((tmp_path / "head" / "config.json").read_text())
    weights = load_file(tmp_path / "head" / "model.safetensors")
    save_file(weights | {"d2t": weights["d2t"] + 1000}, str(foreign / "model.safetensors"))
    with pytest.raises(ValueError, match="outside this target's 300"):
        train_eagle.main([*tuned[:7], str(tmp_path / "w_foreign"), *tuned[8:], "--steps", "1", "--init", str(foreign)])

    other = make_model(tmp_path / "other", "llama_gqa", vocab_size=300, hidden=48, layers=3)
    make_tokenizer(other)
    eagle_data.main(["--target", str(other), "--limit", "3", "--batch", "3", "--max-tokens", "4", "--out",
                     str(tmp_path / "other_data"), "--dtype", "float32"])  # fmt: skip
    with pytest.raises(ValueError, match="streams of width"):
        eagle_data.ShardSet([tmp_path / "greedy", tmp_path / "other_data"]).reload()
    with pytest.raises(ValueError, match="data of another target"):
        train_eagle.main([*argv[:5], str(tmp_path / "other_data"), "--work-dir", str(tmp_path / "w2"), *argv[9:]])


def test_eagle3_answers_travel_without_features(tmp_path):
    """``--save-answers`` writes a run's answers without features; ``--answers`` turns them back into the same shards
    (tokens, labels, features, temperature) on another run with the target, resuming past prompts already done;
    a file holding another vocabulary's tokens, a missing file and a missing target are refused."""
    from tiny_models import make_tokenizer

    from spec_engine.training import eagle_data

    target = make_model(tmp_path / "target", "llama_gqa", vocab_size=300, hidden=32, layers=3, logit_scale=4.0)
    make_tokenizer(target)
    common = ["--target", str(target), "--limit", "6", "--batch", "3", "--max-tokens", "8", "--dtype", "float32"]
    eagle_data.main([*common, "--out", str(tmp_path / "sampled"), "--temperature", "1.0", "--seed", "1"])
    answers = tmp_path / "sampled.xz"
    eagle_data.main(["--out", str(tmp_path / "sampled"), "--save-answers", str(answers)])
    first = sorted((tmp_path / "sampled").glob("shard_*.pt"))
    again = tmp_path / "again"
    again.mkdir()
    (again / "shard_00000.pt").write_bytes(first[0].read_bytes())  # a run stopped after its first shard
    eagle_data.main([*common, "--out", str(again), "--answers", str(answers)])
    second = sorted(again.glob("shard_*.pt"))
    assert len(second) == len(first) == 2
    for a, b in zip(first, second):
        a, b = torch.load(a), torch.load(b)
        assert a["temperature"] == b["temperature"] == 1.0
        for k in ("ids", "offsets", "prompt_lens", "tokens", "next", "features"):
            assert torch.equal(a[k], b[k]), k

    shards = eagle_data.load_answers(answers)
    shards[1]["tokens"][-1] = 300  # past the vocabulary
    planted = tmp_path / "planted.xz"
    with lzma.open(planted, "wb") as fh:
        torch.save(shards, fh)
    with pytest.raises(ValueError, match="past this target's vocabulary"):
        eagle_data.main([*common, "--out", str(tmp_path / "planted"), "--answers", str(planted)])
    never = str(tmp_path / "never")
    for bad in ([*common, "--out", never, "--answers", str(tmp_path / "none.xz")], ["--out", never]):  # no target
        with pytest.raises(SystemExit):
            eagle_data.main(bad)
    with pytest.raises(SystemExit):  # (one line: no shard_*.pt to take answers from)
        eagle_data.main(["--out", str(tmp_path), "--save-answers", str(tmp_path / "empty.xz")])
    assert not (tmp_path / "never").exists() and not (tmp_path / "empty.xz").exists()


def test_shipped_drafter_resolution(models):
    """A model-drafter method given no "model" takes the drafter shipped for the target, recognised by its
    architecture; a target nothing ships for gets a ValueError naming the missing key."""
    from spec_engine.zoo import MODELS_DIR, SMOLLM2_135M, shipped_drafter, target_signature

    embedded = ModelConfig.from_dir(MODELS_DIR / "target")
    assert shipped_drafter(embedded, "eagle") == str(MODELS_DIR / "eagle")
    assert shipped_drafter(embedded, "draft_model") == str(MODELS_DIR / "draft")
    smol = ModelConfig.from_dict({"model_type": "llama", "vocab_size": 49152, "hidden_size": 576,
                                  "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
                                  "num_key_value_heads": 3, "rope_theta": 100000.0})  # fmt: skip
    assert target_signature(smol) == SMOLLM2_135M
    if (MODELS_DIR / "smollm2-eagle3" / "config.json").is_file():
        assert shipped_drafter(smol, "eagle") == str(MODELS_DIR / "smollm2-eagle3")
    with pytest.raises(ValueError, match="needs 'model'"):
        shipped_drafter(smol, "draft_model")
    with pytest.raises(ValueError, match="no 'eagle' drafter ships"):
        LLM(str(models[0]), speculative_config={"method": "eagle"})


SMOLLM2_CHAT = ["Write a Python function that reverses a string.", "What is the capital of France?",
                "Explain what a hash table is."]  # fmt: skip


@pytest.fixture(scope="module")
def smollm2_head(smollm2):
    """SmolLM2-135M-Instruct's GGUF (pulled from the registry: conftest's ``smollm2``) with its shipped head, or a
    skip."""
    from spec_engine.zoo import MODELS_DIR

    if not (MODELS_DIR / "smollm2-eagle3" / "config.json").is_file():
        pytest.skip("no shipped SmolLM2 head (python -m spec_engine.training.train_eagle --layout eagle3)")
    return str(smollm2)


def test_shipped_smollm2_head_is_lossless(smollm2_head):
    """{"method": "eagle"} with no model takes the shipped EAGLE-3 head for SmolLM2; greedy chat answers are the
    plain target's, token for token."""
    from spec_engine.training.eagle_data import chatml

    spec = {"method": "eagle", "num_speculative_tokens": 3}
    llm = LLM(smollm2_head, speculative_config=spec, dtype="bfloat16", max_model_len=256)
    assert llm.speculative_config["model"].endswith("smollm2-eagle3")
    plain = LLM(smollm2_head, dtype="bfloat16", max_model_len=256)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    prompts = [chatml(p) for p in SMOLLM2_CHAT]
    outs = llm.generate(prompts, params, use_tqdm=False)
    refs = plain.generate(prompts, params, use_tqdm=False)
    for o, r in zip(outs, refs):
        assert o.outputs[0].token_ids == r.outputs[0].token_ids
    assert sum(o.metrics["num_accepted"] for o in outs) > 0


def test_smollm2_head_native_steps_draft_as_the_regular_step(smollm2_head):
    """The shipped EAGLE-3 head in the engine's native speculative steps (spec_chain: the head's catch-up and chain,
    the target's pass capturing its streams, the accepted positions' features stored, all in C++) drafts what the
    regular Python step drafts: float32, the same tokens and the same accepted drafts per request (a wrong feature
    stored or read would change the head's guesses)."""
    from spec_engine.engine import EngineConfig
    from spec_engine.training.eagle_data import chatml

    spec = {"method": "eagle", "num_speculative_tokens": 3}
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    prompts = [chatml(p) for p in SMOLLM2_CHAT[:3]]
    runs = {}
    for steps in (16, 0):
        llm = LLM(smollm2_head, speculative_config=spec, dtype="float32", max_model_len=256,
                  engine_config=EngineConfig(spec_chain_steps=steps))  # fmt: skip
        outs = llm.generate(prompts, params, use_tqdm=False)
        runs[steps] = [(o.outputs[0].token_ids, o.metrics["num_accepted"]) for o in outs], llm.engine.stats
    (native, native_stats), (regular, regular_stats) = runs[16], runs[0]
    assert native == regular
    assert sum(n for _, n in native) > 0
    assert native_stats["num_regular_steps"] < regular_stats["num_regular_steps"] // 2  # the native steps ran


def test_adaptive_eagle_chains_stop_at_their_own_depth(models):
    """``"auto"`` caps an EAGLE head's chains at EAGLE_ADAPTIVE_MAX_GAMMA, alone and in the hybrid (the chains alone:
    "chain"; a GPU's default); a draft model's chains and an EAGLE-2 dynamic tree keep ADAPTIVE_MAX_GAMMA, and a
    fixed depth is the user's."""
    from spec_engine.config import ADAPTIVE_MAX_GAMMA, EAGLE_ADAPTIVE_MAX_GAMMA, parse_speculative_config

    _, head = models
    assert EAGLE_ADAPTIVE_MAX_GAMMA < ADAPTIVE_MAX_GAMMA
    for method in ("eagle", "hybrid"):
        for extra, device in (({"tree": "chain"}, "cpu"), ({}, "cuda")):
            spec = parse_speculative_config({"method": method, "model": str(head), **extra}, device)
            assert spec["adaptive"] and spec["num_speculative_tokens"] == EAGLE_ADAPTIVE_MAX_GAMMA, method
    dynamic = parse_speculative_config({"method": "eagle", "model": str(head), "tree": "dynamic"})
    assert dynamic["num_speculative_tokens"] == ADAPTIVE_MAX_GAMMA
    fixed = parse_speculative_config({"method": "eagle", "model": str(head), "num_speculative_tokens": 6})
    assert not fixed["adaptive"] and fixed["num_speculative_tokens"] == 6
    llm = _llm(models, {"tree": "chain"})
    assert llm.engine.gamma == EAGLE_ADAPTIVE_MAX_GAMMA
