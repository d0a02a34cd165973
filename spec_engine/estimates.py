"""Online estimates the adaptive controller (spec_engine/adaptive.py) plans with: each request's acceptance, the
step's costs and the verify widths' prices, each updated once per step from what the step measured (no forward pass),
and how a native call's measured seconds are split into the steps it ran (``chain_step_costs``).

Glossary:
    alpha_j     probability that a drafted path survives depth j, given it survived depth j-1 (a chain has one alpha:
                the geometric model of docs/ARCHITECTURE.md)
    E(gamma)    expected tokens emitted from one step drafted at gamma: 1 + sum_{d<=gamma} prod_{j<=d} alpha_j
    width       the tokens one target pass verifies: B * T

- acceptance (``AcceptanceEstimate``): per request and depth, exponentially forgotten counts (``DECAY`` per drafted
  step of the row) of the geometric MLE: alpha = (a + s * alpha_e) / (a + r + s). A step drafted at depth gamma that
  accepted k adds one accept at depths 1..k and one reject at depth k+1 (if k < gamma). A chain pools the depths (which
  is exactly the geometric MLE); a tree shrinks each depth toward the row's pooled estimate with ``DEPTH_PRIOR``
  pseudo-trials. The prior alpha_e (s = ``PRIOR_STRENGTH`` pseudo-trials) is the request's earlier rate: the same
  counts forgotten slowly (``LONG_DECAY``) less the recent ones, itself shrunk with s pseudo-trials toward alpha_0, the
  acceptance of the recent requests (the controller's slower-forgetting estimate over all rows, itself starting at
  0.5): a new request starts where its predecessors ended, so it neither wastes steps on a useless draft nor ramps up
  slowly with a good one.
  Why two levels: the recent counts never hold more than 1 / (1 - DECAY) = 10 rejects, so a fixed prior at alpha_0
  floored a draft that accepts nothing at alpha_0 / 6 (~0.08); where a draft step costs a few percent of a target
  pass and verify widths are flat (a GPU's), depth 1 still paid there, and a useless draft drafted every step of a
  long request, up to 5% slower than plain decoding (tests/test_adaptive_edges.py, "...a useless draft costs little").
  The earlier rate weighs up to ~100 steps' evidence against alpha_0's 2 pseudo-trials: a useless draft's falls toward
  alpha_0 / 45 (its alpha below that) and it is off within ~10 drafted steps, then drafts ever more rarely (a few
  percent of a long request's steps, at depth 1: under 0.3% of its time); a useful draft's prior is its own earlier
  rate, no pull toward alpha_0 and as steady as before, so its depths do not move. Undrafted steps fade the recent
  counts (``update`` at depth 0, per step as when drafted): a row that a run of rejects put off drifts back to its
  earlier rate and drafts again without waiting for a probe (a draft at alpha 0.3 otherwise sat out 64-step probe
  intervals), while a useless row's earlier rate keeps it off.
- optimism (``AcceptanceEstimate.alpha_optimistic``): the controller plans with
  alpha + OPTIMISM * sqrt(alpha (1 - alpha) / (n + n_0)), n the row's drafted tokens so far (not forgotten). Two
  unlucky first steps would otherwise put a good draft at alpha ~0.25 and off until its next probe; with the bonus it
  keeps drafting shallowly until the evidence is real. The bonus shrinks as the request goes on: after ~10
  always-rejected tokens a useless draft is off (measured in bench_adaptive). A new request starts from the recent
  requests' rate, itself well measured, so n_0 = ``OPTIMISM_PSEUDO_TRIALS`` = 16 and OPTIMISM = 0.5 keep its first
  bonus small (+0.06 at alpha 0.66; n_0 = 2 and OPTIMISM = 1 gave +0.33 and sent every new request's first step to
  depth 8, which a 16-row batch paid with T = 9). Chosen by replaying recorded drafts of 24 held-out prompts and the
  5 demo prompts through the controller with a cost model fit to the engine's measured steps (noise-free): OPTIMISM 1
  and n_0 8 drafted held-out prompts where a draft was useless and made them slower than plain decoding; 0.5 and 16
  lose less there, at the price of a little geomean over the 24 (bench/RESULTS-log.md, "Figures moved from code
  comments (2026-11-26)").
- cost (``LinearCost``): least squares with forgetting (``COST_FORGET``) of t = theta_0 * x_0 + theta_1 * x_1, on
  which the controller fits a step's target part, a + b * width, and its draft part, c * G + d * draft tokens. A weak
  prior on b / a and d / c splits the first observations, so the first step can run at max depth (optimistic) and the
  measurements correct it. A step slower than ``OUTLIER`` times its prediction is clipped, since other jobs on the
  machine preempt steps at random.
- verify widths (``WidthTable``): each width measured is priced by its cheapest recent pass, the line's convexity
  correction; a width not measured for a while is priced by the line again (``WidthTable.expire``).
"""

from __future__ import annotations

import math

DECAY = 0.9  # per drafted step of a row: a half-life of ~6.6 steps, so a request adapts within ~10 steps
PRIOR_STRENGTH = 2.0  # pseudo-trials of each prior: alpha_0's in the earlier rate, the earlier rate's in alpha
LONG_DECAY = 0.99  # per drafted step of a row: the counts of the earlier rate remember ~100 steps (see acceptance)
DEPTH_PRIOR = 2.0  # pseudo-trials pulling a tree depth's alpha toward the row's pooled alpha
OPTIMISM = 0.5  # standard errors added to alpha when planning (see "optimism" above)
OPTIMISM_PSEUDO_TRIALS = 16.0  # the evidence a new request's prior is worth to the optimism bonus
COST_FORGET = 0.97  # per observed step: the cost fits remember ~30 steps (batch size and context drift)
TABLE_SAMPLES = 8  # target passes per verify width whose cheapest prices that width (WidthTable)
TOKENS_REF = 16.0  # token counts are divided by this so both coefficients of a fit have comparable scales
OUTLIER = 3.0  # a step timed above this multiple of its prediction (preemption, a one-time load) is clipped to it


def geometric_tokens(alpha: float, max_gamma: int, cap: float) -> list[float]:
    """``[D + 1]`` E(gamma) = 1 + alpha + ... + alpha^gamma for gamma = 0..D, each capped at ``cap`` tokens."""
    out, reach, total = [1.0], 1.0, 1.0
    for _ in range(max_gamma):
        reach *= alpha
        total += reach
        out.append(min(total, cap))
    return out


class AcceptanceEstimate:
    """Forgetful accept/reject counts of one request (or of all rows); see the module docstring.

    Plain floats, not numpy: at these sizes numpy's per-call overhead would cost more than the step it steers.
    """

    def __init__(self, max_gamma: int, per_depth: bool, prior: float = 0.5, decay: float = DECAY):
        self.num_accepts = self.num_rejects = 0.0  # decayed counts over all depths: the pooled (chain) estimate
        self.num_trials = 0  # drafted tokens judged (accepts + rejects), never forgotten: the optimism's sample size
        self.accepts = [0.0] * max_gamma  # [D]: decayed count of steps whose path survived depth j+1 (trees only)
        self.rejects = [0.0] * max_gamma  # [D]: decayed count of steps whose path stopped at depth j+1 (trees only)
        self.per_depth, self.prior, self.decay = per_depth, prior, decay
        self.long_accepts = self.long_rejects = 0.0  # the pooled counts forgotten at LONG_DECAY (alpha_earlier)

    def update(self, depth: int, num_accepted: int, steps: int = 1) -> None:
        """One step drafted at ``depth`` that kept ``num_accepted`` drafted tokens; depth 0: ``steps`` undrafted steps,
        over which the recent counts go stale and alpha falls back to the earlier rate (see acceptance)."""
        if depth == 0:
            f = self.decay**steps
            self.num_accepts, self.num_rejects = f * self.num_accepts, f * self.num_rejects
            if self.per_depth:
                self.accepts, self.rejects = [f * a for a in self.accepts], [f * r for r in self.rejects]
            return
        rejected = num_accepted < depth
        self.num_trials += num_accepted + rejected
        self.num_accepts = self.decay * self.num_accepts + num_accepted
        self.num_rejects = self.decay * self.num_rejects + rejected
        self.long_accepts = LONG_DECAY * self.long_accepts + num_accepted
        self.long_rejects = LONG_DECAY * self.long_rejects + rejected
        if self.per_depth:
            self.accepts = [self.decay * a + (j < num_accepted) for j, a in enumerate(self.accepts)]
            self.rejects = [self.decay * r + (rejected and j == num_accepted) for j, r in enumerate(self.rejects)]

    @property
    def alpha(self) -> float:
        """The pooled (chain) acceptance rate per drafted token."""
        prior = self.alpha_earlier
        return (self.num_accepts + PRIOR_STRENGTH * prior) / (self.num_accepts + self.num_rejects + PRIOR_STRENGTH)

    @property
    def alpha_earlier(self) -> float:
        """The rate over the request's earlier drafted steps, shrunk toward the recent requests' rate: the prior of
        ``alpha``. The slowly forgotten counts less the recent ones, so that no step counts twice (two failed first
        steps weigh about as they did under a fixed prior)."""
        a = max(self.long_accepts - self.num_accepts, 0.0)
        r = max(self.long_rejects - self.num_rejects, 0.0)
        return (a + PRIOR_STRENGTH * self.prior) / (a + r + PRIOR_STRENGTH)

    @property
    def alpha_optimistic(self) -> float:
        """alpha plus ``OPTIMISM`` binomial standard errors: what the controller plans with."""
        a = self.alpha
        return min(a + OPTIMISM * (a * (1.0 - a) / (self.num_trials + OPTIMISM_PSEUDO_TRIALS)) ** 0.5, 1.0)

    def depth_alphas(self, optimistic: bool = False) -> list[float]:
        """[D] alpha_j: the chance that the path survives depth j+1 once it reached depth j."""
        pooled = self.alpha_optimistic if optimistic else self.alpha
        if not self.per_depth:
            return [pooled] * len(self.accepts)
        return [(a + DEPTH_PRIOR * pooled) / (a + r + DEPTH_PRIOR) for a, r in zip(self.accepts, self.rejects)]

    def expected_tokens(self, cap: float, optimistic: bool = False, rescue: float = 0.0) -> list[float]:
        """[D + 1] E(gamma) = 1 + sum_{d<=gamma} prod_{j<=d} alpha_j for gamma = 0..D, each capped at ``cap`` tokens.
        ``rescue``: a wider tree's rescue rate h, each level then kept at alpha_j + (1 - alpha_j) * h
        (spec_engine/tree_pricing.py)."""
        out, reach, total = [1.0], 1.0, 1.0
        for a in self.depth_alphas(optimistic):
            reach *= a + (1.0 - a) * rescue
            total += reach
            out.append(min(total, cap))
        return out


class LinearCost:
    """t ~ theta . (x0, x1) by least squares with exponential forgetting, plus a ridge prior theta1 ~ ratio * theta0.

    The prior weighs as one observation, so it only decides what the data cannot: the split between the two
    coefficients while every observation has the same x. A 2x2 solve in closed form: cheaper than numpy's.
    Observations above ``OUTLIER`` times the prediction are clipped: one slow step (the machine's other jobs) would
    otherwise steer ~30 steps.
    """

    def __init__(self, prior_ratio: float, forget: float = COST_FORGET):
        self.forget, self.ratio = forget, prior_ratio
        self._xx = [0.0, 0.0, 0.0]  # decayed sums of x0*x0, x0*x1, x1*x1
        self._xt = [0.0, 0.0]  # decayed sums of x0*t, x1*t
        self.num_observed = 0
        self.theta = (0.0, 0.0)

    def observe(self, x0: float, x1: float, t: float) -> None:
        if self.num_observed >= 2:
            t = min(t, OUTLIER * self.predict(x0, x1))
        f, xx, xt = self.forget, self._xx, self._xt
        self._xx = [f * xx[0] + x0 * x0, f * xx[1] + x0 * x1, f * xx[2] + x1 * x1]
        self._xt = [f * xt[0] + x0 * t, f * xt[1] + x1 * t]
        self.num_observed += 1
        a00, a01, a11 = self._xx[0] + self.ratio**2, self._xx[1] - self.ratio, self._xx[2] + 1.0  # + (-r, 1)(-r, 1)^T
        det = a00 * a11 - a01 * a01
        theta0 = (a11 * self._xt[0] - a01 * self._xt[1]) / det
        theta1 = (a00 * self._xt[1] - a01 * self._xt[0]) / det
        self.theta = (max(theta0, 0.0), max(theta1, 0.0))  # noise must not make more work look cheaper

    def predict(self, x0: float, x1: float) -> float:
        return self.theta[0] * x0 + self.theta[1] * x1


class WidthTable:
    """Measured target-pass seconds per verify width (B * T tokens): the line's convexity correction.

    On a CPU whose small-M matmuls turn compute-bound past a few rows (AVX2, bfloat16 widened in registers) a pass's
    cost is convex in its width, well above a plain step already at 2 tokens (bench/RESULTS.md, "r(T)"; the default
    target's passes: bench/RESULTS-log.md, "Figures moved out of code comments (2026-11-25)"): a line fit through
    the depths a request used over-prices the middle ones, and a draft at alpha 0.8 that pays at depth 2-3 looked
    not to (bench/RESULTS-log.md, "A CPU without AVX-512"). Each width keeps its last ``TABLE_SAMPLES`` steps and is
    priced by the cheapest (as plain steps are, ``plain_cost``: other jobs on the machine and cold caches only slow a
    step, and a few slow first steps of a request, right after another engine ran, had priced depth 1 far above a plain
    step for good (the same 2026-11-25 section), so that a draft at alpha 0.98 went undrafted for a whole request); a
    width not measured is priced by the line, but never above the straight interpolation between its measured neighbours
    (a convex cost lies below its chords)."""

    def __init__(self):
        self.samples: dict[int, list[float]] = {}  # width -> its last TABLE_SAMPLES target-pass seconds
        self.prices: dict[int, float] = {}  # width -> the price of a pass that wide (the cheapest recent one)
        self.seen: dict[int, int] = {}  # width -> the step of its last sample

    def observe(self, width: int, t: float, step: int = 0) -> None:
        self.samples[width] = kept = [*self.samples.get(width, []), t][-TABLE_SAMPLES:]
        self.prices[width], self.seen[width] = min(kept), step

    def expire(self, before: int) -> None:
        """Forget the widths last measured before step ``before``: a price measured while the machine was busy kept
        its width from being chosen, hence measured, again, and pinned a perfect draft below max_gamma for good."""
        for width in [w for w, step in self.seen.items() if step < before]:
            del self.samples[width], self.prices[width], self.seen[width]

    def predict(self, width: int, line: float, anchors: dict[int, float] | None = None) -> float:
        """``anchors``: other measured passes (plain steps: width B) that bound the chords where no drafted width
        was measured. Never above a wider width's price: a pass over fewer tokens costs no more, and a narrow width
        priced on a busy spell, above the wider ones measured since, kept the depths between off."""
        wider = min((t for x, t in self.prices.items() if x > width), default=math.inf)
        if width in self.prices:
            return min(self.prices[width], wider)
        known = {**(anchors or {}), **self.prices}
        below = max((x for x in known if x < width), default=None)
        above = min((x for x in known if x > width), default=None)
        if below is None or above is None:
            return min(line, wider)
        f = (width - below) / (above - below)
        return min(line, (1.0 - f) * known[below] + f * known[above], wider)


def chain_step_costs(times: list[list[float]], wall: float, steps: int) -> list[tuple[float, float]]:
    """(draft, whole step) seconds of each step a native call ran, as the adaptive controller prices them: ``times``
    the call's native [draft, step] seconds per step run, ``wall`` the call's wall time, ``steps`` the steps of a
    full call (``EngineConfig.spec_chain_steps``; ``plain_chain`` for plain chains).

    Each step carries a share of the call's own work (inputs, dispatch, committing) as a full call would spread it:
    the controller compares drafting and plain decoding as they run when it commits to one (16-step speculative
    calls, 16-step plain chains). Charged to the steps run instead, the short calls of exploring priced both wrong: a
    one-step probe call (its Python comparable to the step itself) made drafting look far dearer than full calls
    cost, and the 4-step plain probe chains between drafted steps (dearer per token than a full chain) made drafts
    at alpha 0.45 look faster than plain decoding at depth 2 (bench/RESULTS-log.md, "Native steps without ATen" and
    "Figures moved from code comments (2026-11-26)")."""
    share = max(wall - sum(t[1] for t in times), 0.0) / max(steps, 1)
    return [(t[0], t[1] + share) for t in times]
