"""bench/replay_adaptive.py: the noise-free replay the adaptive controller's constants are chosen with. Synthetic
records (no model): the acceptance it reads, the engine's call structure it prices, and the controller's two ends
(a draft that is always right pays; a useless one costs little)."""

from __future__ import annotations

import pytest

from bench import replay_adaptive as replay_mod

COSTS = replay_mod.PROFILES["smollm2"]


def record(ks: list[int], prompt_len: int = 100) -> dict:
    return {"name": "synthetic", "prompt_len": prompt_len, "y": list(range(len(ks))), "ks": ks}


def test_a_recorded_count_is_cut_by_the_depth_and_the_answers_end():
    rec = record([5, 0, 8, 8])
    assert [replay_mod.accepted(rec, 0, G, 4) for G in (1, 3, 8)] == [1, 3, 3]  # 3 tokens follow position 0
    assert replay_mod.accepted(rec, 1, 8, 4) == 0
    assert replay_mod.accepted(rec, 2, 8, 4) == 1  # the answer's last token is the root's next
    # the default pair's records: the draft's own chain after prompt + y[:pos], compared with y[pos:]
    chains = {"name": "c", "prompt_len": 1, "y": [7, 8, 9, 5], "chains": [[7, 8, 1], [8, 9, 5], [9, 5, 0], [5, 0, 0]]}
    assert replay_mod.accepted(chains, 0, 3, 4) == 2 and replay_mod.accepted(chains, 1, 3, 4) == 2


def test_a_fixed_depth_runs_the_engines_calls():
    """A draft that is always right at depth 4 emits 5 tokens a step, 16 steps a call (EngineConfig's), after its
    prompt's prefill: the replayed time is those parts exactly."""
    n, L0 = 160, 100
    rec = record([8] * n, prompt_len=L0)
    steps = n // 5  # 32: two calls of 16
    expected = COSTS.catch_up_call + COSTS.catch_up_token * (L0 - 1)
    expected += 2 * COSTS.spec_call + sum(COSTS.target(4, L0 + 5 * s) + COSTS.draft(4) for s in range(steps))
    assert replay_mod.replay(replay_mod.controller(), rec, n, COSTS, fixed=4) == pytest.approx(expected)


@pytest.mark.parametrize("noise", [0.0, 0.05])
def test_the_controller_drafts_a_perfect_draft_and_drops_a_useless_one(noise):
    perfect = [record([8] * 128) for _ in range(4)]
    useless = [record([0] * 128) for _ in range(4)]
    good = replay_mod.ratios(perfect, 128, COSTS, shared=True, noise=noise, seed=1)
    bad = replay_mod.ratios(useless, 128, COSTS, shared=True, noise=noise, seed=1)
    assert min(good) > 2.5  # a perfect chain at depth 8: ~6x here (9 tokens for ~1.4 plain steps)
    assert min(bad[1:]) > 0.97 and bad[0] > 0.9  # the first request pays for finding out
