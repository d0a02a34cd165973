"""EAGLE-2's dynamic draft tree in the native steps (issue 66): an EAGLE-3 head's dynamic trees drafted in C++
(``HeadDraft::dynamic_tree``: ``spec_chain``'s steps and the regular step's one ``eagle3_draft`` call) against the
Python reference (``EagleDrafter._dynamic_levels`` on ``dynamic_level``'s rule), on a small random head.

- the same drafts (tokens, parents, masks) at every regular step, bit for bit, greedy and seeded;
- the native steps (``spec_chain``, the plan history says they ran) emit the Python path's tokens with its
  acceptances and leave the same caches (target, head, features), bit for bit, float32 and bfloat16; both are plain
  decoding's tokens;
- a planted bug in the reference (children ranked by their own log q, not their path's) is caught;
- bad ``topk`` arguments raise clear errors.
"""

from __future__ import annotations

import pytest
import torch
from test_eagle import write_published_head
from tiny_models import make_model

import spec_engine.drafters.eagle as eagle_module
from spec_engine import LLM, SamplingParams
from spec_engine.drafters.eagle import EagleDrafter
from spec_engine.engine import EngineConfig
from spec_engine.step import REGULAR, SPEC_CHAIN
from spec_kernels.decoder_layers import eagle3_draft, spec_chain

VOCAB, DRAFT_VOCAB = 16, 8  # the head drafts the even target tokens
PROMPTS = [[5, 11, 3, 6, 12, 7, 5, 11, 3], [1, 2, 3, 4, 1, 2], [9]]
MAX_TOKENS = 28


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("dyntree")
    target = make_model(root / "target", "llama_gqa", vocab_size=VOCAB, logit_scale=3.0)
    return str(target), str(write_published_head(root / "head", "eagle3", vocab=VOCAB, draft_vocab=DRAFT_VOCAB))


def _llm(pair, dtype: str, *, topk: int | None, gamma: int | str = 3, steps: int = 16) -> LLM:
    target, head = pair
    spec = None
    if topk is not None:
        spec = {
            "method": "eagle",
            "model": head,
            "num_speculative_tokens": gamma,
            "tree": "dynamic",
            "eagle_topk": topk,
        }
    return LLM(target, speculative_config=spec, dtype=dtype, max_model_len=128,
               engine_config=EngineConfig(spec_chain_steps=steps, unsure_chain_steps=min(steps, 4)))  # fmt: skip


def _run(llm: LLM, params, monkeypatch, drafts: list | None = None, python: bool = False) -> dict:
    """Tokens, per-request acceptance, plans and committed caches of one generation; each regular step's draft into
    ``drafts``. ``python``: the reference drafts the trees, every level of the head as torch ops
    (``EagleDrafter._dynamic_levels``, the regular step's path before the native one; the catch-up stays native)."""
    engine, committed = llm.engine, {}
    release = engine.scheduler.release

    def keep(req):  # each request's committed positions, before its blocks go to another request
        committed[req.request_id] = _committed(engine, req)
        release(req)

    with monkeypatch.context() as m:
        m.setattr(engine.scheduler, "release", keep)
        if drafts is not None:
            propose = EagleDrafter.propose
            m.setattr(EagleDrafter, "propose", lambda self, b: drafts.append(propose(self, b)) or drafts[-1])
        if python:
            m.setattr(EagleDrafter, "native", property(lambda self: None))
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return {
        "tokens": [o.outputs[0].token_ids for o in outs],
        "accepted": [(o.metrics["num_accepted"], o.metrics["accepted_length_hist"]) for o in outs],
        "plans": list(engine.plan_history),
        "caches": [committed[o.request_id] for o in outs],
    }


def _committed(engine, req) -> list[torch.Tensor]:
    """``req``'s committed cache entries: the target's K/V and the head's features at positions < L_b, the head's
    K/V at positions < its own cache's length (what lies past them is scratch the next step overwrites)."""

    def entries(cache: torch.Tensor, dim: int, length: int) -> torch.Tensor:
        block_size = cache.shape[dim + 1]
        positions = torch.arange(length)
        blocks = torch.tensor(req.blocks)[positions // block_size]
        return cache.movedim((dim, dim + 1), (0, 1))[blocks, positions % block_size].clone()

    out = [entries(engine.runner.kv.data, 2, req.cache_seqlen)]
    if engine.drafter is not None:
        out += [
            entries(engine.drafter.kv.data, 2, req.draft_len),
            entries(engine.drafter.features, 1, req.cache_seqlen),
        ]
    return out


def _same_drafts(a: list, b: list) -> bool:
    """The same trees: parents, masks and the tokens of their nodes (a row drafted shallower than the step's deepest
    pads its tree with nodes whose tokens nothing reads: drafted past its blocks, on the scratch block)."""

    return len(a) == len(b) and all(
        torch.equal(x.parents, y.parents)
        and torch.equal(x.tree_mask, y.tree_mask)
        and torch.equal(x.tokens[:, 0], y.tokens[:, 0])
        and torch.equal(torch.where(x.parents >= 0, x.tokens, -1), torch.where(y.parents >= 0, y.tokens, -1))
        for x, y in zip(a, b)
    )


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("topk", [2, 3])
def test_native_dynamic_trees_match_the_python_tree_path(pair, monkeypatch, dtype, topk):
    """Native steps (``spec_chain`` with ``topk``), regular steps drafting natively (``eagle3_draft`` with ``topk``)
    and the Python reference: plain decoding's tokens, and the same drafts, acceptances and committed caches, bit for
    bit. In bfloat16 the reference's head layer, as torch ops, rounds otherwise than the C++ layer (a pre-existing
    difference: test_eagle.py's test_native_eagle3_draft_matches_the_head_op_by_op), so its drafts may part at a
    near-tie there: the two native paths are compared with each other, the reference by its tokens."""
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    plain = _run(_llm(pair, dtype, topk=None), params, monkeypatch)["tokens"]
    native = _run(_llm(pair, dtype, topk=topk), params, monkeypatch)
    reference_drafts, regular_drafts = [], []
    reference = _run(_llm(pair, dtype, topk=topk, steps=0), params, monkeypatch, reference_drafts, python=True)
    regular = _run(_llm(pair, dtype, topk=topk, steps=0), params, monkeypatch, regular_drafts)

    assert native["tokens"] == reference["tokens"] == regular["tokens"] == plain
    steps = {path: sum(p.steps_ran for p in native["plans"] if p.path == path) for path in (SPEC_CHAIN, REGULAR)}
    assert steps[SPEC_CHAIN] > steps[REGULAR], f"the native steps must have run the trees: {steps}"
    assert all(p.path != SPEC_CHAIN for p in reference["plans"] + regular["plans"])
    assert sum(n for n, _ in regular["accepted"]) > 0 and len(regular_drafts) > 10
    # rows near their max_tokens draft shallower trees, padded in a step's deepest: the padding is compared too
    assert any(((d.parents[:, 1:] < 0).any(1) & (d.parents[:, 1:] >= 0).any(1)).any() for d in regular_drafts)
    # below level 1, node i of the shape's numbering hangs from node i - k: the trees chose others
    assert any(
        ((d.parents != torch.arange(d.parents.shape[1]) - topk) & (d.parents >= 1)).any() for d in regular_drafts
    )
    assert native["accepted"] == regular["accepted"]
    assert all(map(torch.equal, sum(native["caches"], []), sum(regular["caches"], [])))
    if dtype == "float32":
        assert _same_drafts(regular_drafts, reference_drafts)
        assert reference["accepted"] == regular["accepted"]
        assert all(map(torch.equal, sum(reference["caches"], []), sum(regular["caches"], [])))


def test_seeded_rows_draft_dynamic_trees_natively(pair, monkeypatch):
    """Seeded (coupled) rows take ``spec_chain``'s dynamic trees, and on the regular step the native ``eagle3_draft``
    drafts the reference's trees (tests/test_coupled_trees.py: their rule); the seeded tokens are plain sampling's."""
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=s, ignore_eos=True) for s in (3, 4, 5)]
    plain = _run(_llm(pair, "float32", topk=None), params, monkeypatch)["tokens"]
    native_drafts, reference_drafts = [], []
    chained = _run(_llm(pair, "float32", topk=3), params, monkeypatch)
    native = _run(_llm(pair, "float32", topk=3, steps=0), params, monkeypatch, native_drafts)
    reference = _run(_llm(pair, "float32", topk=3, steps=0), params, monkeypatch, reference_drafts, python=True)
    assert chained["tokens"] == native["tokens"] == reference["tokens"] == plain
    assert any(p.path == SPEC_CHAIN for p in chained["plans"]) and len(native_drafts) > 10
    assert chained["accepted"] == native["accepted"]
    assert _same_drafts(native_drafts, reference_drafts)


@pytest.mark.parametrize("steps", [16, 0])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_adaptive_dynamic_trees_keep_plain_tokens(pair, monkeypatch, dtype, steps):
    """Under the adaptive controller (its depths per row and step), native calls or regular steps: plain decoding's
    tokens."""
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    plain = _run(_llm(pair, dtype, topk=None), params, monkeypatch)["tokens"]
    llm = _llm(pair, dtype, topk=3, gamma="auto", steps=steps)
    assert _run(llm, params, monkeypatch)["tokens"] == plain
    assert llm.engine.stats["num_drafted"] > 0


def test_a_planted_bug_in_the_reference_is_caught(pair, monkeypatch):
    """Children ranked by their own log q instead of their path's (the reference's parent scores dropped): its drafts
    are no longer the native ones, which the comparison above would report."""
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    native_drafts, planted_drafts = [], []
    _run(_llm(pair, "float32", topk=3, steps=0), params, monkeypatch, native_drafts)
    honest = eagle_module.dynamic_level
    monkeypatch.setattr(eagle_module, "dynamic_level", lambda logits, scores, k: honest(logits, 0 * scores, k))
    _run(_llm(pair, "float32", topk=3, steps=0), params, monkeypatch, planted_drafts, python=True)
    assert not _same_drafts(native_drafts, planted_drafts)


def test_a_dynamic_tree_wider_than_the_draft_vocabulary_stays_on_the_python_path(pair, monkeypatch):
    """k above the head's draft vocabulary: the native ops refuse it, so the drafter offers no native handle and the
    reference drafts it (over the target's whole vocabulary), still plain decoding's tokens."""
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    llm = _llm(pair, "float32", topk=DRAFT_VOCAB + 1, gamma=2)
    assert llm.engine.drafter.native is None and llm.engine.runner.native_draft is None
    plain = _run(_llm(pair, "float32", topk=None), params, monkeypatch)["tokens"]
    assert _run(llm, params, monkeypatch)["tokens"] == plain


def test_bad_topk_arguments_raise_clear_errors(pair):
    llm = _llm(pair, "float32", topk=2)
    runner, drafter = llm.engine.runner, llm.engine.drafter
    head, target = runner.native_draft, runner.native_target
    B = 1
    table = torch.zeros(B, 4, dtype=torch.int32)
    one = torch.ones(B, dtype=torch.int64)

    def chain(gamma=2, **kw):
        spec_chain(target, head, torch.full((B, 1), 3), one, 4 * one, runner.kv.data, drafter.kv.data, table,
                   8 * one, torch.zeros(0, dtype=torch.int64), gamma=gamma, max_steps=1,
                   draft_features=drafter.features, **kw)  # fmt: skip

    with pytest.raises(ValueError, match=r"topk .* must be in \[0, 8\] \(the draft vocabulary\), got -1"):
        chain(topk=-1)
    with pytest.raises(ValueError, match=r"topk .* must be in \[0, 8\] \(the draft vocabulary\), got 9"):
        chain(topk=DRAFT_VOCAB + 1)
    with pytest.raises(ValueError, match=r"a dynamic tree of topk 2 and gamma 2 has the shape \[2, 1\], got tree"):
        chain(topk=2, tree=[2, 2])
    with pytest.raises(ValueError, match="a tree of at most 1024 nodes"):
        chain(gamma=128, topk=DRAFT_VOCAB)
    with pytest.raises(ValueError, match="sampled rows draft an EAGLE-3 head's chains or dynamic trees"):
        chain(tree=[2, 1], temperature=torch.ones(B), noise_seeds=one)
    with pytest.raises(ValueError, match="a draft model drafts chains"):
        spec_chain(target, target, torch.full((B, 1), 3), one, 4 * one, runner.kv.data, runner.kv.data, table,
                   8 * one, torch.zeros(0, dtype=torch.int64), gamma=2, max_steps=1, topk=2)  # fmt: skip
    tokens, zero = torch.full((B, 1), 3), torch.zeros(B, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"eagle3_draft: topk .* got 9"):
        eagle3_draft(head, tokens, 4 * one, zero, drafter.features, drafter.kv.data, gamma=2, block_table=table, topk=9)
    with pytest.raises(ValueError, match=r"noise must be \[B, gamma, K\] = \[1, 2, 8\] float32"):
        eagle3_draft(head, tokens, 4 * one, zero, drafter.features, drafter.kv.data, gamma=2, block_table=table,
                     topk=2, inv_temp=torch.ones(B), noise=torch.zeros(B, 3, DRAFT_VOCAB))  # fmt: skip
