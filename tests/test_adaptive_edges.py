"""spec_engine/adaptive.py at its edges, with costs injected (never the wall clock): clocks that fail (NaN, inf, a
clock that stands still or runs back), machines that stall, batches of 1 and 64, max_gamma 1 and 16, and the
design's two ends: a perfect draft reaches max_gamma and a useless one is turned off."""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

import pytest

from bench.replay_adaptive import StubRequest
from spec_engine.adaptive import MAX_PROBE_INTERVAL, PROBE_INTERVAL, AdaptiveController

NAN, INF = float("nan"), float("inf")


def request(max_tokens: int = 1 << 20) -> StubRequest:
    return StubRequest(spec_state=None, params=SimpleNamespace(max_tokens=max_tokens), output_token_ids=[],
                       metrics=SimpleNamespace(alpha_estimate=None))  # fmt: skip


def step_seconds(B: int, G: int, num_drafted: int) -> tuple[float, float]:
    """(draft, whole step) seconds: a memory-bound target (10 ms, +20 us per verified token) and a draft of 0.5 ms
    per level; drafting at depth G pays for any acceptance above ~0.3."""
    draft = (0.0005 + 0.00001 * num_drafted) * G
    return draft, 0.01 + 0.00002 * B * (G + 1) + draft


def flat_widths(c: float, r2: float):
    """(draft, whole step) seconds where drafting is cheap (a GPU's): a draft step at ``c`` of a 10 ms target pass,
    and a pass over T tokens per row ``r(T) = 1 + (r2 - 1) * (T - 1)`` plain passes (flat: r(2) = ``r2``)."""

    def seconds(B: int, G: int, num_drafted: int) -> tuple[float, float]:
        draft = 0.01 * c * G
        return draft, 0.01 * (1.0 + (r2 - 1.0) * G) + draft

    return seconds


def run(ctl: AdaptiveController, reqs: list, accepted, num_steps: int, clock=lambda s, d, t: (d, t),
        seconds=step_seconds) -> list[int]:  # fmt: skip
    """Drive ``ctl`` as Engine._decode does, one step per choice; ``accepted(step, depth)`` the drafts a row keeps,
    ``seconds(B, G, rows drafted)`` a step's (draft, whole) seconds and ``clock(step, draft, whole)`` what the
    controller is told the step took. The deepest row's depth per step."""
    deepest = []
    for s in range(num_steps):
        live = [r for r in reqs if len(r.output_token_ids) < r.params.max_tokens]
        if not live:
            break
        gammas = ctl.choose(live)
        assert all(isinstance(g, int) and 0 <= g <= ctl.max_gamma for g in gammas), gammas
        counts = [accepted(s, g) + 1 for g in gammas]
        ctl.observe(live, gammas, counts, *clock(s, *seconds(len(live), max(gammas), sum(g > 0 for g in gammas))))
        for r, n in zip(live, counts):
            r.output_token_ids.extend([0] * n)
        deepest.append(max(gammas))
    return deepest


def perfect(step: int, depth: int) -> int:
    return depth


@pytest.mark.parametrize("bad", [(NAN, NAN), (0.001, NAN), (INF, INF), (0.001, INF), (0.0, 0.0), (0.02, 0.01)],
                         ids=["nan", "nan-step", "inf", "inf-step", "clock-stood-still", "clock-ran-back"])  # fmt: skip
@pytest.mark.parametrize("at", [1, 5])
def test_a_failed_clock_reading_teaches_nothing(bad, at):
    """One step timed by a clock that failed (NaN, inf, no time at all, a draft part longer than the whole step):
    before, it poisoned the cost fits (NaN for good) or priced a pass at 0 s, so that plain decoding looked
    infinitely fast and a perfect draft stayed off for good."""
    ctl = AdaptiveController(8, lambda g: g + 1)
    deepest = run(ctl, [request()], perfect, 300, lambda s, d, t: bad if s == at else (d, t))
    assert all(math.isfinite(x) for x in (*ctl.target_cost.theta, *ctl.draft_cost.theta))
    assert deepest[-20:].count(8) >= 19  # (the plain probe aside)


@pytest.mark.parametrize("B, slower, depth", [(1, 10.0, 8), (64, 5.0, 7)])  # (at 64 rows the line prices depth 8 a hair
# above depth 7, its measured neighbour)
def test_a_perfect_draft_drafts_again_after_the_machine_stalled(B, slower, depth):
    """50 steps on a busy machine (every part ``slower`` times as slow) priced drafting above plain decoding, and once
    off nothing drafted re-measured it: plain steps refreshed the rate to beat, the drafted prices stayed the busy
    ones, and a perfect draft stayed off for good. Drafting's prices are re-measured as plain decoding's are."""
    ctl = AdaptiveController(8, lambda g: g + 1)

    def busy(s: int, draft: float, whole: float) -> tuple[float, float]:
        return (slower * draft, slower * whole) if 10 <= s < 60 else (draft, whole)

    deepest = run(ctl, [request() for _ in range(B)], perfect, 900, busy)
    assert 0 in deepest[10:300]  # (the stall turned it off)
    assert sum(d >= depth for d in deepest[-20:]) >= 19


@pytest.mark.parametrize("B", [1, 64])
@pytest.mark.parametrize("D", [1, 16])
def test_a_perfect_draft_reaches_max_gamma(B, D):
    """alpha -> 1 for hundreds of steps (no 1 / (1 - alpha) blows up), at every max_gamma and batch."""
    deepest = run(AdaptiveController(D, lambda g: g + 1), [request() for _ in range(B)], perfect, 300)
    assert deepest[-20:].count(D) >= 17


@pytest.mark.parametrize("slower", [3.0, 10.0])
def test_a_middling_draft_drafts_again_after_the_machine_stalled(slower):
    """The stall of the test above with a chat-like draft (alpha 0.5, where depth 2-3 pays about 1.4x on these
    costs): the price probe re-measured drafting only for drafts as good as PROBE_ALPHA, so this one stayed off for
    good (a run of chat requests drafted almost nothing on a shared Xeon). It is probed because its drafts pay at a
    verify's floor price, a plain step's."""
    rng, seconds = random.Random(0), flat_widths(0.1, 1.02)

    def accepted(step: int, depth: int) -> int:
        k = 0
        while k < depth and rng.random() < 0.5:
            k += 1
        return k

    def busy(s: int, draft: float, whole: float) -> tuple[float, float]:
        return (slower * draft, slower * whole) if 10 <= s < 60 else (draft, whole)

    ctl = AdaptiveController(4, lambda g: g + 1)
    deepest = run(ctl, [request()], accepted, 1500, busy, seconds=seconds)
    assert 0 in deepest[10:300]  # (the stall turned it off)
    assert sum(d > 0 for d in deepest[-200:]) >= 190


def test_a_useless_draft_buys_no_price_probes():
    """The price probe drafts a row while nothing has drafted for an interval, to re-measure drafting's prices; a
    row that is off for its drafts (accepting nothing), not for the prices, would pay its catch-up (a whole prompt,
    for a lazily filled head) every interval for nothing."""
    ctl = AdaptiveController(8, lambda g: g + 1)
    slow_draft = lambda s, d, t: (6 * d, t + 5 * d)  # noqa: E731 (a draft at 0.3 of a step: a useless one is off)
    reqs = [request()]
    run(ctl, reqs, lambda step, depth: 0, 300, slow_draft)
    ctl._next_probe = ctl.num_steps + 1000  # (no undrafted-row probe due: the price probe's case)
    ctl._drafted_at = ctl.num_steps - 1000
    assert ctl.choose(reqs) == [0]  # (a perfect draft's price probe: test_a_perfect_draft_drafts_again_after...)


@pytest.mark.parametrize("c", [0.02, 0.05, 0.08])
@pytest.mark.parametrize("r2", [1.0, 1.05])
def test_a_useless_draft_costs_little_over_a_long_request_where_drafting_is_cheap(c, r2):
    """A draft that accepts nothing, 2,000 steps, where a draft step costs a few percent of a target pass: its rate
    used to settle at alpha_0 / 6 (the prior's floor: the forgetful counts never outweighed it), where depth 1 still
    paid, and it drafted every step, up to 5% slower than plain decoding. The "never slower" aim: at most ~1%."""
    num_steps, seconds = 2000, flat_widths(c, r2)
    deepest = run(AdaptiveController(8, lambda g: g + 1), [request()], lambda step, depth: 0, num_steps,
                  seconds=seconds)  # fmt: skip
    cost = sum(seconds(1, G, G > 0)[1] for G in deepest) / (num_steps * seconds(1, 0, 0)[1])  # one token a step
    assert sum(G > 0 for G in deepest) < 0.05 * num_steps
    assert cost < 1.01


@pytest.mark.parametrize("c", [0.02, 0.08])
@pytest.mark.parametrize("alpha, speedup", [(0.5, 1.4), (0.8, 2.3)])
def test_a_useful_draft_is_drafted_where_drafting_is_cheap(c, alpha, speedup):
    """The other end of the useless draft's case (same costs): a draft at alpha 0.5-0.8 drafts every step but the
    plain probes, deeper for the better one, faster than plain decoding by about what the geometric model says
    (alpha 0.5 at depth ~2-3: 1.4-1.6x; alpha 0.8 at depth ~6-8: 2.4-3.2x)."""
    rng, seconds, kept = random.Random(0), flat_widths(c, 1.02), []

    def accepted(step: int, depth: int) -> int:
        k = 0
        while k < depth and rng.random() < alpha:
            k += 1
        kept.append(k)
        return k

    deepest = run(AdaptiveController(8, lambda g: g + 1), [request()], accepted, 1000, seconds=seconds)
    assert sum(G > 0 for G in deepest) >= 990  # (the plain probes aside: one per 256 steps)
    time = sum(seconds(1, G, G > 0)[1] for G in deepest)
    assert (len(deepest) + sum(kept)) * seconds(1, 0, 0)[1] / time > speedup


def test_a_draft_that_turns_useful_is_noticed():
    """A draft useless for 600 steps (off, probed now and then), then perfect: a probe finds it within the longest
    probe interval, and it is back at max depth within a few steps more."""
    deepest = run(AdaptiveController(8, lambda g: g + 1), [request()], lambda step, depth: depth if step >= 600 else 0,
                  900, seconds=flat_widths(0.05, 1.02))  # fmt: skip
    assert sum(G > 0 for G in deepest[300:600]) < 15  # (off: a probe or a drift back now and then, at depth 1)
    back = next(s for s in range(600, 900) if deepest[s] == 8)
    assert back - 600 <= MAX_PROBE_INTERVAL + PROBE_INTERVAL + 8


@pytest.mark.parametrize("sized", [False, True], ids=["depths", "sized"])
def test_no_row_drafts_past_the_tokens_it_can_keep(sized):
    """A row's depth is at most its tokens left but one, whatever the controller would choose: before any cost is
    measured it offers the widest tree (a suffix drafter's largest budget always), and a 3-token request's step at
    depth 8 verified a tree whose last tokens it could never keep (the engine's hybrid did so on its last token)."""
    ctl = AdaptiveController(8, lambda g: g + 1, sized=sized)
    reqs = [request(max_tokens=3), request(max_tokens=1), request()]
    assert ctl.choose(reqs) == [2, 0, 8]
    reqs[0].output_token_ids.extend([0, 0])
    assert ctl.choose(reqs)[0] == 0
    deepest = run(AdaptiveController(8, lambda g: g + 1, sized=sized), [request(max_tokens=40)], perfect, 100)
    left = 40
    for depth in deepest:  # (a perfect draft keeps every drafted token)
        assert depth <= left - 1
        left -= depth + 1
