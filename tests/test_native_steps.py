"""Steps in one native call.

Plain chains: with no drafter (or none this step) and every row greedy, the engine runs up to plain_chain target
forwards in one ``plain_steps`` call. Speculative chains: a draft model's greedy chain steps, up to spec_chain_steps
per ``spec_chain`` call. Both must emit exactly the tokens of the regular steps, stop where they stop, count their
steps as such (the speculative ones: the same drafts and acceptances), and hand non-finite logits to the regular
step."""

from __future__ import annotations

import pytest
import torch
from tiny_models import make_model, make_noisy_copy

import spec_engine.runner as runner_mod
from spec_engine import LLM, SamplingParams
from spec_engine.engine import EngineConfig
from spec_engine.estimates import chain_step_costs
from spec_engine.step import PLAIN_CHAIN, SPEC_CHAIN

PROMPTS = [[5, 17, 3, 60, 42, 7, 5, 17, 3], [1, 2, 3, 4, 1, 2], [77], list(range(10, 40))]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("chain") / "target", "llama_gqa", logit_scale=4.0)


@pytest.fixture(scope="module")
def draft(target, tmp_path_factory):
    return make_noisy_copy(target, tmp_path_factory.mktemp("chain") / "draft", noise=0.05)


def run(llm: LLM, params: SamplingParams, chain: int) -> list:
    llm.engine.reconfigure(EngineConfig(plain_chain=chain))
    return llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)


def plain_chains(llm: LLM) -> list[int]:
    """The planned length of every native plain chain the engine ran (``Engine.plan_history``)."""
    return [p.steps for p in llm.engine.plan_history if p.path == PLAIN_CHAIN]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_chain_emits_the_tokens_of_one_token_steps(target, dtype, monkeypatch):
    llm = LLM(str(target), dtype=dtype)
    params = SamplingParams(max_tokens=37, ignore_eos=True)  # not a multiple of the chain: the last one is shorter
    ref = run(llm, params, 1)
    llm.engine.plan_history.clear()
    got = run(llm, params, 8)
    chains = plain_chains(llm)
    assert chains and max(chains) == 8 and min(chains) < 8  # the chains ran, the last one cut to max_tokens
    for a, b in zip(got, ref):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert len(a.outputs[0].token_ids) == 37
        assert a.metrics["num_steps"] == b.metrics["num_steps"] == 37  # one step per forward, as plain decoding
        assert a.metrics["acceptance_rate"] == 0 and a.metrics["mean_accepted_length"] == 1


def test_chain_stops_where_one_token_steps_stop(target, monkeypatch):
    llm = LLM(str(target))
    free = run(llm, SamplingParams(max_tokens=30, ignore_eos=True), 1)[0].outputs[0].token_ids
    stop = free[13]  # a token the first prompt emits mid-chain
    params = SamplingParams(max_tokens=30, stop_token_ids=[stop])
    ref = run(llm, params, 1)
    got = run(llm, params, 8)
    for a, b in zip(got, ref):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].finish_reason == b.outputs[0].finish_reason
        assert a.metrics["num_steps"] == b.metrics["num_steps"]  # a chain cut by its stop counts the steps kept
        assert a.metrics["accepted_length_hist"] == b.metrics["accepted_length_hist"]
    assert got[0].outputs[0].finish_reason == "stop" and got[0].outputs[0].token_ids[-1] == stop
    assert len(got[0].outputs[0].token_ids) <= 14


def test_a_chain_spends_no_forward_past_a_stop_token(target, monkeypatch):
    """plain_steps ends its call at the first token that is some row's stop token: a long chain costs nothing at a
    request's end. A row that emits another row's stop token (a plain token for it) goes on in the next call."""
    llm = LLM(str(target))
    free = run(llm, SamplingParams(max_tokens=30, ignore_eos=True), 1)
    a, b = (o.outputs[0].token_ids for o in free[:2])
    # a token the first prompt emits first at some step >= 3, after the second prompt's first use of it if any
    stop = next(t for i, t in enumerate(a) if i >= 3 and a.index(t) == i)
    first = min(a.index(stop), b.index(stop) if stop in b else 30)  # where the first call must end
    params = [SamplingParams(max_tokens=30, stop_token_ids=[stop])] + [SamplingParams(max_tokens=30, ignore_eos=True)]
    llm.engine.reconfigure(EngineConfig(plain_chain=16))
    got = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]], params, use_tqdm=False)
    runs = [(p.steps, p.steps_ran) for p in llm.engine.plan_history if p.path == PLAIN_CHAIN]  # (asked, run)
    assert got[0].outputs[0].token_ids == a[: a.index(stop) + 1] and got[0].outputs[0].finish_reason == "stop"
    assert got[1].outputs[0].token_ids == b  # the other row, all 30 of its tokens
    assert first < 15 and runs[0] == (16, first + 1)  # the call ended at the stop, not 16 forwards in
    assert sum(ran for _, ran in runs) == 30


def test_waiting_requests_take_one_token_steps(target, monkeypatch):
    """A queue (max_num_seqs below the load) keeps steps short so a freed slot is refilled at once; the tokens are
    those of one-token steps either way."""
    llm = LLM(str(target), max_num_seqs=2)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    ref = run(llm, params, 1)
    llm.engine.plan_history.clear()
    got = run(llm, params, 8)
    chains = plain_chains(llm)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
    assert chains  # once the queue is empty, the last rows chain


@pytest.mark.parametrize("filters", [{}, {"top_p": 0.8}, {"top_k": 5, "min_p": 0.05}], ids=["none", "top_p", "k+min_p"])
def test_coupled_sampled_rows_chain_with_one_token_steps_tokens(target, monkeypatch, filters):
    """Seeded rows (the position-keyed coupling) chain natively with no drafter (plain_steps' perturbed argmax, over
    the entries the filters keep), emitting the regular one-token steps' tokens; unseeded rows are coupled there too
    (``couple_unseeded``), and rows sampled by rejection (``invariant=False``) take one-token steps."""
    llm = LLM(str(target))
    seeded = SamplingParams(max_tokens=24, temperature=0.8, seed=3, ignore_eos=True, **filters)
    ref = run(llm, seeded, 1)
    llm.engine.plan_history.clear()
    got = run(llm, seeded, 16)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
    assert plain_chains(llm) and max(plain_chains(llm)) > 1
    assert llm.engine.couple_unseeded and llm.engine.add_request([1, 2], SamplingParams(temperature=0.8)).coupled
    llm.engine.abort(llm.engine.waiting[-1].request_id)
    llm.engine.plan_history.clear()
    run(llm, SamplingParams(max_tokens=12, temperature=0.8, seed=3, invariant=False, ignore_eos=True), 16)
    assert plain_chains(llm) == [] and llm.engine.plan_history


def test_planted_bug_chain_at_the_wrong_positions_is_caught(target, monkeypatch):
    """The parity check can fail: a chain that writes its K/V one position late changes the tokens."""
    llm = LLM(str(target))
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    ref = run(llm, params, 1)
    real = runner_mod.plain_steps

    def shifted(roots, model, kv, cache_seqlens, **kw):
        return real(roots, model, kv, cache_seqlens + 1, **kw)

    monkeypatch.setattr(runner_mod, "plain_steps", shifted)
    got = run(llm, params, 8)
    assert [o.outputs[0].token_ids for o in got] != [o.outputs[0].token_ids for o in ref]


def test_non_finite_logits_take_the_regular_step(target, monkeypatch):
    """A NaN in the logits: the chain commits nothing and the regular step handles the row exactly as without
    chains (here: the verify path sanitises or fails the request, the same way both times)."""
    llm = LLM(str(target))
    with torch.no_grad():
        llm.target.lm_head.weight[7].fill_(float("nan"))
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    ref = run(llm, params, 1)
    llm.engine.plan_history.clear()
    got = run(llm, params, 8)
    assert any(p.fallback_from == PLAIN_CHAIN for p in llm.engine.plan_history)  # the chain met the NaN, stepped aside
    for a, b in zip(got, ref):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].finish_reason == b.outputs[0].finish_reason


# --- speculative chains -------------------------------------------------------------------------------------------

STEP_METRICS = ("num_steps", "num_drafted", "num_accepted", "accepted_length_hist", "gamma_hist")


def run_spec(llm: LLM, params: SamplingParams, steps: int) -> list:
    llm.engine.reconfigure(EngineConfig(spec_chain_steps=steps))
    return llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)


def spec_chain_steps(llm: LLM, params: SamplingParams, steps: int) -> tuple[list, list[int]]:
    """``run_spec``'s outputs, and the steps each native speculative call it planned ran (0: a call that stepped
    aside to the regular step, its first step's logits not finite)."""
    llm.engine.plan_history.clear()
    outputs = run_spec(llm, params, steps)
    planned = [p for p in llm.engine.plan_history if SPEC_CHAIN in (p.path, p.fallback_from)]
    return outputs, [p.steps_ran if p.path == SPEC_CHAIN else 0 for p in planned]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_spec_chain_runs_the_regular_steps(target, draft, dtype, monkeypatch):
    """Fixed depth: the same tokens, and the same steps (drafts, acceptances) as one regular step at a time."""
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}
    llm = LLM(str(target), speculative_config=spec, dtype=dtype)
    params = SamplingParams(max_tokens=41, ignore_eos=True)
    ref = run_spec(llm, params, 0)
    got, calls = spec_chain_steps(llm, params, 4)
    assert calls and max(calls) == 4  # the native calls ran, several steps each
    for a, b in zip(got, ref):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert {k: a.metrics[k] for k in STEP_METRICS} == {k: b.metrics[k] for k in STEP_METRICS}
    assert all(0 < o.metrics["acceptance_rate"] < 1 for o in got)  # partly right: both branches of acceptance
    assert llm.allocator.num_used == 0


def test_spec_chain_adaptive_and_stops(target, draft, monkeypatch):
    """The adaptive default: the tokens of plain decoding, and a stop token ends the row where it appears."""
    llm = LLM(str(target), speculative_config={"method": "draft_model", "model": str(draft)})
    plain = LLM(str(target))
    free = run(plain, SamplingParams(max_tokens=30, ignore_eos=True), 1)
    stop = free[1].outputs[0].token_ids[17]
    params = SamplingParams(max_tokens=30, stop_token_ids=[stop, 2**63 - 1])  # an id no model emits is ignored
    ref = run(plain, params, 1)
    got, calls = spec_chain_steps(llm, params, 4)
    assert calls
    for a, b in zip(got, ref):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].finish_reason == b.outputs[0].finish_reason
    assert got[1].outputs[0].finish_reason == "stop"


@pytest.mark.parametrize("max_tokens", [9, 10, 11, 12])
def test_a_fixed_depths_last_tokens_take_no_regular_step(target, draft, max_tokens, monkeypatch):
    """Fixed depth 3, one row: where fewer than 4 tokens are left, the step drafts what still fits (depth
    tokens_left - 1; none for the last token, a plain native step) instead of a full chain through the regular
    (Python) step: every step is native, and the tokens are plain decoding's."""
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}
    llm = LLM(str(target), speculative_config=spec, engine_config=EngineConfig(spec_chain_steps=4))
    plain = LLM(str(target))
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    prompt = [{"prompt_token_ids": PROMPTS[3]}]
    ref = plain.generate(prompt, params, use_tqdm=False)
    (got,) = llm.generate(prompt, params, use_tqdm=False)
    assert got.outputs[0].token_ids == ref[0].outputs[0].token_ids
    assert llm.engine.stats["num_regular_steps"] == 0 and got.metrics["num_drafted"] > 0
    assert max(llm.engine.gamma_history) == 3 and min(llm.engine.gamma_history) < 3  # the tail drafted less
    llm.engine.reconfigure(EngineConfig(spec_chain_steps=0))  # the counter counts: without native calls, every step
    llm.generate(prompt, params, use_tqdm=False)
    assert llm.engine.stats["num_regular_steps"] >= max_tokens // 4


def test_spec_chain_planted_bug_is_caught(target, draft, monkeypatch):
    """The comparison can fail: a native call whose target pass sits one position late changes the tokens."""
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}
    llm = LLM(str(target), speculative_config=spec)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    ref = run_spec(llm, params, 0)
    real = runner_mod.spec_chain

    def shifted(t, d, catch_up, catch_up_lens, cache_seqlens, *args, **kw):
        return real(t, d, catch_up, catch_up_lens, cache_seqlens + 1, *args, **kw)

    monkeypatch.setattr(runner_mod, "spec_chain", shifted)
    got = run_spec(llm, params, 4)
    assert [o.outputs[0].token_ids for o in got] != [o.outputs[0].token_ids for o in ref]


def test_spec_chain_non_finite_logits_take_the_regular_step(target, draft, monkeypatch):
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}
    llm = LLM(str(target), speculative_config=spec)
    with torch.no_grad():
        llm.target.lm_head.weight[7].fill_(float("nan"))
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    ref = run_spec(llm, params, 0)
    got, calls = spec_chain_steps(llm, params, 4)
    assert calls and max(calls) == 0  # every call found the NaN and committed nothing
    for a, b in zip(got, ref):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].finish_reason == b.outputs[0].finish_reason


def test_spec_chain_at_depth_zero_is_plain_decoding(target, draft):
    """spec_chain at depth 0 (the plain decoding of a head's target): plain_steps' tokens and target cache, the
    draft idle (its cache untouched), each row's catch-up grown by every token it emitted."""
    from spec_kernels.decoder_layers import plain_steps, spec_chain

    llm = LLM(str(target), speculative_config={"method": "draft_model", "model": str(draft),
                                               "num_speculative_tokens": 2})  # fmt: skip
    eng = llm.engine
    B, K, P = 2, 6, 32

    def cache(data):  # a contiguous cache of B rows of P positions
        return data.new_zeros(data.shape[0], 2, B, P, *data.shape[4:])

    roots, zero = torch.tensor([5, 60]), torch.zeros(B, dtype=torch.int64)
    kv_plain, kv_spec, d_kv = cache(eng.kv.data), cache(eng.kv.data), cache(eng.drafter.kv.data)
    target_model, draft_model = eng.runner.native_target, eng.runner.native_draft
    want = plain_steps(roots, target_model, kv_plain, zero, steps=K)  # [B, K]
    steps, catch_up, catch_up_lens, _, _ = spec_chain(target_model, draft_model, roots[:, None], zero + 1, zero,
                                                      kv_spec, d_kv, None, zero + 100, zero[:0], gamma=0,
                                                      max_steps=K)  # fmt: skip
    assert steps.shape == (B, K, 2) and bool((steps[:, :, 0] == 1).all())
    assert torch.equal(steps[:, :, 1], want)
    assert torch.equal(kv_spec, kv_plain) and not d_kv.any()
    assert catch_up_lens.tolist() == [K + 1] * B and torch.equal(catch_up, torch.cat([roots[:, None], want], dim=1))


def test_spec_chain_refuses_bad_trees_and_sampling(target, draft):
    """spec_chain's ``tree``: gamma levels of >= 1 children, at most 1024 nodes, and an EAGLE-3 head's only (a draft
    model drafts chains); its ``temperature`` and ``noise_seeds``: together, float32 and int64 [B], finite and >= 0,
    and sampled rows drafted by a head's chains only; ``top_k``, ``top_p`` and ``min_p``: together, with them, [B] in
    range. Each mistake is a ValueError naming it, before any forward."""
    from spec_kernels.decoder_layers import spec_chain

    llm = LLM(str(target), speculative_config={"method": "draft_model", "model": str(draft),
                                               "num_speculative_tokens": 2})  # fmt: skip
    eng = llm.engine
    B, P = 1, 32
    kv = eng.kv.data.new_zeros(eng.kv.data.shape[0], 2, B, P, *eng.kv.data.shape[4:])
    d_kv = eng.drafter.kv.data.new_zeros(eng.drafter.kv.data.shape[0], 2, B, P, *eng.drafter.kv.data.shape[4:])
    roots, zero = torch.tensor([5]), torch.zeros(B, dtype=torch.int64)
    seeds, warm = torch.tensor([3]), torch.tensor([0.7])
    cases = (
        ({"tree": [2]}, 2, "a tree has gamma = 2 levels"),
        ({"tree": [2, 0]}, 2, ">= 1 children"),
        ({"tree": [32, 32, 2]}, 3, "at most 1024 nodes"),
        ({"tree": [2, 1]}, 2, "a draft model drafts chains"),
        ({"temperature": warm}, 2, "go together"),
        ({"temperature": warm.double(), "noise_seeds": seeds}, 2, r"\[B\] = \[1\] Float, got \[1\] Double"),
        ({"temperature": torch.tensor([-1.0]), "noise_seeds": seeds}, 2, "finite and >= 0"),
        ({"temperature": warm, "noise_seeds": seeds}, 2, "sampled rows draft an EAGLE-3 head's chains"),
        ({"temperature": warm, "noise_seeds": seeds, "top_k": zero}, 0, "go together"),
        ({"top_k": zero, "top_p": warm, "min_p": warm}, 0, "with temperature"),
        (
            {"temperature": warm, "noise_seeds": seeds, "top_k": zero, "top_p": warm, "min_p": warm * 2},
            0,
            r"min_p in \[0, 1\]",
        ),
        (
            {"temperature": warm, "noise_seeds": seeds, "top_k": zero, "top_p": warm.double(), "min_p": warm},
            0,
            "Double",
        ),
    )
    for kwargs, gamma, message in cases:
        with pytest.raises(ValueError, match=message):
            spec_chain(eng.runner.native_target, eng.runner.native_draft, roots[:, None], zero + 1, zero, kv, d_kv,
                       None, zero + 100, zero[:0], gamma=gamma, max_steps=1, **kwargs)  # fmt: skip
    assert not kv.any() and not d_kv.any()


def test_native_models_are_checked_once_and_roles_kept(target, draft):
    """The ops' model object (torch.classes.spec_kernels.NativeModel) refuses bad parts when it is made, and each op
    refuses a model in the wrong role: a draft's restricted vocabulary or a head as a target, a model as a head."""
    import dataclasses

    from spec_kernels.decoder_layers import plain_steps

    llm = LLM(str(target), speculative_config={"method": "draft_model", "model": str(draft),
                                               "num_speculative_tokens": 2})  # fmt: skip
    eng = llm.engine
    t, d = eng.runner.native_target, eng.runner.native_draft
    make = torch.classes.spec_kernels.NativeModel
    args = [t.embed, t.layers.flat, t.final_norm, t.lm_head, t.rope_table, t.num_heads, t.eps, None]
    make(*args)  # well-formed
    with pytest.raises((ValueError, RuntimeError), match="rope_table must be"):
        make(*args[:4], t.rope_table[0], *args[5:])
    with pytest.raises((ValueError, RuntimeError), match="vocab_map"):
        make(*args[:7], torch.tensor([0, 10**6]))
    with pytest.raises((ValueError, RuntimeError), match="hidden_norm must be"):
        make(*args).set_head(torch.ones(3), torch.ones(2, 2), False, [1])
    B, zero = 1, torch.zeros(1, dtype=torch.int64)
    kv = eng.kv.data.new_zeros(eng.kv.data.shape[0], 2, B, 16, *eng.kv.data.shape[4:])
    restricted = dataclasses.replace(d, vocab_map=torch.arange(d.lm_head.shape[0]))
    with pytest.raises((ValueError, RuntimeError), match="cannot be restricted|target"):
        plain_steps(zero, restricted, eng.drafter.kv.data.new_zeros(kv.shape), zero, steps=1)
    with pytest.raises((ValueError, RuntimeError), match="must be an EAGLE-3 head"):
        torch.ops.spec_kernels.eagle3_draft(
            [zero[:, None], zero, zero], torch.zeros(1, 1, 16, 8), t.handle, kv, None, 1, []
        )


def test_spec_chain_catches_up_a_prompt_natively(target, draft, monkeypatch):
    """Under the adaptive controller the draft cache is filled lazily: a request's first drafted step feeds the draft
    its whole prompt. That step runs natively too (the call's catch-up holds the prompt), ragged rows within the
    depth of each other in one call, with the tokens of plain decoding; a new request's calls end at a rejection,
    a request with evidence keeps its depth through them."""
    spec = {"method": "draft_model", "model": str(draft)}
    plain = LLM(str(target))
    prompts = [list(range(10, 40)), list(range(50, 79)), [1, 2, 3, 4, 1, 2]]
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in plain.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                          use_tqdm=False)]  # fmt: skip
    seen, real = [], runner_mod.spec_chain

    def spy(t, d, catch_up, catch_up_lens, *args, **kw):
        seen.append((catch_up_lens.tolist(), kw["stop_on_reject"]))
        return real(t, d, catch_up, catch_up_lens, *args, **kw)

    monkeypatch.setattr(runner_mod, "spec_chain", spy)
    for batch in (prompts[2:], prompts[:2]):  # a short prompt, then the long ones together (lags 29 and 28)
        llm = LLM(str(target), speculative_config=spec)  # a new engine: its first drafted step is the catch-up
        # depth 2 every step (the controller's choice depends on measured times; its evidence count does not)
        monkeypatch.setattr(llm.engine.controller, "choose", lambda reqs: [2] * len(reqs))
        seen.clear()
        got = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == [ref[prompts.index(p)] for p in batch]
        assert seen[0][0] == [len(p) for p in batch]  # the prompts' catch-up, then the root
        assert seen[0][1] and not seen[-1][1]  # new requests: a call ends at a rejection; with evidence it goes on


def test_native_catch_up_drafts_what_the_regular_catch_up_drafts(target, draft, monkeypatch):
    """Greedy tokens cannot see a wrong draft cache (verification fixes every bad draft), acceptance can: with the
    depth fixed, the native catch-up of two prompts (lags 29 and 28, padded within the depth) accepts exactly what
    the regular step's catch-up accepts, step for step; a planted bug (the catch-up fed one token late) does not."""
    spec = {"method": "draft_model", "model": str(draft)}
    prompts = [list(range(10, 40)), list(range(50, 79))]
    params = SamplingParams(max_tokens=30, ignore_eos=True)

    def accepted(steps: int) -> list:
        llm = LLM(str(target), speculative_config=spec)
        monkeypatch.setattr(llm.engine.controller, "choose", lambda reqs: [2] * len(reqs))
        outs = run_spec_prompts(llm, prompts, params, steps)
        return [(o.metrics["num_accepted"], o.metrics["accepted_length_hist"]) for o in outs]

    regular = accepted(0)
    assert accepted(4) == regular and sum(n for n, _ in regular) > 0
    real = runner_mod.spec_chain

    def late(t, d, catch_up, catch_up_lens, *args, **kw):
        return real(t, d, catch_up.roll(1, dims=1), catch_up_lens, *args, **kw)

    monkeypatch.setattr(runner_mod, "spec_chain", late)
    assert accepted(4) != regular


def run_spec_prompts(llm: LLM, prompts: list, params: SamplingParams, steps: int) -> list:
    llm.engine.reconfigure(EngineConfig(spec_chain_steps=steps))
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


@pytest.mark.parametrize("plain_step", [0.0002, 0.02])
def test_the_controllers_plain_probe_runs_as_long_as_measuring_needs(target, draft, monkeypatch, plain_step):
    """The controller's plain probe between drafted steps measures the rate drafting must beat. Where plain steps
    are cheap (a tiny target's: a fraction of a millisecond) it is a full chain, like a plain choice after a
    drafted step that stopped drafting (4-step probe chains read dearer per step than a full chain there, and weak
    drafts looked worth drafting); where a plain step costs 20 ms, PLAIN_PROBE_MIN_STEPS of them measure it. The
    plain step's price is injected: measured, it follows the machine's load (a loaded CI run once cut this tiny
    target's probe short)."""
    from spec_engine.adaptive import PLAIN_PROBE_MIN_STEPS

    llm = LLM(str(target), speculative_config={"method": "draft_model", "model": str(draft)})
    ctl = llm.engine.controller
    monkeypatch.setattr(ctl, "plain_cost", lambda B: plain_step)
    expected = llm.engine.config.plain_chain if plain_step < 0.001 else PLAIN_PROBE_MIN_STEPS
    for probe in (False, True):
        choices = iter([[1], [0], [0]])

        def choose(reqs, probe=probe, choices=choices):
            gammas = next(choices, [0])
            ctl.plain_probe = probe and gammas == [0]
            return gammas

        monkeypatch.setattr(ctl, "choose", choose)
        llm.engine.plan_history.clear()
        llm.generate([{"prompt_token_ids": list(range(10, 40))}], SamplingParams(max_tokens=30, ignore_eos=True),
                     use_tqdm=False)  # fmt: skip
        chains = plain_chains(llm)
        assert chains[0] == (expected if probe else llm.engine.config.plain_chain), chains


def test_a_short_calls_overhead_is_spread_as_a_full_calls():
    """The controller prices a step at its native time plus the call's overhead over a full call's steps: a probe
    call cut after one step by a rejection does not charge all of its Python to that step (which made drafting look
    1.6x a plain token where full calls cost 1.2x)."""
    native = [[0.0001, 0.0004]]  # one step run: 0.1 ms drafting, 0.4 ms in all
    (cost,) = chain_step_costs(native, wall=0.0004 + 0.0016, steps=16)
    assert cost == pytest.approx((0.0001, 0.0004 + 0.0001))
    full = chain_step_costs(native * 16, wall=16 * 0.0004 + 0.0016, steps=16)
    assert full == [pytest.approx(cost)] * 16  # a step costs the same whether the call ran on or stopped
    assert chain_step_costs(native, wall=0.0003, steps=4) == [pytest.approx((0.0001, 0.0004))]


def test_an_unsure_controller_re_decides_every_few_steps(target, monkeypatch):
    """A request's first drafted calls (fewer than SURE_TRIALS judged drafts) run at most unsure_chain_steps steps,
    later ones up to spec_chain_steps: at one 16-step call per choice, a perfect draft's first choice (depth 1, from
    the recent requests' rate) ran 16 steps at depth 1 before the controller could go deeper."""
    llm = LLM(str(target), speculative_config={"method": "draft_model", "model": str(target)})  # a perfect draft
    ctl = llm.engine.controller
    monkeypatch.setattr(ctl, "plain_cost", lambda B: 1.0)  # plain decoding priced high: every step drafts
    llm.generate([{"prompt_token_ids": PROMPTS[3]}], SamplingParams(max_tokens=120, ignore_eos=True), use_tqdm=False)
    calls = [(p.steps, p.stop_on_reject) for p in llm.engine.plan_history if p.path == SPEC_CHAIN]
    unsure = [steps for steps, stop in calls if stop]
    sure = [steps for steps, stop in calls if not stop]
    assert unsure and max(unsure) == llm.engine.config.unsure_chain_steps
    assert sure and max(sure) == llm.engine.config.spec_chain_steps


def test_a_bfloat16_draft_under_a_float32_target(target, draft, monkeypatch):
    """The draft's precision is its own (``draft_dtype``; by default the device's fastest where narrower than the
    target's): a bfloat16 draft under a float32 target emits plain float32 decoding's tokens, on the native chain
    (mixed dtypes in one ``spec_chain`` call) and on the regular step alike, with the same drafts and acceptances."""
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3, "draft_dtype": "bfloat16"}
    llm = LLM(str(target), speculative_config=spec, dtype="float32")
    assert llm.engine.drafter.kv.data.dtype == torch.bfloat16 and llm.engine.kv.data.dtype == torch.float32
    params = SamplingParams(max_tokens=41, ignore_eos=True)
    plain = LLM(str(target), dtype="float32").generate([{"prompt_token_ids": p} for p in PROMPTS], params,
                                                       use_tqdm=False)  # fmt: skip
    ref = run_spec(llm, params, 0)
    got, calls = spec_chain_steps(llm, params, 4)
    assert calls and max(calls) == 4  # native calls ran with a float32 target and a bfloat16 draft
    for a, b, c in zip(got, ref, plain):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids == c.outputs[0].token_ids
        assert {k: a.metrics[k] for k in STEP_METRICS} == {k: b.metrics[k] for k in STEP_METRICS}
    for fastest, expected in (("bfloat16", torch.bfloat16), ("float32", torch.float32)):  # (tests pin "auto")
        monkeypatch.setenv("SPECDEC_AUTO_DTYPE", fastest)
        default = LLM(str(target), speculative_config={**spec, "draft_dtype": None}, dtype="float32")
        assert default.engine.drafter.kv.data.dtype == expected and default.engine.kv.data.dtype == torch.float32
    with pytest.raises(ValueError, match="draft_dtype must be one of"):
        LLM(str(target), speculative_config={**spec, "draft_dtype": "int8"})


# --- one greedy step over trees drafted elsewhere (tree_step) ------------------------------------------------------


def random_trees(continuations: list[list[int]], roots: list[int], T: int, V: int, seed: int):
    """Trees [B, T] (tokens, parents) whose first branch follows each row's greedy continuation for a random depth
    (0-3, so every row has accepted drafts or none), the other nodes random tokens under random parents, then
    padding (parent -1, token 0)."""
    gen = torch.Generator().manual_seed(seed)
    tokens, parents = torch.zeros(len(roots), T, dtype=torch.int64), torch.full((len(roots), T), -1)
    for b, (root, cont) in enumerate(zip(roots, continuations)):
        nodes = [(-1, root)]
        for j in range(int(torch.randint(0, 4, (1,), generator=gen))):
            nodes.append((len(nodes) - 1 if j else 0, cont[j]))
        for _ in range(int(torch.randint(0, T - len(nodes), (1,), generator=gen))):  # leaves room for padding
            nodes.append((int(torch.randint(0, len(nodes), (1,), generator=gen)),
                          int(torch.randint(0, V, (1,), generator=gen))))  # fmt: skip
        for i, (p, t) in enumerate(nodes):
            tokens[b, i], parents[b, i] = t, p
    return tokens, parents


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tree_step_is_the_regular_steps_pass_verify_and_compaction(target, dtype):
    """``tree_step`` (one native call) against the regular step's ops on the same trees: the target's pass (positions
    L_b + depth, the trees' masks), ``verify_tree``, ``compact_kv_``: the same result and, bit for bit, the same
    cache; with ``capture``, the features ``forward_features`` returns."""
    from spec_engine.tree import tree_mask_and_depths
    from spec_kernels import compact_kv_, verify_tree
    from spec_kernels.decoder_layers import plain_steps, tree_step

    llm = LLM(str(target), dtype=dtype)
    eng, model = llm.engine, llm.target
    native = eng.runner.native_target
    B, P, T, V = 3, 48, 9, model.config.vocab_size
    kv = eng.kv.data.new_zeros(eng.kv.data.shape[0], 2, B, P, *eng.kv.data.shape[4:])  # contiguous: B rows of P
    first = torch.tensor([5, 60, 17])
    greedy = plain_steps(first, native, kv, torch.zeros(B, dtype=torch.int64), steps=24)  # [B, 24], cache 0 .. 23
    L = torch.tensor([10, 14, 12], dtype=torch.int32)  # each row's root: its token at position L_b
    roots = [int(greedy[b, L[b] - 1]) for b in range(B)]
    conts = [greedy[b, L[b] :].tolist() for b in range(B)]
    accepted_some = False
    for seed in range(6):
        tokens, parents = random_trees(conts, roots, T, V, seed)
        mask, depths = tree_mask_and_depths(parents)
        ref_kv, got_kv = kv.clone(), kv.clone()
        hidden, features = model.forward_features(tokens, L.long()[:, None] + depths, ref_kv, L, mask, layers=[1, 0])
        want = verify_tree(model.logits(hidden), tokens, parents, temperature=torch.zeros(B))  # greedy rows
        compact_kv_(ref_kv.flatten(0, 1), L, want.accepted_nodes, want.num_accepted)
        got, got_features = tree_step(native, tokens, parents, L, got_kv, capture=[1, 0])
        for a, b in zip(got, want):
            assert torch.equal(a, b)
        assert torch.equal(got_kv, ref_kv)
        assert torch.equal(got_features, features)
        assert tree_step(native, tokens, parents, L, kv.clone())[1] is None  # no capture, no features
        accepted_some = accepted_some or int(want.num_accepted.max()) > 1
    assert accepted_some  # paths of several nodes: compaction moved rows


def test_tree_step_leaves_a_bad_row_to_the_regular_step(target):
    """A malformed tree runs nothing (the regular step raises its error); a non-finite maximum compacts nothing (the
    regular step sanitises it): None both times."""
    from spec_kernels.decoder_layers import tree_step

    llm = LLM(str(target))
    native = llm.engine.runner.native_target
    kv = llm.engine.kv.data.new_zeros(llm.engine.kv.data.shape[0], 2, 1, 16, *llm.engine.kv.data.shape[4:])
    tokens, parents, L = torch.tensor([[3, 4, 5]]), torch.tensor([[-1, 0, 2]]), torch.tensor([4])  # node 2 its own
    assert tree_step(native, tokens, parents, L, kv) is None and not kv.any()
    with torch.no_grad():
        native.lm_head.fill_(float("nan"))  # (the native model's own lm_head: a view of the target's or a copy)
    assert tree_step(native, tokens, torch.tensor([[-1, 0, 1]]), L, kv) is None


SUFFIX_TREES = {"method": "suffix", "num_speculative_tokens": 8, "suffix_decoding_min_score": 0.0}


def test_greedy_tree_steps_verify_natively(target, monkeypatch):
    """Suffix speculation's trees (the regular step's drafts) verify in one ``tree_step`` call per step: the tokens
    and the steps (drafts, acceptances) of the regular step's separate ops (``EngineConfig(native_tree_step=False)``)
    and the tokens of plain decoding."""
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    prompts = [{"prompt_token_ids": p * 3} for p in PROMPTS]  # repeats: suffix speculation has matches
    plain = LLM(str(target)).generate(prompts, params, use_tqdm=False)
    separate = LLM(str(target), speculative_config=SUFFIX_TREES, engine_config=EngineConfig(native_tree_step=False))
    ref = separate.generate(prompts, params, use_tqdm=False)
    widths, real = [], runner_mod.tree_step

    def spy(native, tokens, *args, **kw):
        widths.append(tokens.shape[1])
        return real(native, tokens, *args, **kw)

    monkeypatch.setattr(runner_mod, "tree_step", spy)
    llm = LLM(str(target), speculative_config=SUFFIX_TREES)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert widths and max(widths) > 1  # trees verified natively
    for a, b, c in zip(got, ref, plain):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids == c.outputs[0].token_ids
        assert {k: a.metrics[k] for k in STEP_METRICS} == {k: b.metrics[k] for k in STEP_METRICS}
    assert llm.engine.stats["num_accepted"] > 0


def test_tree_step_planted_bug_is_caught(target, monkeypatch):
    """The parity check can fail: trees verified one position late change the tokens."""
    llm = LLM(str(target), speculative_config=SUFFIX_TREES)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    prompts = [{"prompt_token_ids": p * 3} for p in PROMPTS]
    plain = LLM(str(target)).generate(prompts, params, use_tqdm=False)
    real = runner_mod.tree_step

    def shifted(native, tokens, parents, cache_seqlens, *args, **kw):
        return real(native, tokens, parents, cache_seqlens + 1, *args, **kw)

    monkeypatch.setattr(runner_mod, "tree_step", shifted)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] != [o.outputs[0].token_ids for o in plain]
