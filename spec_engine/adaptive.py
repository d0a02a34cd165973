"""Adaptive speculation: pick each row's gamma (its tree's depth) every step to maximise expected emitted tokens per
second.

Glossary:
    alpha_b,j   probability that row b's drafted path survives depth j, given it survived depth j-1 (a chain has
                one alpha per row: the geometric model of docs/ARCHITECTURE.md)
    E_b(gamma)  expected tokens row b emits from one step drafted at gamma: 1 + sum_{d<=gamma} prod_{j<=d} alpha_b,j,
                which for a chain is (1 - alpha^(gamma+1)) / (1 - alpha)
    G           the step's gamma: the deepest row's. Every row then pays for T = nodes_for_gamma(G) target tokens,
                because the target pass is dense [B, T]
    B_d         rows drafted this step; the engine runs the drafter on those rows only

Each step the controller scans G in 0..max_gamma and, for each G, the number k of rows drafted (the k rows that
gain most), and keeps the pair maximising
    (sum of E over the k drafted rows + the B - k undrafted rows) / (t_draft(G, k) + t_target(B * T(G))).
G = 0 turns the drafter off for the step: plain decoding. The scan is (max_gamma + 1) * (B + 1) numbers: ~1e3 at
max_gamma 16 and B 64, a small fraction of a step in Python, and no forward pass.

Estimates, all online and free (spec_engine/estimates.py: the acceptance counts with forgetting and the optimism
bonus, the cost fits, the verify widths' table), fed by the controller:
- acceptance: one estimate per request (``RowState``), whose prior is the acceptance of the recent requests
  (``population``, an estimate over all rows forgetting slower: ``POPULATION_DECAY``). The controller plans with the
  optimistic alpha, and prices a request's first drafted step and a probe without the bonus (below).
- cost: t_target = a + b * (B*T) and t_draft = c * G + d * (B_d * draft tokens, the catch-up of a lagging draft cache
  included), the draft part timed around ``Drafter.propose`` and the target part the rest of the step, both fit on
  drafted steps only (plain ones set the plain rate, below); each verify width measured is priced by its cheapest
  recent pass (``WidthTable``). The engine's first step is not timed (one-time costs). On CUDA the draft's kernels may
  finish after ``propose`` returns; their time then lands in the target part, which still rises with G, so the sum
  the controller compares stays right.

- plain rate: the rate drafting must beat is priced from measured plain steps (their lowest ratio to the target
  model, against today's fit), not from the line alone: a drafted step carries fixed costs a plain one does not
  (two compactions, the drafter's commit, its catch-up), so a line fit mostly through drafted steps over-prices
  plain decoding (bench/RESULTS-log.md, "Figures moved out of code comments (2026-11-25)") and drafts that lose
  looked as if they paid. While drafting, a plain chain runs every ``PLAIN_PROBE_INTERVAL`` steps to keep measuring:
  rarely, since a probe is a stretch of undrafted steps (at a shorter interval, one per short request), and only as
  long as measuring needs (``plain_probe_steps``: a full chain where steps take a fraction of a millisecond, a few
  steps where they take many); native steps are priced per step, their draft and target parts apart
  (bench/RESULTS.md, "what moved them"). The mirror: while nothing drafts, one row is drafted every
  ``PLAIN_PROBE_INTERVAL`` steps (``_price_probe``), and a verify width not measured for as long is priced by the
  line again (``WidthTable.expire``): prices measured on a busy machine otherwise kept a draft that pays off for good.

Margin: a step drafts only if it promises ``MIN_GAIN + TAIL_MARGIN * (1 - 1/B)`` times plain decoding's rate
(1.02 at batch 1, 1.19 at 16). The model prices one step; it does not see what speculation costs around it: the
draft model's catch-up on a prompt (the engine fills the draft cache lazily, on a row's first drafted step, so an
undrafted request never pays a draft prefill), and, when requests start together, the tail: rows finish at
different steps, so the last steps run a few rows at nearly a full step's cost, where plain decoding finishes them
all in the same step. The tail grows with the batch. At batch 16 on this CPU (fp32 verification is compute-bound:
a second token per row costs more than half the first) steps promising a clear gain measured none end to end, their
median slower than plain decoding (bench/RESULTS-log.md, "Figures moved from code comments (2026-11-26)"), so such
steps stay plain. At batch 1, where native steps are priced as they run, the margin is small: a larger one left
undrafted the requests whose drafts promise a few percent, which a fixed depth collects (bench/RESULTS.md).

Rows dropped to depth 0 receive no acceptance evidence (their recent counts fade toward the request's earlier rate:
spec_engine/estimates.py, "acceptance"), so every ``PROBE_INTERVAL`` steps the rows that have not been
drafted for their probe interval are drafted once (at G if others draft, else at depth 1). A probe that accepts
nothing doubles the row's interval, up to ``MAX_PROBE_INTERVAL``: a useless draft then costs one depth-1 step in 64,
a small share of the time (bench/RESULTS-log.md, "Figures moved from code comments (2026-11-26)"), and a draft that
turns useful is back within 64 steps. A new request starts with the interval of the last drafted row, so a stream of
short requests does not probe a useless draft at every start, but at most half its max_tokens: otherwise, after a few
hard requests had doubled the interval to 64, no later 64-token request was ever probed and speculation stayed off for
good. Steps count as the engine runs them (a native call runs several per choice).
A probe runs only if the scan would draft with the due rows' drafts as good as ``PROBE_ALPHA``: rows that are off
because drafting costs too much at this batch size (not because their drafts fail) learn nothing from a probe.
Their draft cache then lags; the first drafted step feeds the lag (catch-up), computing logits at the root only.

Priced probes: a probe's catch-up is most of its price (the prompt and every undrafted token, on a CPU where a step
at depth 1 already costs well over a plain token: bench/RESULTS-log.md, "A CPU without AVX-512"), so a due row is
probed only where its expected gain exceeds that price (``AdaptiveController.gain_pays``): the time a draft as good
as ``PROBE_ALPHA`` would save over the row's remaining tokens, times the recent probes' success rate. Unpriced,
every held-out request paid a probe that never paid back, and each of those prompts decoded slower than plain
decoding (bench/RESULTS-log.md, "Figures moved from code comments (2026-11-26)"); a long request, a cheap catch-up
or a run of successful probes still buys one. The success rate starts from a prior worth a single probe, so a draft
whose probes all miss stops buying a long prompt's catch-up within a few requests (``probe_success``). A request's first
drafted step (its whole prompt to catch up) is priced the same way, at the rate its evidence promises without the
optimism bonus: it buys evidence where the cache is current, not a prompt's catch-up at alpha ~0.45 (break-even).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from spec_engine.estimates import TOKENS_REF, AcceptanceEstimate, LinearCost, WidthTable, geometric_tokens
from spec_engine.tree_pricing import RescueRate, chain_evidence, scan_depths, shape_tables

POPULATION_DECAY = 0.99  # per drafted row-step: the engine-wide estimate remembers ~100 of them
PROBE_INTERVAL = 16  # steps between probes of undrafted rows
MAX_PROBE_INTERVAL = 64
TARGET_PER_TOKEN_PRIOR = 0.1  # b / a: a verified token's prior cost as a share of a target pass's fixed cost (set
# from HF eager's verify cost: bench/RESULTS-log.md, "Figures moved from code comments (2026-11-26)")
DRAFT_PER_TOKEN_PRIOR = 0.1  # d / c
PROBE_ALPHA = 0.8  # a due row is probed if a draft this good would be drafted now (see the probes above)
PROBE_PRIOR = 0.5  # the chance that a probe accepts its draft before any probe was seen (see "priced probes")
PROBE_PRIOR_STRENGTH = 1.0  # ... worth this many probes (Jeffreys' Beta(1/2, 1/2): see probe_success)
PROBE_DECAY = 0.9  # per probe: the probes' success rate remembers ~10 of them
MIN_GAIN = 1.02  # drafting must promise this multiple of plain decoding's tokens/s at batch 1 (see "margin")
TAIL_MARGIN = 0.18  # added to it as the batch grows: MIN_GAIN + TAIL_MARGIN * (1 - 1/B)
PLAIN_PROBE_INTERVAL = 256  # while drafting, a plain probe starts every this many steps: the rate to beat
PLAIN_PROBE_PHASE = 8  # ... the first of them at this step (apart from the undrafted rows' probes)
PLAIN_PROBE_SECONDS = 0.05  # ... about this long a chain (see plain_probe_steps)
PLAIN_PROBE_MIN_STEPS = 4  # ... and at least this many steps
PLAIN_SAMPLES = 64  # plain steps whose measured / modelled cost ratio sets the plain rate (their lowest): the
# steady chains of a plain stretch, not only the last two probe chains (which run right after drafted steps and
# cost more per step than a steady chain: bench/RESULTS-log.md, "Figures moved out of code comments (2026-11-25)")
SURE_TRIALS = 8  # drafted tokens of a request after which a native call keeps its depth through rejections


@dataclass
class RowState:
    """What the controller keeps per request (``Request.spec_state``)."""

    acceptance: AcceptanceEstimate
    steps_undrafted: int = 0
    probe_interval: int = PROBE_INTERVAL
    probing: bool = False  # the row's next drafted step is a probe (its outcome feeds the probes' success rate)


class AdaptiveController:
    """Chooses per-row depths (``choose``) and learns from each step's outcome and timing (``observe``).

    Parameters
    ----------
    max_gamma : the deepest tree allowed (``"auto"``: 8 for a draft model's chains, 4 for an EAGLE head's; a static
        tree's own depth).
    nodes_for_gamma : T of a row drafted at depth gamma (``Drafter.nodes_for_gamma``).
    tree : the drafts are trees (wider than chains): track acceptance per depth, and count the draft model's
        forward over all the nodes above the deepest level (a chain runs one new node per forward).
    cache_lag : tokens a row's draft cache must catch up on before it is drafted (``cache_seqlen - draft_len``).
    sized : the drafter shapes each row's tree itself (``Drafter.sizes_trees``: suffix speculation, whose depths are
        budgets of nodes): every row is offered ``max_gamma``, the drafter drops the rows nothing matches and the
        engine the rows whose step does not pay (``step_pays``); the controller measures the costs and runs the plain
        probes, and learns no acceptance (such rows come with depth 0 to ``observe``).
    widths : tree width -> its deepest depth, where the controller picks each step's width too (``tree="auto"``: 1 a
        chain, k EAGLE-2's dynamic tree of k nodes a level; spec_engine/tree_pricing.py); None: the drafter's own
        trees (width 0) up to ``max_gamma``.
    """

    def __init__(self, max_gamma: int, nodes_for_gamma: Callable[[int], int], *, tree: bool = False,
                 cache_lag: Callable[[object], int] = lambda req: 0, sized: bool = False,
                 widths: dict[int, int] | None = None):  # fmt: skip
        self.max_gamma = max_gamma
        self.tree, self.sized = tree or bool(widths), sized  # (widths: per depth, a head's acceptance falls with it)
        self.cache_lag = cache_lag
        self.widths = widths or {0: max_gamma}
        self.width = max(self.widths)  # the last choice's (the widest until costs are measured: see choose)
        self.shapes = {k: shape_tables(k, max_gamma, nodes_for_gamma, tree) for k in self.widths}  # k -> (T, draft)
        self.rescue = {k: RescueRate() for k in self.widths if k > 1}  # h_k, pooled over rows
        self.shapes_run: dict[tuple[int, int], int] = {}  # (width, depth) -> drafted steps observed (a counter)
        self.target_cost = LinearCost(TARGET_PER_TOKEN_PRIOR * TOKENS_REF)
        self.target_widths = WidthTable()  # measured passes per verify width, on top of the line (target_time)
        self.draft_cost = LinearCost(DRAFT_PER_TOKEN_PRIOR * TOKENS_REF)
        self.population = AcceptanceEstimate(max_gamma, per_depth=False, decay=POPULATION_DECAY)
        self.plain_probe = False  # the last choice was the plain probe (see choose)
        self.num_steps = 0  # steps observed
        self._next_probe = 0  # the step at or after which undrafted rows' probes are next considered
        self._next_plain_probe = PLAIN_PROBE_PHASE  # ... and a plain step is next run while drafting
        self._drafted_at = 0  # the step of the last drafted pass timed (or price probe chosen): drafting's prices' age
        self.probe_interval = PROBE_INTERVAL  # the last drafted row's: where a new request's interval starts
        self._catch_up_tokens = 0  # tokens the draft cache catches up on this step, drafted rows
        self._cold = True  # the engine's first step pays one-time costs (extension loads, allocations): not timed
        self._plain_steps: list[tuple[int, float]] = []  # (batch, seconds) of the last PLAIN_SAMPLES plain steps
        self._plain_mins: tuple[list, dict[int, float]] = ([], {})  # (the samples it was computed from, _plain_min)
        self._probe_hits = self._probe_misses = 0.0  # probes that accepted their draft / did not, forgotten slowly
        self._memo: dict = {}  # prices computed within one choice (target_time, plain_cost): a choice asks for the
        # same ones ~10 times, and recomputing them from 64 plain samples cost a visible share of plain decoding's
        # time (bench/RESULTS-log.md, "A CPU without AVX-512")

    @property
    def nodes(self) -> list[int]:
        return self.shapes[self.width][0]  # [D+1] T of a row drafted at depth gamma, at the last choice's width

    @property
    def draft_tokens(self) -> list[float]:
        return self.shapes[self.width][1]  # [D+1] tokens per row of the draft's forwards at depth gamma

    @property
    def rescue_rate(self) -> float:
        """h of the last choice's width (0 for chains and the drafter's own trees)."""
        return self.rescue[self.width].rate if self.width > 1 else 0.0

    def state(self, req) -> RowState:
        if req.spec_state is None:
            acceptance = AcceptanceEstimate(self.max_gamma, self.tree, prior=self.population.alpha)
            # the last drafted row's interval, but due within the request's first half: short requests that inherit
            # a long interval were never probed, and after a few hard ones speculation stayed off for good
            interval = min(self.probe_interval, max(PROBE_INTERVAL, req.params.max_tokens // 2))
            req.spec_state = RowState(acceptance, probe_interval=interval)
        return req.spec_state

    def choose(self, reqs: Sequence) -> list[int]:
        """Depth per row for this step (0 = not drafted). ``plain_probe`` then says whether an all-zero choice is
        the plain step measured while drafting wins rather than a choice not to draft."""
        self.plain_probe = False
        self._memo.clear()  # (prices hold within one choice: the fits may have been set since)
        B, D = len(reqs), self.max_gamma
        states = [self.state(r) for r in reqs]
        if self.sized:  # the largest budget, but a plain probe now and then: the rate step_pays must beat
            plain = self._plain_probe_due(bool(self.target_cost.num_observed))
            return self._commit_choice(reqs, states, [0 if plain else D] * B)
        # a dynamic tree is greedy and coupled rows' (others draft chains, whose draft distributions they verify with)
        widths = {w: g for w, g in self.widths.items() if w < 2 or all(r.params.greedy or r.coupled for r in reqs)}
        if not (self.target_cost.num_observed and self.draft_cost.num_observed):
            self.width = max(widths)  # the widest tree, whose measured pass bounds the chords to the untried widths
            return self._commit_choice(reqs, states, [widths[self.width]] * B)  # optimistic until costs are measured
        caps = [max(r.tokens_left, 1) for r in reqs]  # later tokens are worth nothing
        # the rate to beat: plain decoding's, raised by the margin
        margin = MIN_GAIN + TAIL_MARGIN * (1.0 - 1.0 / B)
        plain_rate = margin * B / max(self.plain_cost(B), 1e-9)
        best = None
        for width in widths:  # each width's best depth and rows, at its own prices
            self.width = width
            E = [s.acceptance.expected_tokens(cap, True, self.rescue_rate) for s, cap in zip(states, caps)]  # [B][D+1]
            found = (*self._scan(E, plain_rate), width, E)
            best = found if best is None or found[2] > best[2] else best
        best_G, best_k, best_rate, self.width, E = best
        if self._plain_probe_due(best_G > 0):
            return self._commit_choice(reqs, states, [0] * B)  # a plain step, measured (see plain_cost)
        gammas = [0] * B
        for b in sorted(range(B), key=lambda b: -E[b][best_G])[:best_k]:
            # a lagging draft cache's catch-up is paid up front: priced on the evidence, without the optimism
            if self.gain_pays(reqs[b], B, self._row_rate(states[b], reqs[b], B, best_G), 1.0):
                gammas[b] = best_G
        self._probe(reqs, states, E, gammas, best_G, plain_rate)
        if not any(gammas) and self.num_steps - self._drafted_at >= PLAIN_PROBE_INTERVAL:
            self._price_probe(reqs, E, gammas, plain_rate)
        return self._commit_choice(reqs, states, gammas)

    def _price_probe(self, reqs: Sequence, E: list[list[float]], gammas: list[int], plain_rate: float) -> None:
        """Draft one row at the depth the prices favour, though it loses to plain decoding: the plain probe's mirror.
        Drafting is priced only from drafted steps, so prices measured on a busy machine (50 steps at 10x) outlived
        it, and a draft that pays stayed off for good. Only a row whose drafts would pay at a verify's floor price
        (a useless head's would pay its catch-up for nothing, every interval; a bar of alpha >= ``PROBE_ALPHA`` kept
        chat's, alpha ~0.5, off for good), and of those the row whose draft cache lags least: its catch-up is the
        price."""
        plain = self.plain_cost(len(reqs))  # the floor: no pass over more tokens costs less than a plain step

        def pays(b: int) -> bool:  # were every row like b
            return any(len(reqs) * E[b][G] / max(plain + self.draft_cost.predict(G, len(reqs) * self.draft_tokens[G]
                       / TOKENS_REF), 1e-9) > plain_rate for G in range(1, self.widths[self.width] + 1))  # fmt: skip

        good = [b for b in range(len(reqs)) if pays(b)]
        if not good:
            return
        G = self._scan(E, 0.0)[0]
        b = min(good, key=lambda b: (self.cache_lag(reqs[b]), -E[b][G]))
        gammas[b], self.state(reqs[b]).probing = G, True
        self._drafted_at = self.num_steps

    def _plain_probe_due(self, drafting: bool) -> bool:
        """Whether this choice, which would draft, is the plain probe (``plain_probe``; the next one is then due
        PLAIN_PROBE_INTERVAL steps on)."""
        if not drafting or self.num_steps < self._next_plain_probe:
            return False
        self._next_plain_probe = self.num_steps + PLAIN_PROBE_INTERVAL
        self.plain_probe = True
        return True

    def step_pays(self, width: int, tokens: float, B: int) -> bool:
        """Whether a drafted step over ``width`` = B * T tokens that is expected to emit ``tokens`` beats plain
        decoding's rate at batch B by the margin ``choose`` asks (a step whose trees the drafter sized itself:
        suffix speculation). True until the target's passes are measured."""
        if not self.target_cost.num_observed:
            return True
        margin = MIN_GAIN + TAIL_MARGIN * (1.0 - 1.0 / B)
        return tokens / max(self.target_time(width), 1e-9) > margin * B / max(self.plain_cost(B), 1e-9)

    def unsure(self, reqs: Sequence) -> bool:
        """Whether some row has judged fewer than ``SURE_TRIALS`` drafted tokens: a native call of several steps
        (``StepRunner._spec_chain``) then ends at the first step where a row accepted nothing, so a new request's guess
        (the recent requests' rate) costs one step when its draft turns out useless. Past that the call keeps its
        depth through rejections: ending it there paid the per-call work at almost every step at alpha ~0.4, more
        than the steps a stale depth wastes. A probe is unsure too: it is one trial of a row that was off, and a 16-step
        call at depth 1 on a draft at alpha ~0.2 ('def fibonacci(n):') cost a fresh engine a sizeable share of a
        128-token request, twice (bench/RESULTS-log.md, "Figures moved from code comments (2026-11-26)")."""
        return any(self.state(r).acceptance.num_trials < SURE_TRIALS or self.state(r).probing for r in reqs)

    def target_time(self, width: int) -> float:
        """Seconds of a drafted step's target pass over ``width`` = B * T tokens: the line, corrected by the widths
        measured (WidthTable; plain steps are measured passes over B tokens too, so the chord from them bounds the
        widths between them and a drafted one: a fresh engine's line through its first, deep steps priced depth 1
        far above a plain step, near depth 8, and a draft at alpha 0.98 went undrafted for a whole request;
        bench/RESULTS-log.md, "Figures moved out of code comments (2026-11-25)"), and never below a measured plain
        step of at most that many rows (verifying more tokens never costs less: a line through one deep step priced
        depth 1 below a measured plain step; "Figures moved from code comments (2026-11-26)")."""
        memo = self._memo.get(("target", width))
        if memo is not None:
            return memo
        plain = self._plain_min()
        floor = min((t for b, t in plain.items() if b <= width), default=0.0)
        line = self.target_cost.predict(1.0, width / TOKENS_REF)
        self._memo["target", width] = out = max(self.target_widths.predict(width, line, anchors=plain), floor)
        return out

    def plain_probe_steps(self, B: int) -> int:
        """Steps of the plain probe at batch B (the engine caps them at a full chain): about PLAIN_PROBE_SECONDS of
        plain decoding, at least PLAIN_PROBE_MIN_STEPS. Sub-millisecond steps keep a full chain (short chains read
        dearer per step, and weak drafts looked as if they paid: bench/RESULTS-log.md, "A CPU without AVX-512");
        a real model's full chain cost a fresh engine's single request a sizeable share of its time (RESULTS-log,
        "The plain probe's length")."""
        return max(PLAIN_PROBE_MIN_STEPS, math.ceil(PLAIN_PROBE_SECONDS / max(self.plain_cost(B), 1e-9)))

    def _plain_min(self) -> dict[int, float]:
        """batch -> its cheapest recent plain step: a measured pass over B tokens."""
        samples, mins = self._plain_mins
        if samples is not self._plain_steps:  # (observe replaces the list): recomputed at each choice, a large
            # share of it (bench/RESULTS-log.md, "One thread team per forward")
            mins = {}
            for b, t in self._plain_steps:
                mins[b] = min(t, mins.get(b, t))
            self._plain_mins = (self._plain_steps, mins)
        return mins

    def plain_cost(self, B: int) -> float:
        """Seconds of a plain (undrafted) step at batch B: the cost model's, scaled by what plain steps measured.

        The model ``a + b * tokens`` is fit on every step, and a drafted step carries fixed costs a plain one does not
        (compacting two caches, the drafter's commit, its catch-up): a line through mostly drafted steps over-prices
        plain decoding, which made drafts that do not pay look as if they did. So the rate to beat comes from
        measured plain steps (a full chain of ``EngineConfig.plain_chain`` steps per PLAIN_PROBE_INTERVAL while
        drafting), the cheapest of the last PLAIN_SAMPLES: noise only slows a step, and a chain right after drafted
        steps costs more per step than the chains that run when nothing drafts, which is the rate drafting must
        beat. Priced from short probe chains alone, weak drafts looked worth drafting and lost (bench/RESULTS.md)."""
        memo = self._memo.get(("plain", B))
        if memo is None:
            self._memo["plain", B] = memo = self._plain_cost(B)
        return memo

    def _plain_cost(self, B: int) -> float:
        modelled = self.target_cost.predict(1.0, B / TOKENS_REF)
        # never above a measured target pass over as many tokens or more (a plain step verifies the fewest): before
        # plain steps are measured the line's intercept alone priced them, and on a 2-core AVX2 CPU a fresh engine's
        # line (through its first, deep steps) put plain decoding far above a measured depth-1 pass: a draft at
        # alpha 0.45 then looked worth drafting and ran well below plain decoding's speed (bench/RESULTS-log.md,
        # "Figures moved from code comments (2026-11-26)")
        wider = min((t for w, t in self.target_widths.prices.items() if w >= B), default=float("inf"))
        if not self._plain_steps:
            return min(modelled, wider)
        # each measurement against today's model (an early one against an early fit would stay wrong for good)
        lowest = min(t / max(self.target_cost.predict(1.0, b / TOKENS_REF), 1e-9) for b, t in self._plain_min().items())
        return min(modelled * min(max(lowest, 0.2), 5.0), wider)

    def _scan(self, E: list[list[float]], plain_rate: float) -> tuple[int, int, float]:
        """``scan_depths`` at the last choice's width, up to its deepest depth. E ``[B][D+1]``."""
        nodes = self.nodes[: self.widths[self.width] + 1]
        return scan_depths(E, plain_rate, nodes, self.draft_tokens, self.target_time, self.draft_cost)

    def _probe(self, reqs, states: list[RowState], E: list[list[float]], gammas: list[int], G: int,
               plain_rate: float) -> None:  # fmt: skip
        """Draft once the undrafted rows whose probe is due, so a request whose text turned predictable recovers.
        Only where that could matter: if the scan would not draft even with the due rows' drafts as good as
        ``PROBE_ALPHA``, the rows are off for the cost, not for their drafts, and new evidence changes nothing.
        (At batch 16 on this CPU, probes of good rows were a steady share of row-steps, each with a draft catch-up:
        bench/RESULTS-log.md, "Why we fall short".) And only where it pays in expectation (``gain_pays``)."""
        if self.num_steps < self._next_probe:
            return
        self._next_probe = self.num_steps + PROBE_INTERVAL
        due = [b for b, s in enumerate(states) if gammas[b] == 0 and s.steps_undrafted >= s.probe_interval]
        if not due:
            return
        what_if = list(E)
        for b in due:
            cap = max(reqs[b].tokens_left, 1)
            what_if[b] = [max(e, x) for e, x in zip(E[b], geometric_tokens(PROBE_ALPHA, self.max_gamma, cap))]
        found_G, _, good_rate = self._scan(what_if, plain_rate)
        if found_G == 0:
            return
        for b in due:
            if self.gain_pays(reqs[b], len(reqs), good_rate, self.probe_success):
                gammas[b] = max(G, 1)
                states[b].probing = True

    @property
    def probe_success(self) -> float:
        """The chance that a probe accepts its draft: the recent probes' rate, ``PROBE_PRIOR`` before any. The prior
        is worth one probe (Jeffreys' Beta(1/2, 1/2)), not two: under the uniform Beta(1, 1) a useless head's rate fell
        as 1/(n + 2), and ~14 probes missed in a row before a 256-token prompt's catch-up stopped paying, ~4% of each
        64-token request (bench/RESULTS-log.md, "A useless head's probes, and where the end-to-end speedup goes")."""
        hits = self._probe_hits + PROBE_PRIOR_STRENGTH * PROBE_PRIOR
        return hits / (self._probe_hits + self._probe_misses + PROBE_PRIOR_STRENGTH)

    def row_rate(self, req, B: int, G: int) -> float:
        """The batch's tokens/s with ``req`` drafted at depth G (0: plain) and the others plain, at the row's
        acceptance without the optimism bonus."""
        if G == 0:
            return B / max(self.plain_cost(B), 1e-9)
        return self._row_rate(self.state(req), req, B, G)

    def _row_rate(self, state: RowState, req, B: int, G: int) -> float:
        cap = max(req.tokens_left, 1)
        e = state.acceptance.expected_tokens(cap, rescue=self.rescue_rate)[G]
        t = self.target_time(B * self.nodes[G]) + self.draft_cost.predict(G, self.draft_tokens[G] / TOKENS_REF)
        return (B - 1 + e) / max(t, 1e-9)

    def gain_pays(self, req, B: int, rate: float, chance: float) -> bool:
        """Whether drafting ``req`` is worth its price: the time drafting at ``rate`` (the batch's tokens/s) saves
        against plain decoding over the row's remaining tokens, times the ``chance`` that its draft is that good,
        against what drafting it costs up front: the draft's catch-up on every token its cache lacks (a new
        request's whole prompt; for a probe, the undrafted steps too: a sizeable share of a short request's time on
        a 2-core AVX2 CPU, bench/RESULTS-log.md, "A CPU without AVX-512") plus one drafted step's excess over a
        plain one. A row whose cache is current (a lag of a token or two, the steps' own) pays nothing up front.
        For a probe ``rate`` is a draft as good as ``PROBE_ALPHA``'s and ``chance`` the probes' success rate
        (``probe_success``); for a choice, the rate at the row's acceptance without the optimism bonus (the bonus
        buys evidence on a current cache; a prompt's catch-up on it drafted held-out requests at alpha ~0.45 where
        depth 1 breaks even) and 1. Unpriced, every held-out request paid a
        probe, and most a first drafted step, that never paid back: each of those prompts decoded slower than plain
        decoding (bench/RESULTS-log.md, "Figures moved from code comments (2026-11-26)")."""
        lag = self.cache_lag(req)
        if lag <= 2:
            return True
        plain_step = self.plain_cost(B)
        left = max(req.tokens_left, 0)
        saving = left * B * max(plain_step / B - 1.0 / max(rate, 1e-9), 0.0)  # seconds over the row's life
        catch_up = self.draft_cost.predict(0.0, lag / TOKENS_REF)
        step = self.target_time(B * self.nodes[1]) + self.draft_cost.predict(1.0, 0.0)
        return chance * saving > catch_up + max(step - plain_step, 0.0)

    def _commit_choice(self, reqs: Sequence, states: list[RowState], gammas: list[int]) -> list[int]:
        # no row deeper than its tokens left but one (the widest tree before costs are measured, probes: unpriced)
        gammas = [min(g, max(r.tokens_left, 1) - 1) for r, g in zip(reqs, gammas)]
        # a draft model first feeds each drafted row what its cache lacks (1 after a full chain; a first draft: all)
        self._catch_up_tokens = sum(self.cache_lag(r) for r, gamma in zip(reqs, gammas) if gamma)
        return gammas

    def expected_accepted(self, req, gamma: int) -> float:
        """The drafted tokens ``req`` is expected to keep from a step drafted at depth ``gamma``: sum over d <= gamma
        of prod_{j<=d} alpha_j (no optimism bonus), what a hybrid drafter's suffix speculation must beat."""
        cap = max(req.tokens_left, 1)
        expected = self.state(req).acceptance.expected_tokens(cap, rescue=self.rescue_rate)
        return expected[min(gamma, self.max_gamma)] - 1.0

    def observe(self, reqs: Sequence, gammas: Sequence[int], num_accepted: Sequence[int], draft_seconds: float,
                step_seconds: float, steps: int = 1, timed: bool = True, width: int | None = None,
                ranks: Sequence[list[int] | None] | None = None) -> None:  # fmt: skip
        """Learn from one step: ``num_accepted`` as verify_tree's (the root included), the step's wall times.
        ``steps`` > 1: that many plain steps of ``step_seconds`` each (a native chain's), observed in one call (one
        call per step cost a measurable share of a token: bench/RESULTS-log.md, "Figures moved out of code comments
        (2026-11-25)"). ``timed=False``: the step's acceptance only (a step on the thread count the tuner probes).
        ``width``: the tokens the step's target pass verified (None: B * nodes_for_gamma of the deepest row), wider
        than the depths say where suffix speculation shaped the trees (its rows come with depth 0 here: they teach
        no acceptance, and such a step with no other drafted row prices its width alone). ``ranks`` [B]: each row's
        accepted path's ranks (``spec_engine.tree.path_ranks``) on a step of width > 1 (None: a chain's or the
        drafter's own trees): the row's chain acceptance learns what a chain would have kept, h_k the rescues.

        Steps are counted here, not per ``choose``: a native call runs several steps on one choice (up to 16 plain
        steps per chain), and a count of choices made undrafted requests of 64 tokens wait longer than their life for a
        probe (after a few hard requests, speculation stayed off for every later short one)."""
        assert steps == 1 or not any(gammas), "several steps in one call are plain ones"
        self.num_steps += steps
        if any(gammas):
            self.shapes_run[self.width, max(gammas)] = self.shapes_run.get((self.width, max(gammas)), 0) + 1
        self._memo.clear()
        for b, (req, gamma, n) in enumerate(zip(reqs, gammas, num_accepted)):
            s = self.state(req)
            s.steps_undrafted = s.steps_undrafted + steps if gamma == 0 else 0
            rank = ranks[b] if ranks is not None and gamma else None
            kept, judged = (n - 1, gamma) if rank is None else chain_evidence(rank)  # (what a chain would have kept)
            s.acceptance.update(judged, kept, steps)
            if gamma == 0:
                continue
            if rank is not None and self.width > 1:
                self.rescue[self.width].observe(rank, gamma)
            self.population.update(judged, kept)
            if s.probing:  # the probe's outcome: did the draft's first token survive?
                s.probing = False
                hit = float(n > 1)
                self._probe_hits = PROBE_DECAY * self._probe_hits + hit
                self._probe_misses = PROBE_DECAY * self._probe_misses + 1.0 - hit
            s.probe_interval = PROBE_INTERVAL if n > 1 else min(2 * s.probe_interval, MAX_PROBE_INTERVAL)
            self.probe_interval = s.probe_interval
            req.metrics.alpha_estimate = s.acceptance.alpha
        # a clock that failed (NaN, inf, stood still, ran back) tells nothing of the step's cost: one NaN poisoned
        # the fits for good, and one pass priced at 0 s made plain decoding look infinitely fast, drafting off for good
        if not timed or not 0.0 <= draft_seconds < step_seconds < math.inf:
            return
        if self._cold:  # (the first step alone: a plain chain's later steps are timed)
            self._cold = False
            self._catch_up_tokens = 0  # (a native call's later steps did not catch up)
            steps -= 1
            if steps == 0:
                return
        B, G = len(reqs), max(gammas)
        num_drafted = sum(gamma > 0 for gamma in gammas)
        width = B * self.nodes[G] if width is None else width
        if width == B:  # (compared with the line only when priced: plain_cost)
            self._plain_steps = [*self._plain_steps, *[(B, step_seconds)] * steps][-PLAIN_SAMPLES:]
            return
        # the target's line from drafted steps alone (plain ones are priced by plain_cost): a plain stretch (8 steps
        # per chain) would push a forgetful fit's drafted-step level down to plain decoding's, and a useless draft
        # looked worth another try after every few chains
        self._drafted_at = self.num_steps
        target_seconds = step_seconds - draft_seconds
        self.target_widths.expire(self.num_steps - PLAIN_PROBE_INTERVAL)
        self.target_widths.observe(width, target_seconds, self.num_steps)
        self.target_cost.observe(1.0, width / TOKENS_REF, target_seconds)
        if G:
            tokens = num_drafted * self.draft_tokens[G] + self._catch_up_tokens
            self.draft_cost.observe(G, tokens / TOKENS_REF, draft_seconds)
            self._catch_up_tokens = 0  # the choice's first step caught up (a native call observes several)
