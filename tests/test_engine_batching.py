"""Continuous batching (admission, chunked prefill, KV accounting) and adaptive speculation (spec_engine/adaptive.py).

Batch-invariance is exact here: a request's greedy tokens, and its seeded samples, do not depend on the requests
that share its steps (per-row seeds are derived from the request seed and position).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from tiny_models import make_model, make_noisy_copy

from bench.replay_adaptive import StubRequest
from spec_engine import LLM, SamplingParams
from spec_engine.adaptive import MAX_PROBE_INTERVAL, PROBE_INTERVAL, AdaptiveController
from spec_engine.config import ADAPTIVE_MAX_GAMMA, parse_speculative_config
from spec_engine.estimates import AcceptanceEstimate

PROMPTS = [[5, 17, 3, 60, 42, 7, 5, 17, 3], [1, 2, 3, 4, 1, 2], [77], [9] * 20, [30, 31], [4, 8, 15, 16, 23, 42],
           list(range(40, 75)), [2, 90, 2, 90, 2]]  # fmt: skip
MAX_TOKENS = [12, 20, 7, 16, 25, 9, 14, 18]
TARGET_LAYERS = 8


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """target; noisy: a noisy copy (agrees often); same: the target's function at 1/8 the layers; random."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("batching")
    target = make_model(root / "target", "llama_gqa", layers=TARGET_LAYERS, logit_scale=4.0)
    with torch.no_grad():  # layers 1.. add nothing to the residual stream: the target equals its first layer
        hf = AutoModelForCausalLM.from_pretrained(target)
        for layer in hf.model.layers[1:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        hf.save_pretrained(target)
        hf.model.layers = hf.model.layers[:1]
        hf.config.num_hidden_layers = 1
        hf.save_pretrained(root / "same")
    return {
        "target": str(target),
        "noisy": str(make_noisy_copy(target, root / "noisy", noise=0.3)),
        "same": str(root / "same"),
        "random": str(make_model(root / "random", "llama_gqa", layers=1, seed=7, logit_scale=4.0)),
    }


def _llm(models, draft=None, gamma=3, **kw):
    spec = None if draft is None else {"model": models[draft], "num_speculative_tokens": gamma}
    return LLM(models["target"], speculative_config=spec, max_model_len=128, **kw)


def _generate(llm, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _params(temperature=0.0):
    return [SamplingParams(max_tokens=n, temperature=temperature, seed=100 + i, ignore_eos=True)
            for i, n in enumerate(MAX_TOKENS)]  # fmt: skip


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_batched_equals_one_at_a_time(models, temperature):
    llm = _llm(models, "noisy", max_num_seqs=3)
    params = _params(temperature)
    batched = _generate(llm, PROMPTS, params)
    alone = [_generate(llm, [p], [sp])[0] for p, sp in zip(PROMPTS, params)]
    assert batched == alone
    assert [len(t) for t in batched] == MAX_TOKENS
    assert llm.engine.stats["num_accepted"] > 0  # the draft really was used
    assert llm.allocator.num_used == 0


def test_arrivals_while_running_are_served(models):
    llm = _llm(models, "noisy", max_num_seqs=3)
    params = _params()
    alone = [_generate(llm, [p], [sp])[0] for p, sp in zip(PROMPTS, params)]
    engine = llm.engine
    reqs = [engine.add_request(PROMPTS[i], params[i]) for i in range(2)]
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        if steps % 2 == 0 and len(reqs) < len(PROMPTS):  # a new request every other step, while others decode
            reqs.append(engine.add_request(PROMPTS[len(reqs)], params[len(reqs)]))
            assert engine.running, "arrivals must join a running batch, not wait for it to drain"
    assert len(reqs) == len(PROMPTS)
    assert [r.output_token_ids for r in reqs] == alone
    assert all(r.finish_reason == "length" for r in reqs)
    assert llm.allocator.num_used == 0


def test_kv_accounting_returns_to_zero_after_aborts(models):
    llm = _llm(models, "noisy", max_num_seqs=3)
    engine = llm.engine
    reqs = [engine.add_request(p, sp) for p, sp in zip(PROMPTS, _params())]
    engine.step()
    engine.step()
    assert llm.allocator.num_used > 0
    engine.abort(engine.running[0].request_id)  # one decoding
    never_ran = engine.waiting[-1]
    engine.abort(never_ran.request_id)  # one not yet admitted
    while engine.has_unfinished():
        engine.step()
    assert sum(r.finish_reason == "abort" for r in reqs) == 2
    assert never_ran.metrics.as_dict(0)["time_to_first_token"] is None  # (no first token: not a negative time)
    assert llm.allocator.num_used == 0
    engine.add_request(PROMPTS[0], SamplingParams(max_tokens=50))
    engine.step()
    engine.abort(engine.running[0].request_id)
    assert llm.allocator.num_used == 0 and not engine.has_unfinished()


def test_a_step_never_runs_a_finished_request_on_another_requests_blocks(models):
    """A decode step raises after one of its requests finished (blocks freed, slot released): the engine runs the
    step's requests again one by one (``Engine._isolated``). The finished one must not run on row -1 of the block
    table, the last slot's: that is another request's, and its committed K/V were overwritten (position 5 of a
    60-token prompt here)."""
    llm = _llm(models, max_num_seqs=3)
    engine = llm.engine
    long_prompt = list(range(20, 80))
    alone = _generate(llm, [long_prompt], [SamplingParams(max_tokens=8, ignore_eos=True)])[0]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (2, 8, 8)]
    short, _, victim = (engine.add_request(p, sp) for p, sp in zip(([5, 6, 7, 8], [9, 10, 11], long_prompt), params))
    finish, seen = engine._finish, {}

    def finish_then_raise(req, reason):
        finish(req, reason)
        if req is short and not seen:  # the victim's K/V before the step's requests run again
            block = victim.blocks[0]
            seen["block"], seen["kv"] = block, engine.kv.data[:, :, block].clone()
            raise RuntimeError("a bug after a request finished")

    engine._finish = finish_then_raise
    while engine.has_unfinished():
        engine.step()
        if seen and "after" not in seen:
            seen["after"] = engine.kv.data[:, :, seen["block"]].clone()
    assert victim.slot == -1 and victim.output_token_ids == alone
    assert short.finish_reason == "length" and len(short.output_token_ids) == 2  # reported as it finished, not re-run
    assert engine.stats["num_retried_steps"] == 1 and engine.stats["num_errors"] == 0
    assert torch.equal(seen["after"], seen["kv"])  # (the victim's first block: all of it committed prompt K/V)


def _kv_budget(models, num_blocks: int, block_size: int) -> int:
    """Bytes that plan_num_blocks turns into exactly ``num_blocks`` blocks for the target alone (float32)."""
    cfg = json.loads(open(f"{models['target']}/config.json").read())
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * 4
    return per_token * block_size * num_blocks


def test_request_larger_than_cache_errors_and_others_take_turns(models):
    # A cache that cannot hold one full-context request (64 tokens + the 1-node tree of plain decoding = 5 blocks of
    # 16, plus scratch) is refused when the LLM is built, so no admitted request can ever be too large to run.
    with pytest.raises(ValueError, match="Raise the budget"):
        LLM(models["target"], max_model_len=64, block_size=16, kv_cache_memory=_kv_budget(models, 5, 16))
    llm = LLM(models["target"], max_model_len=64, block_size=16, kv_cache_memory=_kv_budget(models, 6, 16))
    assert llm.allocator.num_blocks == 6
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate({"prompt_token_ids": [1] * 40}, SamplingParams(max_tokens=25), use_tqdm=False)
    assert not llm.engine.has_unfinished() and llm.allocator.num_used == 0
    alone = _generate(llm, [[3, 4, 5]], [SamplingParams(max_tokens=40, ignore_eos=True)])[0]
    # two requests of 3 blocks each (5 usable): both start on the blocks of their first call; as they grow, the
    # newer is preempted, the older finishes, then the newer is prefilled again, output included, and finishes
    engine = llm.engine
    reqs = [engine.add_request([3, 4, 5], SamplingParams(max_tokens=40, ignore_eos=True)) for _ in range(2)]
    engine.step()
    assert len(engine.running) == 2 and not engine.waiting
    started = None
    while engine.has_unfinished():
        engine.step()
        if reqs[1].metrics.num_preemptions and started is None:
            started = reqs[1].metrics.decode_start  # (its rate counts from its first decode, not its resumption)
    assert [r.output_token_ids for r in reqs] == [alone, alone]
    assert [r.metrics.num_preemptions for r in reqs] == [0, 1] and engine.stats["num_preemptions"] == 1
    assert started is not None and reqs[1].metrics.decode_start == started
    assert llm.allocator.num_used == 0


def test_a_request_preempted_while_prefilling_and_one_aborted_while_it_waits(models, monkeypatch):
    """A request preempted halfway through its prompt (chunks of 4) is prefilled again from the start: its tokens and
    prompt log-probabilities are those of a cache that holds it, none counted twice. One aborted while it waits after
    a preemption is finished at once, and the other request's tokens do not change."""
    import spec_engine.llm as llm_mod

    params = [SamplingParams(max_tokens=55, ignore_eos=True), SamplingParams(max_tokens=20, ignore_eos=True,
                                                                              prompt_logprobs=1)]  # fmt: skip
    prompts = [[3, 4, 5], list(range(10, 40))]
    kw = {"max_model_len": 64, "block_size": 16, "prefill_chunk": 4}
    ample = LLM(models["target"], **kw).generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    monkeypatch.setattr(llm_mod, "plan_num_blocks", lambda *args: 6)
    llm = LLM(models["target"], **kw)
    engine = llm.engine
    a = engine.add_request(prompts[0], params[0])
    engine.step()
    b = engine.add_request(prompts[1], params[1])
    preempted_prefilling = False
    while engine.has_unfinished():
        prefilling = b.slot >= 0 and b.prefilling
        engine.step()
        preempted_prefilling |= prefilling and b.metrics.num_preemptions == 1 and b.slot < 0
    assert preempted_prefilling
    assert [a.output_token_ids, b.output_token_ids] == [o.outputs[0].token_ids for o in ample]
    assert b.prompt_logprobs == ample[1].prompt_logprobs and len(b.prompt_logprobs) == len(prompts[1])
    assert llm.allocator.num_used == 0
    # the same again, the preempted request aborted while it waits
    a = engine.add_request(prompts[0], params[0])
    engine.step()
    b = engine.add_request(prompts[1], params[1])
    while not b.metrics.num_preemptions:
        engine.step()
    assert b in engine.waiting
    engine.abort(b.request_id)
    assert b.finish_reason == "abort" and b not in engine.waiting
    while engine.has_unfinished():
        engine.step()
    assert a.output_token_ids == ample[0].outputs[0].token_ids and llm.allocator.num_used == 0


LONG_TOKENS = [120, 90, 150, 60, 110, 130, 75, 100]


@pytest.mark.parametrize("spec", [None, "fixed", "adaptive", "suffix"])
def test_preempted_requests_emit_what_they_would_have(models, spec):
    """Eight requests of 60-150 tokens on a cache that holds about two at their longest: they start on the blocks of
    their first decode call, grow, and the newest are preempted and prefilled again (prompt and output) later. Each
    request's greedy tokens, seeded samples and log-probabilities are those of a cache that holds them all."""
    config = {"fixed": {"model": models["noisy"], "num_speculative_tokens": 3}, "adaptive": {"model": models["noisy"]},
              "suffix": {"method": "suffix"}}.get(spec)  # fmt: skip
    params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.8 if i % 3 == 1 else 0.0, seed=7 + i,
                             logprobs=2 if i == 2 else None, prompt_logprobs=1 if i == 5 else None)
              for i, n in enumerate(LONG_TOKENS)]  # fmt: skip
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]

    def run(llm):
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert llm.allocator.num_used == 0
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs, o.prompt_logprobs) for o in outs], llm.engine.stats

    kw = {"speculative_config": config, "max_model_len": 256, "block_size": 16, "max_num_seqs": 8}
    llm = LLM(models["target"], **kw)
    caches = [llm.engine.kv.data, *([llm.engine.drafter.kv.data] if spec in ("fixed", "adaptive") else [])]
    per_block = sum(c.nbytes for c in caches) // llm.allocator.num_blocks  # (the draft model's cache beside)
    ample, ample_stats = run(llm)
    tight_llm = LLM(models["target"], kv_cache_memory=19 * per_block, **kw)
    assert tight_llm.allocator.num_blocks == 19
    tight, tight_stats = run(tight_llm)
    assert ample_stats["num_preemptions"] == 0 and tight_stats["num_preemptions"] >= 2
    assert tight == ample
    assert [len(t[0]) for t in tight] == LONG_TOKENS
    if spec is not None:
        assert tight_stats["num_accepted"] > 0


def test_mixed_row_depths_keep_greedy_tokens(models):
    """Rows drafted at different depths (0 included: the drafter then runs on the other rows only) change nothing."""
    reference = _generate(_llm(models, None, max_num_seqs=8), PROMPTS, _params())
    llm = _llm(models, "noisy", gamma=4, max_num_seqs=8)
    pattern = [4, 0, 2, 0, 1, 3, 0, 4]
    llm.engine.choose_gammas = lambda reqs: [pattern[int(r.request_id) % 8] for r in reqs]
    assert _generate(llm, PROMPTS, _params()) == reference
    sampled = _generate(llm, PROMPTS, _params(temperature=0.8))
    assert all(0 <= t < 96 for toks in sampled for t in toks) and [len(t) for t in sampled] == MAX_TOKENS
    assert llm.allocator.num_used == 0


def _adaptive(models, draft):
    """An adaptive engine whose controller sees modelled step costs, not the wall clock: a target pass of 10 ms +
    0.1 ms per token, a draft forward of 2 ms. Its decisions then depend on acceptance alone, never on the load
    of the machine running the test (a loaded CI machine once timed one step slow and switched a perfect draft off)."""
    llm = LLM(models["target"], speculative_config={"model": models[draft]}, max_model_len=128)
    engine, ctl = llm.engine, llm.engine.controller
    assert ctl is not None and engine.gamma == ADAPTIVE_MAX_GAMMA
    observe = ctl.observe

    def observe_modelled_costs(reqs, gammas, num_accepted, draft_seconds, step_seconds, steps=1, timed=True,
                               width=None, ranks=None):  # fmt: skip
        G = max(gammas)
        width = len(reqs) * engine.drafter.nodes_for_gamma(G) if width is None else width
        t_draft = 2e-3 * G
        t_target = 10e-3 + 0.1e-3 * width
        observe(reqs, gammas, num_accepted, t_draft, t_draft + t_target, steps, timed, width, ranks)

    ctl.observe = observe_modelled_costs
    return llm


def test_adaptive_useless_draft_falls_to_zero(models):
    llm = _adaptive(models, "random")
    out = llm.generate({"prompt_token_ids": PROMPTS[0]}, SamplingParams(max_tokens=60, ignore_eos=True),
                       use_tqdm=False)[0]  # fmt: skip
    history = list(llm.engine.gamma_history)
    assert history[0] == ADAPTIVE_MAX_GAMMA  # optimistic until the costs are measured
    later = history[4:]
    assert max(later) <= 1 and later.count(0) >= 0.9 * len(later), history  # off, bar rare depth-1 probes
    assert out.metrics["alpha_estimate"] < 0.3
    # drafted steps: the optimistic start and a few shallow tries while the evidence is thin
    assert out.metrics["gamma_hist"][0] >= out.metrics["num_steps"] - 10, out.metrics["gamma_hist"]


def test_adaptive_good_draft_raises_gamma(models):
    llm = _adaptive(models, "same")
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]], SamplingParams(max_tokens=60, ignore_eos=True),
                        use_tqdm=False)  # fmt: skip
    history = list(llm.engine.gamma_history)
    assert np.median(history[:-2]) >= ADAPTIVE_MAX_GAMMA - 2, history  # the last steps need fewer tokens
    assert all(o.metrics["alpha_estimate"] > 0.9 for o in outs)
    assert outs[0].outputs[0].token_ids == _generate(_llm(models), [PROMPTS[0]], [SamplingParams(max_tokens=60)])[0]


def test_parse_speculative_config_auto():
    auto = parse_speculative_config({"model": "d"})
    assert auto["adaptive"] and auto["num_speculative_tokens"] == ADAPTIVE_MAX_GAMMA
    assert parse_speculative_config({"method": "ngram", "num_speculative_tokens": "auto"})["adaptive"]
    tree = parse_speculative_config({"model": "d", "tree": [3, 2, 1]})
    assert tree["adaptive"] and tree["num_speculative_tokens"] == 3
    fixed = parse_speculative_config({"model": "d", "num_speculative_tokens": 5})
    assert not fixed["adaptive"] and fixed["num_speculative_tokens"] == 5
    with pytest.raises(ValueError, match="'auto' or an int"):
        parse_speculative_config({"model": "d", "num_speculative_tokens": "max"})


def test_acceptance_estimate_is_the_forgetful_geometric_mle():
    for per_depth in (False, True):
        est = AcceptanceEstimate(4, per_depth=per_depth, prior=0.5)
        est.update(4, 1)  # accepted depth 1, rejected at depth 2
        est.update(4, 4)  # all accepted: no reject
        assert est.alpha == pytest.approx((4.9 + 1) / (5.8 + 2))  # decay 0.9, prior 2 pseudo-trials at 0.5
        assert est.expected_tokens(cap=3.0)[:2] == pytest.approx([1.0, 1.0 + est.depth_alphas()[0]])
        assert est.expected_tokens(cap=3.0)[-1] == 3.0
    assert np.allclose(est.accepts, [1.9, 1.0, 1.0, 1.0]) and np.allclose(est.rejects, [0, 0.9, 0, 0])
    tree = AcceptanceEstimate(2, per_depth=True, prior=0.5)
    for _ in range(20):
        tree.update(2, 1)  # depth 1 always survives, depth 2 never
    a1, a2 = tree.depth_alphas()
    assert a1 > 0.85 and a2 < 0.55


@pytest.mark.parametrize("alpha,expected", [(0.02, 0), (0.98, 8)])
def test_controller_decision_with_known_costs(alpha, expected):
    """Costs with a target pass of 10 ms + 0.1 ms per token, a draft forward of 1 ms: the scan's optimum."""
    ctl = AdaptiveController(8, lambda g: g + 1)
    ctl.target_cost.theta, ctl.target_cost.num_observed = np.array([10e-3, 1.6e-3]), 1
    ctl.draft_cost.theta, ctl.draft_cost.num_observed = np.array([1e-3, 0.0]), 1
    reqs = [
        StubRequest(
            spec_state=None, params=SamplingParams(max_tokens=100), output_token_ids=[], cache_seqlen=0, draft_len=0
        )
    ]
    ctl.population.prior = alpha
    ctl.state(reqs[0]).acceptance.num_trials = 10**6  # alpha known: no optimism bonus
    ctl.num_steps = 1  # not a probe step
    assert ctl.choose(reqs) == [expected]
    # a request that keeps failing next to one that accepts everything: it alone stops being drafted
    good, bad = (StubRequest(spec_state=None, params=SamplingParams(max_tokens=100), output_token_ids=[],
                             cache_seqlen=0, draft_len=0) for _ in range(2))  # fmt: skip
    ctl.population.prior = 0.98
    for _ in range(10):
        ctl.state(good).acceptance.update(8, 8)
        ctl.state(bad).acceptance.update(8, 0)
    ctl.draft_cost.theta = np.array([1e-3, 5e-3])  # a drafted row costs real time: one that fails is not worth it
    assert ctl.choose([good, bad]) == [8, 0]


def test_optimism_keeps_a_row_drafting_until_the_evidence_is_real():
    """Two failed steps are weak evidence: the row stays drafted (shallowly); twenty are not: it goes off."""
    ctl = AdaptiveController(8, lambda g: g + 1)
    ctl.target_cost.theta, ctl.target_cost.num_observed = (10e-3, 1.6e-3), 1
    ctl.draft_cost.theta, ctl.draft_cost.num_observed = (2e-3, 0.0), 1  # depth 1 pays off from alpha ~0.2
    req = StubRequest(spec_state=None, params=SamplingParams(max_tokens=100), output_token_ids=[],
                      cache_seqlen=0, draft_len=0)  # fmt: skip
    ctl.num_steps = 1  # not a probe step
    acceptance = ctl.state(req).acceptance
    for _ in range(2):
        acceptance.update(8, 0)
    assert acceptance.alpha < 0.28 < acceptance.alpha_optimistic  # (the earlier steps' prior: 0.245 < 0.256 before)
    assert ctl.choose([req])[0] >= 1
    for _ in range(18):
        acceptance.update(1, 0)
    ctl.num_steps = 1
    assert ctl.choose([req]) == [0]
    assert acceptance.alpha_optimistic - acceptance.alpha < 0.1


def test_margin_grows_with_the_batch():
    """A promised +11% drafts at batch 1 (margin 1.05) but not at batch 16 (margin 1.19: the closed-batch tail)."""
    ctl = AdaptiveController(8, lambda g: g + 1)
    ctl.target_cost.theta, ctl.target_cost.num_observed = (10e-3, 0.0), 1  # verification width is free here
    ctl.draft_cost.theta, ctl.draft_cost.num_observed = (0.8e-3, 0.0), 1  # 0.8 ms per draft forward
    ctl.population.prior = 0.2  # depth 1: 1.2 tokens for 10.8 ms vs 1 for 10 ms, +11%; deeper gains less

    def rows(n):
        reqs = [StubRequest(spec_state=None, params=SamplingParams(max_tokens=100), output_token_ids=[],
                            cache_seqlen=0, draft_len=0) for _ in range(n)]  # fmt: skip
        for r in reqs:
            ctl.state(r).acceptance.num_trials = 10**6  # alpha known: no optimism bonus
        return reqs

    ctl.num_steps = 1  # not a probe step
    assert ctl.choose(rows(1)) == [1]
    ctl.num_steps = 1
    assert ctl.choose(rows(16)) == [0] * 16


def test_probes_only_where_a_good_draft_could_pay():
    """Verification that costs 10 ms per 16 tokens: at batch 16 even an alpha-0.8 draft loses to plain decoding,
    so due rows are not probed (they are off for the cost, not their drafts); at batch 1 a due row with a
    useless draft is probed at depth 1, so it could recover."""
    ctl = AdaptiveController(8, lambda g: g + 1)
    ctl.target_cost.theta, ctl.target_cost.num_observed = (10e-3, 10e-3), 1
    ctl.draft_cost.theta, ctl.draft_cost.num_observed = (1e-3, 0.0), 1

    def due_rows(n, alpha):
        reqs = [StubRequest(spec_state=None, params=SamplingParams(max_tokens=100), output_token_ids=[],
                            cache_seqlen=0, draft_len=0) for _ in range(n)]  # fmt: skip
        for r in reqs:
            ctl.population.prior = alpha
            state = ctl.state(r)
            state.acceptance.num_trials = 10**6  # alpha known: no optimism bonus
            state.steps_undrafted = MAX_PROBE_INTERVAL  # the probe is due
        return reqs

    ctl.num_steps = PROBE_INTERVAL  # a probe step
    assert ctl.choose(due_rows(16, 0.7)) == [0] * 16
    ctl.num_steps += PROBE_INTERVAL  # the next one
    assert ctl.choose(due_rows(1, 0.02)) == [1]


def test_long_draft_lag_catches_up_in_chunks(models):
    """Rows undrafted for 30 steps catch their draft cache up 4 tokens per forward; the draft is the target's
    function, so every drafted token is accepted only if the cache was fed the right tokens at the right slots."""
    prompts = [PROMPTS[0], PROMPTS[3], PROMPTS[6]]
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    reference = _generate(_llm(models, None, max_num_seqs=3), prompts, [params] * 3)
    llm = _llm(models, "same", gamma=3, max_num_seqs=3)
    llm.engine.drafter.catch_up_chunk = 4
    undrafted = {"0": 30, "1": 7, "2": 0}  # steps before each request is first drafted: lags 30, 7 and 1
    llm.engine.choose_gammas = lambda reqs: [0 if r.metrics.num_steps < undrafted[r.request_id] else 3 for r in reqs]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference
    for o in outs:
        assert o.metrics["num_drafted"] > 0 and o.metrics["num_accepted"] == o.metrics["num_drafted"], o.metrics


def test_adaptive_fills_the_draft_cache_lazily(models):
    """Under the adaptive controller the draft model does not prefill: a request never drafted leaves its draft
    cache empty, and one first drafted after its prompt and 5 steps catches up on all of it (35 + 5 tokens, chunked
    past CATCH_UP_SLACK). The draft is the target's function: every drafted token is accepted only if the catch-up
    fed the right tokens at the right slots."""
    prompts = [PROMPTS[6], PROMPTS[0], PROMPTS[2]]  # 35, 9 and 1 tokens
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    reference = _generate(_llm(models, None, max_num_seqs=3), prompts, [params] * 3)
    llm = _llm(models, "same", gamma="auto", max_num_seqs=3)
    assert llm.engine.controller is not None
    first_drafted = {"0": 5, "1": 0, "2": 10**9}  # request 2 is never drafted
    requests = {}

    def choose(reqs):
        requests.update({r.request_id: r for r in reqs})
        return [0 if r.metrics.num_steps < first_drafted[r.request_id] else 3 for r in reqs]

    llm.engine.choose_gammas = choose
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert requests["2"].draft_len == 0 and outs[2].metrics["num_drafted"] == 0
    for o in outs[:2]:
        assert o.metrics["num_drafted"] > 0 and o.metrics["num_accepted"] == o.metrics["num_drafted"], o.metrics


def test_the_rate_to_beat_is_measured_plain_steps():
    """A drafted step carries fixed costs a plain step does not (compactions, the drafter's commit): a line fit
    through drafted steps over-prices plain decoding. The controller prices it from measured plain steps instead,
    and runs one plain step in PLAIN_PROBE_INTERVAL while drafting to keep measuring."""
    from types import SimpleNamespace

    from spec_engine.adaptive import PLAIN_PROBE_INTERVAL, PLAIN_PROBE_PHASE

    ctl = AdaptiveController(8, lambda g: g + 1)
    req = StubRequest(spec_state=None, params=SamplingParams(max_tokens=10**6), output_token_ids=[],
                      cache_seqlen=0, draft_len=0, metrics=SimpleNamespace(alpha_estimate=None))  # fmt: skip
    plain, fixed = 4e-3, 3e-3  # a plain step; what any drafted step adds besides its tokens
    gammas = []
    for _ in range(3 * PLAIN_PROBE_INTERVAL):
        G = ctl.choose([req])[0]
        gammas.append(G)
        T = G + 1
        t_draft = 1e-4 * G
        t_target = plain + 0.2e-3 * (T - 1) + (fixed if G else 0.0)
        ctl.observe([req], [G], [G + 1], t_draft, t_draft + t_target)  # a perfect draft: every token accepted
    assert gammas[PLAIN_PROBE_INTERVAL + PLAIN_PROBE_PHASE] == 0  # the plain probe, while drafting
    assert sum(g > 0 for g in gammas) > 2 * PLAIN_PROBE_INTERVAL
    modelled = ctl.target_cost.predict(1.0, 1 / 16)
    assert abs(ctl.plain_cost(1) - plain) < 0.05 * plain < abs(modelled - plain)


def _row(max_tokens=10**6):
    from types import SimpleNamespace

    return StubRequest(spec_state=None, params=SamplingParams(max_tokens=max_tokens), output_token_ids=[],
                       cache_seqlen=0, draft_len=0, metrics=SimpleNamespace(alpha_estimate=None))  # fmt: skip


def test_a_native_call_stops_at_a_reject_only_while_the_request_is_new():
    """StepRunner._spec_chain ends a call at the first rejection while a row has judged fewer than SURE_TRIALS drafted
    tokens (a new request's guessed rate costs one step if its draft is useless), or is being probed; after that
    it keeps its depth."""
    from spec_engine.adaptive import SURE_TRIALS

    ctl = AdaptiveController(8, lambda g: g + 1)
    new, old = _row(), _row()
    while ctl.state(old).acceptance.num_trials < SURE_TRIALS:
        ctl.state(old).acceptance.update(3, 1)
    assert ctl.unsure([new]) and ctl.unsure([old, new]) and not ctl.unsure([old])
    ctl.state(old).probing = True  # a probe of a row that was off is one trial: its call stops at a reject too
    assert ctl.unsure([old])
    ctl.observe([old], [1], [1], 0.1e-3, 1e-3)
    assert not ctl.unsure([old])


def test_the_rate_to_beat_is_the_cheapest_measured_plain_step():
    """Plain steps measured in short probe chains right after drafted steps cost more per step than the long chains
    that run when nothing drafts; the rate to beat is the latter (noise only slows a step)."""
    from spec_engine.adaptive import PLAIN_PROBE_PHASE

    ctl = AdaptiveController(8, lambda g: g + 1)
    req = _row()
    for _ in range(PLAIN_PROBE_PHASE + 1):  # a settled target fit (drafted steps: the first is not timed)
        ctl.observe([req], [1], [2], 0.1e-3, 1.1e-3)
    for t in [1.2e-3] * 4 + [1.0e-3] * 8 + [1.2e-3] * 4:  # a probe chain, a long chain, a probe chain
        ctl.observe([req], [0], [1], 0.0, t)
    assert abs(ctl.plain_cost(1) - 1.0e-3) < 0.03e-3


def drive(ctl, req, accepts, max_tokens: int = 64) -> list[int]:
    """Run one request through ``ctl`` as the engine does, with injected costs shaped like the default pair's in
    float32: a plain choice runs a chain of 8 steps of 0.72 ms; a drafted one a step of 0.09 ms per depth in the
    draft and 0.83 + 0.055 ms per depth in the target. ``accepts(G, i)``: drafts accepted at the i-th drafted step.
    Returns the depths chosen."""
    chosen, emitted, drafted = [], 0, 0
    while emitted < max_tokens:
        G = ctl.choose([req])[0]
        chosen.append(G)
        if G == 0:
            for _ in range(8):
                ctl.observe([req], [0], [1], 0.0, 0.72e-3)
            emitted += 8
        else:
            n = 1 + accepts(G, drafted)
            ctl.observe([req], [G], [n], 0.09e-3 * G, (0.83 + 0.145 * G) * 1e-3)
            emitted, drafted = emitted + n, drafted + 1
        req.output_token_ids.extend([0] * (emitted - len(req.output_token_ids)))
    return chosen


def test_short_requests_are_still_probed_after_hard_ones():
    """Hard requests push the probe interval to its maximum (64 steps), which a new 64-token request inherits: were
    steps counted per choice (8 per plain chain) or the interval not capped at half the request, no later request
    would ever be drafted again. A good draft on a later request must be found within its life."""
    ctl = AdaptiveController(8, lambda g: g + 1)
    for _ in range(6):  # a useless draft
        drive(ctl, _row(64), lambda G, i: 0)
    assert ctl.probe_interval == MAX_PROBE_INTERVAL
    later = [drive(ctl, _row(64), lambda G, i: G) for _ in range(3)]  # a perfect one
    assert any(g > 0 for depths in later for g in depths)


def test_a_plain_chain_observed_in_one_call_is_its_steps_one_by_one():
    """The engine observes a native chain's plain steps in one call (``steps``): the same state as one call per step,
    the controller's first (untimed) step included."""
    ctls = [AdaptiveController(8, lambda g: g + 1) for _ in range(2)]
    reqs = [[_row(), _row()] for _ in ctls]
    for chain in ([8, 5], [1, 8]):  # the first chain holds the engine's first, untimed step
        for K in chain:
            ctls[0].observe(reqs[0], [0, 0], [1, 1], 0.0, 0.4e-3 * K, steps=K)
            for _ in range(K):
                ctls[1].observe(reqs[1], [0, 0], [1, 1], 0.0, 0.4e-3 * K)
        ctls[0].observe(reqs[0], [2, 0], [3, 1], 0.1e-3, 1e-3)
        ctls[1].observe(reqs[1], [2, 0], [3, 1], 0.1e-3, 1e-3)
    a, b = ctls
    assert (a.num_steps, a._plain_steps, a._cold) == (b.num_steps, b._plain_steps, b._cold)
    assert [a.state(r).steps_undrafted for r in reqs[0]] == [b.state(r).steps_undrafted for r in reqs[1]] == [0, 24]
    assert a.plain_cost(2) == b.plain_cost(2)
    with pytest.raises(AssertionError, match="plain"):
        a.observe(reqs[0], [1, 0], [2, 1], 0.1e-3, 1e-3, steps=2)


def test_a_plain_stretch_does_not_make_a_weak_draft_look_cheap():
    """The target's cost line is fit on drafted steps only. Fit on plain chains too (8 steps each), a forgetful line
    sank to plain decoding's level during every plain stretch, and a draft that loses (1 token in 4 accepted) was
    tried again in bursts every few chains (~60 drafted steps in 600 tokens); now only its probes remain."""
    ctl = AdaptiveController(8, lambda g: g + 1)
    depths = drive(ctl, _row(10**6), lambda G, i: int(i % 4 == 0), max_tokens=600)
    off = "".join(str(min(g, 1)) for g in depths).index("0000")  # off: four plain chains in a row
    assert sum(g > 0 for g in depths[off:]) <= 20


def _probe_rig():
    """An adaptive controller with injected costs whose draft is useless so far, and its probes: ``due(tokens_left,
    lag)`` a row whose probe is due, its draft cache ``lag`` tokens behind; ``probed(req)`` whether the step probes
    it. Plain 0.8 ms per token, a depth-g step 0.8 + 0.1 g ms in the target and ~0.13 g ms in the draft, 0.5 ms per
    16 catch-up tokens: were the draft as good as PROBE_ALPHA, depth 3 would save ~0.29 ms per token."""
    ctl = AdaptiveController(8, lambda g: g + 1, cache_lag=lambda req: req.lag)
    ctl.population.prior = 0.02  # a useless draft so far: the row is off

    def due(tokens_left, lag):
        req = _row(tokens_left)
        req.lag = lag
        state = ctl.state(req)
        state.acceptance.num_trials = 10**6
        state.steps_undrafted = state.probe_interval = PROBE_INTERVAL
        return req

    def probed(req) -> bool:
        ctl.target_cost.theta, ctl.target_cost.num_observed = (0.7e-3, 1.6e-3), 1  # plain (B * T = 1): 0.8 ms
        ctl.draft_cost.theta, ctl.draft_cost.num_observed = (0.1e-3, 0.5e-3), 1
        ctl._plain_steps = [(1, 0.8e-3)]  # (measured against this same line: ratio 1)
        ctl.num_steps = ctl._next_probe  # a probe step, not the plain probe
        ctl._next_plain_probe = 10**9
        return ctl.choose([req]) == [1]

    return ctl, due, probed


def test_a_probe_runs_only_where_it_pays_for_its_catch_up():
    """A due row's probe costs its draft cache's catch-up (the prompt and every undrafted token: the default pair in
    bfloat16 on a 2-core AVX2 CPU, ~130 draft tokens, ~3 ms, a tenth of a 64-token request) and is worth the time a
    good draft would save over the row's remaining tokens, times the chance that a probe finds one. Injected costs
    (``_probe_rig``): ~0.29 ms saved per token, at half the chance ~0.15, against ~4.3 ms to probe after a
    130-token prompt."""
    ctl, due, probed = _probe_rig()
    assert probed(due(1000, 130))  # a long life left pays for a prompt's catch-up
    assert not probed(due(20, 130))  # a short one does not
    assert probed(due(20, 2))  # ... unless the draft cache is nearly current
    # failed probes lower the chance a probe succeeds, so fewer pay; successful ones raise it again
    before = ctl.probe_success
    req = due(1000, 130)
    assert probed(req)
    ctl.observe([req], [1], [1], 0.2e-3, 1.2e-3)  # the probe's draft was rejected
    assert ctl.probe_success < before and not ctl.state(req).probing
    for _ in range(20):
        req = due(1000, 130)
        if probed(req):
            ctl.observe([req], [1], [1], 0.2e-3, 1.2e-3)
    assert not probed(due(100, 130)) and ctl.probe_success < 0.15


def test_a_useless_draft_stops_probing_long_prompts_after_a_few_misses():
    """SmolLM2 with a random-weight head, one 64-token request after another: each request's probe caught up over
    its whole prompt, ~17 ms at 256 tokens against ~170 ms a good draft would save, so a probe pays while it finds a
    good draft more than one time in ten. Under a prior worth two probes (uniform), the probes' rate fell as 1/(n +
    2) and ~14 requests in a row paid a probe that missed (~4% each); worth one (Jeffreys'), 5 do. Injected costs
    at the same ratio (``_probe_rig``): a prompt's catch-up ~9 ms against ~90 ms saved. A draft whose probes then
    hit is probed again."""
    ctl, due, probed = _probe_rig()
    misses = 0
    while misses < 20 and probed(req := due(310, 287)):
        ctl.observe([req], [1], [1], 0.2e-3, 1.2e-3)  # rejected
        misses += 1
    assert 1 <= misses <= 6
    assert probed(due(1000, 287))  # a longer life left still pays
    for _ in range(3):
        req = due(1000, 287)
        assert probed(req)
        ctl.observe([req], [1], [2], 0.2e-3, 1.2e-3)  # accepted
    assert probed(due(310, 287))


def test_measured_verify_widths_correct_a_convex_cost_line():
    """On a CPU whose matmuls turn compute-bound past a few rows, a target pass costs ~1.0 ms at 2 tokens, 1.1 at 4
    and 2.4 at 9: the line through a request's depths 1 and 8 prices depth 3 at ~1.5 ms, and an alpha-0.8 draft
    that pays there looked not to. Measured widths price themselves (their cheapest recent pass: a few slow steps,
    cold caches or the machine's other jobs, must not price a width for good); an unmeasured one is priced by the
    line but never above the chord between its measured neighbours."""
    from spec_engine.estimates import TABLE_SAMPLES, WidthTable

    ctl = AdaptiveController(8, lambda g: g + 1)
    req = _row()
    ctl.observe([req], [1], [2], 0.1e-3, 1.1e-3)  # the first step is not timed
    for _ in range(10):
        ctl.observe([req], [1], [2], 0.1e-3, 1.1e-3)  # T = 2: 1.0 ms in the target
        ctl.observe([req], [8], [9], 0.5e-3, 2.9e-3)  # T = 9: 2.4 ms
    line = ctl.target_cost.predict(1.0, 4 / 16)
    assert line > 1.35e-3  # the line over-prices T = 4
    chord = 1.0e-3 + (4 - 2) / (9 - 2) * 1.4e-3
    assert ctl.target_time(4) == pytest.approx(min(line, chord), rel=1e-6)
    for t in (3.0e-3, 1.35e-3, 2.0e-3):
        ctl.observe([req], [3], [4], 0.25e-3, t)  # T = 4 measured: 1.1 ms at best
    assert ctl.target_time(4) == pytest.approx(1.1e-3, rel=1e-6)
    assert ctl.target_time(2) == pytest.approx(1.0e-3) and ctl.target_time(9) == pytest.approx(2.4e-3)
    assert ctl.plain_cost(1) <= 1.0e-3 + 1e-12  # no plain step measured: at most the narrowest measured pass
    # a plain step is a measured pass over B tokens: with only depth 8 measured, the chord from it prices depth 1
    ctl2 = AdaptiveController(8, lambda g: g + 1)
    ctl2.observe([req], [8], [9], 0.5e-3, 2.9e-3)  # (not timed)
    for _ in range(8):
        ctl2.observe([req], [0], [1], 0.0, 0.6e-3)
        ctl2.observe([req], [8], [9], 0.5e-3, 2.9e-3)
    chord = 0.6e-3 + (2.4e-3 - 0.6e-3) / 8  # from (1 token, 0.6 ms) to (9 tokens, 2.4 ms)
    assert ctl2.target_time(2) == pytest.approx(min(chord, ctl2.target_cost.predict(1, 2 / 16)))
    assert ctl2.target_time(2) < 0.9e-3 and ctl2.target_time(1) >= 0.6e-3  # ... and no pass is cheaper than plain
    table = WidthTable()
    for t in [0.5] + [0.9] * TABLE_SAMPLES:  # the cheap pass leaves the window: the width is re-priced
        table.observe(5, t)
    assert table.predict(5, line=0.1) == 0.9
    assert table.predict(3, line=0.7) == 0.7  # no measured neighbour on both sides: the line
    table.observe(3, 1.5)  # a narrower width priced on a busy spell: never above the wider one measured since
    assert table.predict(3, line=0.7) == 0.9 and table.predict(4, line=2.0, anchors={3: 1.5}) == 0.9


def test_a_lagging_draft_cache_is_caught_up_only_where_the_evidence_pays_for_it():
    """A new request's first drafted step feeds its draft the whole prompt (~3 ms here for ~100 tokens). A draft
    whose optimistic rate beats plain decoding by the margin is drafted on a current cache (the optimism buys evidence
    cheaply there), but the catch-up is paid only where the evidence alone saves more over the request's remaining
    tokens. Injected costs: plain 0.8 ms, depth 1 1.0 ms, 0.5 ms per 16 catch-up tokens."""
    ctl = AdaptiveController(8, lambda g: g + 1, cache_lag=lambda req: req.lag)

    def row(alpha, lag, tokens_left=60):
        req = _row(tokens_left)
        req.lag = lag
        ctl.population.prior = alpha
        ctl.state(req).acceptance.num_trials = 4  # some evidence: the optimism bonus is ~+0.05
        return req

    def chosen(req) -> int:
        ctl.target_cost.theta, ctl.target_cost.num_observed = (0.7e-3, 1.6e-3), 1  # width 1: 0.8 ms, 2: 0.9 ms
        ctl.draft_cost.theta, ctl.draft_cost.num_observed = (0.1e-3, 0.5e-3), 1
        ctl._plain_steps = [(1, 0.8e-3)]
        ctl.num_steps, ctl._next_plain_probe, ctl._next_probe = 1, 10**9, 10**9  # no probes
        return ctl.choose([req])[0]

    # alpha 0.4: depth 1 (1.03 ms with its draft tokens) promises 1.4 tokens, 1.45 with the optimism: 1.09-1.13x
    assert chosen(row(0.4, lag=1, tokens_left=40)) == 1  # drafted: its cache is current
    # ~3.3 ms of catch-up and excess step for ~2.6 ms saved over 40 tokens at the evidence's rate: not drafted
    assert chosen(row(0.4, lag=100, tokens_left=40)) == 0
    assert chosen(row(0.4, lag=100, tokens_left=400)) == 1  # ... over 400 it pays
    assert chosen(row(0.9, lag=100, tokens_left=40)) > 0  # a good draft pays for its prompt


def test_a_controller_of_sized_trees_offers_its_largest_budget_and_prices_the_widths_run():
    """A drafter that sizes its own trees (suffix speculation) is offered the largest budget every step, bar the
    plain probes that measure the rate to beat; its steps, observed with the width they verified and no depth
    (suffix rows teach no acceptance), price that width."""
    from spec_engine.adaptive import PLAIN_PROBE_INTERVAL, PLAIN_PROBE_PHASE

    ctl = AdaptiveController(16, lambda g: g + 1, sized=True)
    req = _row()
    gammas = []
    for step in range(2 * PLAIN_PROBE_INTERVAL):
        G = ctl.choose([req])[0]
        gammas.append(G)
        width = 1 + (G and 4 + step % 5)  # trees of 5-9 tokens
        ctl.observe([req], [0], [1 + (G and 2)], 1e-5, 1e-3 * (1 + 0.1 * (width - 1)), width=width)
    assert gammas[0] == 16 and gammas[PLAIN_PROBE_PHASE] == gammas[PLAIN_PROBE_PHASE + PLAIN_PROBE_INTERVAL] == 0
    assert sum(g == 0 for g in gammas) == 2 and set(gammas) == {0, 16}
    assert ctl.state(req).acceptance.num_trials == 0
    assert sorted(ctl.target_widths.prices) == [5, 6, 7, 8, 9]
    assert ctl.target_time(9) == pytest.approx(1.8e-3 - 1e-5)
    assert ctl.plain_cost(1) == pytest.approx(1e-3)
