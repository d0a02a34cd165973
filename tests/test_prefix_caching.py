"""Prefix caching: a request whose prompt starts with an earlier request's full blocks of prompt K/V (cached as its
prefill completes them) takes them (with an EAGLE head's features there, and a fixed-depth drafter's cache) instead of
computing them again, while that request runs or after. Greedy output is
the same as without it, for plain decoding and every drafter kind, and when blocks run short (cached ones are
reclaimed); a wrong block handed over as cached would change the tokens."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from spec_engine import LLM, SamplingParams, default_model_paths

TARGET, DRAFT = default_model_paths()
EAGLE_DIR = str(Path(TARGET).parent / "eagle")
BLOCK = 32  # LLM's default block_size
_rng = random.Random(0)
BASE = [_rng.randrange(3, 2000) for _ in range(90)]
# the same prompt again (2 full blocks of its first 89 tokens cached), one that leaves it inside its second block
# (that block's key differs: only the first is shared), and one that runs past it (its third block was never cached)
PROMPTS = [BASE, BASE, BASE[:40] + [5, 6, 7] * 10, BASE + [9] * 20]
CACHED = [0, 2 * BLOCK, BLOCK, 2 * BLOCK]
SPECS = {
    "plain": None,
    "draft model, fixed depth": {"model": DRAFT, "num_speculative_tokens": 3},
    "draft model, adaptive": {"model": DRAFT},
    "eagle head, adaptive": {"method": "eagle", "model": EAGLE_DIR},
    "hybrid": {"method": "hybrid", "model": DRAFT},
}


def _run(spec, caching: bool, prompts=PROMPTS, **kw) -> tuple[list[list[int]], list[int], LLM]:
    llm = LLM(TARGET, speculative_config=spec, max_model_len=256, enable_prefix_caching=caching, **kw)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    outs = [llm.generate({"prompt_token_ids": p}, params, use_tqdm=False)[0] for p in prompts]  # one after another
    return [o.outputs[0].token_ids for o in outs], [o.metrics["num_cached_tokens"] for o in outs], llm


@pytest.mark.parametrize("name", list(SPECS))
def test_a_cached_prefix_decodes_the_same_tokens(name):
    reference, none, _ = _run(SPECS[name], caching=False)
    tokens, cached, llm = _run(SPECS[name], caching=True)
    assert none == [0] * len(PROMPTS) and cached == CACHED
    assert tokens == reference
    assert llm.allocator.num_used == 0 and llm.allocator.num_cached == 4  # BASE's 2, one more of each later prompt


def test_prompts_sharing_prefixes_in_a_small_cache_decode_the_same_tokens():
    """A KV budget of three requests, a drafter, prompts sharing prefixes in every mix, several at once and then
    again in the other order: every output is what the engine gives without prefix caching."""
    prompts = [BASE[: 40 + 7 * i] + [i + 3] * 30 for i in range(8)] + [BASE, BASE[:70], BASE]
    kw = dict(kv_cache_memory=None, max_num_seqs=3)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    outs = {}
    for caching in (False, True):
        llm = LLM(TARGET, speculative_config={"model": DRAFT}, max_model_len=160, enable_prefix_caching=caching,
                  **kw)  # fmt: skip
        blocks = llm.allocator.num_blocks
        first = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        second = llm.generate([{"prompt_token_ids": p} for p in reversed(prompts)], params, use_tqdm=False)
        outs[caching] = [o.outputs[0].token_ids for o in first + second]
        cached = sum(o.metrics["num_cached_tokens"] for o in second)
        assert llm.allocator.num_used == 0
    assert outs[True] == outs[False]
    assert cached > 0 and blocks < 3 * len(prompts)  # some prompts were served from the cache; not all could be kept


def test_an_evicted_block_is_never_handed_out_as_cached():
    """A cache of 7 usable blocks: BASE's request leaves its 2 prompt blocks cached; a long request needs 6 blocks,
    so the deeper of them (the least recently used) is reclaimed and overwritten; BASE again finds its first block
    only, and decodes what it decoded the first time."""
    from spec_engine.kv_cache import kv_bytes_per_token

    probe = LLM(TARGET, max_model_len=192)
    per_block = BLOCK * kv_bytes_per_token(probe.target.config, probe.engine.kv.data.dtype)
    llm = LLM(TARGET, max_model_len=192, kv_cache_memory=8 * per_block)  # the least it takes: 1 + ceil(193 / 32)
    assert llm.allocator.num_blocks == 8
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    long = [_rng.randrange(3, 2000) for _ in range(170)]  # 170 + 16 + 1 tokens: 6 blocks
    outs = [llm.generate({"prompt_token_ids": p}, params, use_tqdm=False)[0] for p in (BASE, long, BASE)]
    assert [o.metrics["num_cached_tokens"] for o in outs] == [0, 0, BLOCK]
    assert outs[2].outputs[0].token_ids == outs[0].outputs[0].token_ids


def test_a_running_request_lends_its_prompt_blocks():
    """Blocks are cached as the prefill completes them: a request that arrives while the first still decodes takes
    them, and both decode what each decodes alone without prefix caching."""
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    alone = LLM(TARGET, max_model_len=256, enable_prefix_caching=False)
    reference = [alone.generate({"prompt_token_ids": p}, params, use_tqdm=False)[0].outputs[0].token_ids
                 for p in (BASE, BASE + [5])]  # fmt: skip
    engine = LLM(TARGET, max_model_len=256).engine
    first = engine.add_request(BASE, params)
    while first.prefilling or not first.output_token_ids:
        engine.step()
    second = engine.add_request(BASE + [5], params)  # its first 90 tokens: the first request's 2 full blocks
    assert not first.finished  # (admitted at the next step, beside it)
    while engine.has_unfinished():
        engine.step()
    assert [first.metrics.num_cached_tokens, second.metrics.num_cached_tokens] == [0, 2 * BLOCK]
    assert [first.output_token_ids, second.output_token_ids] == reference


SYSTEM = [_rng.randrange(3, 2000) for _ in range(150)]  # a long shared prefix: 4 full blocks, the 5th has a tail
BURST = [SYSTEM + [_rng.randrange(3, 2000) for _ in range(10)] for _ in range(4)]


def _outputs(prompts, caching: bool, **kw) -> tuple[list[list[int]], list[int]]:
    llm = LLM(TARGET, max_model_len=256, enable_prefix_caching=caching, **kw)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)  # admitted together
    return [o.outputs[0].token_ids for o in outs], [o.metrics["num_cached_tokens"] for o in outs]


def test_a_burst_sharing_a_long_prefix_computes_it_once():
    """Requests admitted in one step with one long shared prefix: the first computes it (in chunks of 64 here), the
    others wait for its blocks and take them; every output is what the engine gives without prefix caching."""
    reference, _ = _outputs(BURST, caching=False, prefill_chunk=64)
    tokens, cached = _outputs(BURST, caching=True, prefill_chunk=64)
    assert tokens == reference
    assert cached == [0] + [4 * BLOCK] * 3


def test_a_short_shared_prefix_does_not_hold_a_request_back():
    """One shared block against 100 tokens of the request's own: computing that block again costs less than a
    step's wait, so both are admitted at once (nothing cached between them) and decode as without caching."""
    prompts = [SYSTEM[:40] + [_rng.randrange(3, 2000) for _ in range(100)] for _ in range(2)]
    reference, _ = _outputs(prompts, caching=False)
    tokens, cached = _outputs(prompts, caching=True)
    assert tokens == reference and cached == [0, 0]


def test_a_held_request_keeps_its_place_and_others_go_by():
    """A request held for a running prefill's blocks stays first in the queue; an unrelated one behind it is
    admitted at once; when the request computing the blocks is aborted the held one is admitted at the next step
    with what was cached, and decodes what it decodes alone."""
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    other = [_rng.randrange(3, 2000) for _ in range(60)]
    alone = LLM(TARGET, max_model_len=256, enable_prefix_caching=False)
    reference = [
        alone.generate({"prompt_token_ids": p}, params, use_tqdm=False)[0].outputs[0].token_ids
        for p in (BURST[1], other)
    ]
    engine = LLM(TARGET, max_model_len=256, prefill_chunk=64).engine
    first, held, unrelated = (engine.add_request(p, params) for p in (BURST[0], BURST[1], other))
    engine.step()
    assert engine.running == [first, unrelated] and list(engine.waiting) == [held]
    engine.abort(first.request_id)  # its first chunk (2 blocks) is cached; the rest of the prefix will not come
    engine.step()
    assert held in engine.running and held.metrics.num_cached_tokens == 2 * BLOCK
    while engine.has_unfinished():
        engine.step()
    assert [held.output_token_ids, unrelated.output_token_ids] == reference


@pytest.mark.parametrize("name", ["plain", "draft model, adaptive"])
def test_a_short_last_chunk_beside_a_long_one_near_the_context_end(name):
    """A prompt whose cached prefix leaves a short chunk near the end of the context, prefilled in one step with
    another prompt's long chunk: rows are padded to the widest chunk, and a padded slot's position must stay inside
    the RoPE table and the row's blocks (it ran past them and raised; the step then ran each request alone, hiding
    it). Same tokens as each request alone, and no step retried."""
    rng = random.Random(1)
    long_prompt = [rng.randrange(3, 2000) for _ in range(210)]
    other = [rng.randrange(3, 2000) for _ in range(150)]
    llm = LLM(TARGET, speculative_config=SPECS[name], max_model_len=224, prefill_chunk=128)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    llm.generate({"prompt_token_ids": long_prompt}, params, use_tqdm=False)  # its 6 full blocks cached
    prompts = [{"prompt_token_ids": long_prompt + [5, 6, 7]}, {"prompt_token_ids": other}]
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert llm.engine.stats["num_retried_steps"] == 0
    alone = LLM(TARGET, speculative_config=SPECS[name], max_model_len=224, enable_prefix_caching=False)
    assert together == [alone.generate(p, params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
