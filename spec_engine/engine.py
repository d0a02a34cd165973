"""The engine: one step is schedule -> run -> commit (the loop of docs/ARCHITECTURE.md).

Each ``Engine.step()``:
1. the ``Scheduler`` (spec_engine/scheduler.py) gives the running requests their next call's KV blocks, preempting
   the newest where none are left, and admits waiting requests while batch slots and blocks allow;
2. one prefill chunk runs for the requests still reading their prompt (so a long prompt never stalls decoding);
3. one decode call runs for every decoding request: each row's depth (fixed, or the adaptive controller's) and how
   many steps the call may run are chosen here, the ``StepRunner`` (spec_engine/runner.py) runs them and returns a
   ``StepResult`` that ``_apply`` commits (tokens, lengths, metrics, the adaptive controller's evidence);
4. finished requests retire at once, returning their blocks.

A request's own state and its per-slot rows live in spec_engine/request.py. Its prompt is prefilled except its last
token, which becomes the first root: the first speculative step then produces the first output tokens, so prefill
needs no logits and no sampling path of its own.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from spec_engine.adaptive import AdaptiveController
from spec_engine.drafters.base import Drafter, DraftPlan
from spec_engine.estimates import chain_step_costs
from spec_engine.inputs import RequestLimits
from spec_engine.kv_cache import BlockAllocator, PagedKVCache
from spec_engine.models import Target
from spec_engine.request import Request, RequestRows, StepOutput
from spec_engine.runner import StepRunner
from spec_engine.sampling import SamplingParams
from spec_engine.scheduler import Schedule, Scheduler
from spec_engine.step import REGULAR, StepPlan, StepResult
from spec_engine.structured import Grammars
from spec_engine.threads import ThreadTuner
from spec_engine.tree_pricing import priced_plan

log = logging.getLogger("spec_engine.engine")

GAMMA_HISTORY_LEN = 4096  # steps of Engine.gamma_history (and calls of Engine.plan_history) kept


@dataclass(frozen=True)
class EngineConfig:
    """The engine's knobs, fixed at construction (``Engine.reconfigure`` replaces them whole). The defaults are the
    engine's own choice; tests and benchmarks pass others (``LLM(..., engine_config=EngineConfig(plain_chain=1))``).

    plain_chain : plain steps (greedy and coupled sampled rows) per native chain (``StepRunner.plan``); 1 turns
        chains off.
    spec_chain_steps : greedy speculative steps per native call (``StepRunner.plan``); 0 turns it off.
    unsure_chain_steps : the same while the adaptive controller is unsure of a row (``AdaptiveController.unsure``).
    native_tree_step : a regular step of greedy rows (trees drafted in Python: suffix speculations, static trees)
        verifies in one native call (``tree_step``) on a native target; False: the target pass, ``verify_tree`` and
        compaction as separate ops.
    couple_unseeded : unseeded sampled requests (``invariant`` unset) sample through the position-keyed coupling
        (``spec_engine/coupling.py``) rather than by rejection sampling. None: where the native calls sample coupled
        rows (a native target on the CPU with an EAGLE-3 head's chains and ``spec_chain_steps`` > 0, or with no
        drafter and ``plain_chain`` > 1: ``StepRunner.samples_natively``), which ran them faster than rejection
        sampling's regular steps at about its acceptance (bench/RESULTS-log.md, "Sampled rows in the native
        steps"); elsewhere rejection sampling, which accepts a little more.
    enforce_eager : every step's target pass runs eagerly (vLLM's name); False: on CUDA the regular step replays it
        from a CUDA graph captured per bucket of (rows, verify width) where its shape fits one
        (spec_engine/cuda_graphs.py). Same tokens and cache either way; nothing changes on CPU and meta.
    graph_mechanism : None (CUDA graphs on CUDA), or a name of ``spec_engine.cuda_graphs.MECHANISMS``: benchmarks time
        the compiled ones, tests run "replay" (the captured path on CPU and meta).
    """

    plain_chain: int = 16
    spec_chain_steps: int = 16
    unsure_chain_steps: int = 4
    native_tree_step: bool = True
    couple_unseeded: bool | None = None
    enforce_eager: bool = False
    graph_mechanism: str | None = None


class Engine:
    """Runs requests to completion on a target model, optionally speculating with ``drafter``.

    ``num_speculative_tokens`` is the tree depth: fixed, or with ``adaptive=True`` the deepest the controller
    (spec_engine/adaptive.py) may choose per row and step, 0 included.

    Device-true: every tensor a step computes on lives on the target's device; the host keeps the bookkeeping
    (lengths, blocks, parameters, token histories) in Python and numpy, sends each step's inputs in one copy per
    dtype, and reads one thing back per step: the emitted tokens (``StepRunner._read_step``).
    """

    def __init__(
        self,
        target: Target,
        kv: PagedKVCache,
        allocator: BlockAllocator,
        drafter: Drafter | None,
        *,
        num_speculative_tokens: int,
        max_model_len: int,
        max_num_seqs: int = 16,
        prefill_chunk: int = 512,
        eos_token_ids: list[int] | None = None,
        adaptive: bool = False,
        config: EngineConfig | None = None,
        detokenize: Callable[[list[int], bool], str] | None = None,
        grammars: Grammars | None = None,
    ):
        if getattr(target, "vocab_map", None) is not None:
            raise ValueError("the target's vocabulary cannot be restricted (restrict_vocab is for drafts): its logits "
                             "are the output")  # fmt: skip
        self.target, self.kv, self.allocator, self.drafter = target, kv, allocator, drafter
        self.device = kv.data.device
        self.gamma = num_speculative_tokens if drafter is not None else 0
        self.max_model_len = max_model_len
        self.eos_token_ids = set(eos_token_ids or [])
        self.detokenize = detokenize  # (token ids, skip special tokens) -> text (the tokenizer's): stop strings need it
        self.grammars = grammars  # guided_json / guided_regex / guided_grammar compile against the tokenizer
        self.vocab_size = target.config.vocab_size
        self.rows = RequestRows(max_num_seqs, allocator.blocks_for(max_model_len + self.max_tree_nodes()))
        self.limits = RequestLimits(self.vocab_size, max_model_len, self.eos_token_ids, grammars=grammars,
                                    reads_text=detokenize is not None, fits=self._fits_in_cache)  # fmt: skip
        self._ids, self._keys = itertools.count(), itertools.count()
        # num_regular_steps: decode steps taken by the regular (Python) step, not a native call; num_retried_steps:
        # steps whose rows raised together and ran again one by one (Engine._isolated: an engine bug where none fails)
        self.stats = {"num_steps": 0, "num_drafted": 0, "num_accepted": 0, "num_generated": 0, "num_errors": 0,
                      "num_regular_steps": 0, "num_cached_tokens": 0, "num_retried_steps": 0,
                      "num_preemptions": 0}  # fmt: skip
        self.deepest = deepest = max(self.gamma, drafter.max_gamma if drafter is not None else 0)  # (suffix rows)
        self.accepted_hist = [0] * (deepest + 1)
        self.gamma_history: deque[int] = deque(maxlen=GAMMA_HISTORY_LEN)  # per decode step: the deepest row's depth
        self.gamma_hist = [0] * (deepest + 1)  # [gamma] = rows drafted at depth gamma, over all steps
        self.threads = ThreadTuner() if self.device.type == "cpu" else None  # CPU threads per decode step
        self._step_count = 1  # steps the current decode call ran (a native chain runs several)
        self._step_kind: tuple = (0, 0, 1, False)  # the tuner's kind of the current decode call (see _decode)
        # the current decode call runs on the thread count the tuner probes, not the one it chose: its costs price
        # neither (a probe is one call, up to 16 native steps on the other count: they filled the controller's price
        # table for their width and kept that depth mispriced for the rest of a run; bench/RESULTS.md)
        self._thread_probe = False
        self.plan_history: deque[StepPlan] = deque(maxlen=GAMMA_HISTORY_LEN)  # per decode call, as it ran
        self.runner = StepRunner(target, kv, drafter, self.rows, block_size=allocator.block_size,
                                 max_tree_nodes=self.max_tree_nodes(), prefill_chunk=prefill_chunk)  # fmt: skip
        self.controller = None
        if adaptive and drafter is not None:
            tree = drafter.tree
            self.controller = AdaptiveController(self.gamma, drafter.nodes_for_gamma,
                                                 tree=tree is not None and not tree.is_chain,
                                                 cache_lag=self._cache_lag, sized=drafter.sizes_trees,
                                                 widths=drafter.widths)  # fmt: skip
        draft_follows_prefill = drafter is not None and drafter.keeps_cache and self.controller is None
        self.scheduler = Scheduler(allocator, self.rows, max_num_seqs=max_num_seqs, prefill_chunk=prefill_chunk,
                                   max_tree_nodes=self.max_tree_nodes(), call_tokens=0,
                                   draft_follows_prefill=draft_follows_prefill)  # fmt: skip
        self.reconfigure(config or EngineConfig())

    def reconfigure(self, config: EngineConfig) -> None:
        """Take ``config`` from the next step on, with everything derived from it (between ``generate`` calls)."""
        self._config = config
        # the native calls that sample: spec chains, or with no drafter plain chains
        native = self.runner.samples_natively and (
            config.spec_chain_steps > 0 if self.drafter is not None else config.plain_chain > 1
        )
        self.couple_unseeded = native if config.couple_unseeded is None else config.couple_unseeded
        self.scheduler.call_tokens = max(config.plain_chain, config.spec_chain_steps * (self.deepest + 1))
        self.runner.use_graphs(config.enforce_eager, config.graph_mechanism, self.verify_widths())

    @property
    def config(self) -> EngineConfig:
        """The engine's knobs, fixed between ``reconfigure`` calls (everything derived from them is derived there)."""
        return self._config

    @property
    def waiting(self) -> deque[Request]:
        return self.scheduler.waiting

    @property
    def running(self) -> list[Request]:
        return self.scheduler.running

    def metrics(self) -> dict:
        """A snapshot of the engine's counters (copies: safe to read from another thread)."""
        return {
            **self.stats,
            "num_requests_running": len(self.running),
            "num_requests_waiting": len(self.waiting),
            "accepted_hist": list(self.accepted_hist),
            "gamma_hist": list(self.gamma_hist),
            "last_step_depth": self.gamma_history[-1] if self.gamma_history else 0,
            "num_speculative_tokens": self.gamma,
            "adaptive": self.controller is not None,
            "decode_steps_on_one_thread": self.threads.steps_on_one if self.threads is not None else 0,
        }

    # --- requests --------------------------------------------------------------------------------------------

    def verify_widths(self) -> tuple[int, ...]:
        """The verify widths a regular step can meet, likeliest first: a plain step's 1, the tree at the configured
        depth, then each shallower one (the adaptive controller's other choices)."""
        if self.drafter is None:
            return (1,)
        return (1, *(self.drafter.nodes_for_gamma(g) for g in range(self.gamma, 0, -1)))

    def max_tree_nodes(self) -> int:
        if self.drafter is None:
            return 1
        return max(self.drafter.nodes_for_gamma(self.gamma), self.drafter.max_nodes)

    def _fits_in_cache(self, num_tokens: int) -> bool:
        """Whether a request of ``num_tokens`` (prompt + max_tokens) fits the KV cache alone, with a step's tree."""
        return self.allocator.blocks_for(num_tokens + self.max_tree_nodes()) <= self.allocator.num_blocks - 1

    def _cache_lag(self, req: Request) -> int:
        return self.runner.cache_lag(req)

    def check_request(self, ids: list[int], params: SamplingParams) -> list[int]:
        """Raise ``RequestError`` (a ValueError) for a request that can never run; nothing is queued. Returns the
        prompt it checked: as ``truncate_prompt_tokens`` cuts it (``RequestLimits.check``)."""
        return self.limits.check(ids, params)

    def add_request(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> Request:
        ids = self.check_request(prompt_token_ids, params)
        seed = params.seed if params.seed is not None else random.getrandbits(62)
        # through the coupling: as the request asks (a seed, or invariant), or unseeded where this engine chooses it
        coupled = params.coupled or (self.couple_unseeded and not params.greedy and params.invariant is None)
        req = Request(request_id or str(next(self._ids)), ids, params, seed, key=next(self._keys),
                      stop_ids=self.limits.stop_ids(params), coupled=coupled)  # fmt: skip
        if params.guided:
            req.grammar = self.grammars.state(params)
        req.metrics.arrival_time = time.perf_counter()
        self.scheduler.add(req)
        return req

    def abort(self, request_id: str) -> None:
        for req in self.scheduler.abort(request_id):
            if req.slot >= 0 or req.metrics.num_preemptions:  # it ran: its drafter may keep something for it
                self._finish(req, "abort")
            else:
                req.finish_reason = "abort"
                req.metrics.finish_time = time.perf_counter()  # (it never held blocks)
        self.scheduler.retire_finished()

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _finish(self, req: Request, reason: str) -> None:
        req.finish_reason = reason
        req.metrics.finish_time = time.perf_counter()
        self.scheduler.release(req)
        if self.drafter is not None:
            self.drafter.finish_request(req.view())

    # --- one engine iteration --------------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        """One iteration: admit, one prefill chunk, one speculative step. A request whose rows make the step fail
        is found by re-running the rows one at a time and finished with reason "error"; the others go on."""
        self._record(self.scheduler.schedule())
        outputs = self._isolated(self._prefill, [r for r in self.running if r.prefilling])
        decoding = [r for r in self.running if not r.prefilling]
        with self._decode_threads(bool(decoding)):
            outputs += self._isolated(self._decode, decoding)
        self.scheduler.retire_finished()
        return outputs

    def _record(self, schedule: Schedule) -> None:
        """Count what the scheduler did: preemptions, and the prompt tokens a new request took from the cache."""
        self.stats["num_preemptions"] += len(schedule.preempted)
        for req in schedule.admitted:
            if not req.metrics.num_preemptions:  # (a resumed request's hits are its own blocks: no prompt spared)
                req.metrics.num_cached_tokens = req.cache_seqlen
                self.stats["num_cached_tokens"] += req.cache_seqlen

    @contextlib.contextmanager
    def _decode_threads(self, active: bool):
        """The decode part of a step on the CPU threads ``self.threads`` chooses (all, or one when other work keeps
        the cores busy; spec_engine/threads.py), timed for it; the caller's thread count is restored after."""
        many = torch.get_num_threads()
        self._thread_probe = False
        if self.threads is None or not active or many == 1:
            yield
            return
        self._thread_probe = bool(self.threads.probing)
        single = self.threads.single_for_step()
        if single:
            torch.set_num_threads(1)
        self._step_count = 1  # the decode path that runs sets it and the kind
        start = time.perf_counter()
        try:
            yield
        finally:
            seconds = (time.perf_counter() - start) / self._step_count
            self.threads.after_step(seconds, self._step_kind, self._step_count)
            if single:
                torch.set_num_threads(many)

    def _isolated(self, run, reqs: list[Request]) -> list[StepOutput]:
        """``run(reqs)``; if it raises, each request alone, failing only those that still raise. A run that raised
        before its sync committed nothing (lengths and outputs change only after it), so re-running is safe; one that
        raised while committing (``_apply``) may have finished some requests, which return their blocks: those are
        reported finished, never re-run (another request's blocks would take their writes)."""
        if not reqs:
            return []
        try:
            return run(reqs)
        except Exception as error:
            if len(reqs) == 1:
                return [self._fail(reqs[0], error)]
            self.stats["num_retried_steps"] += 1
            log.warning("a step of %d requests raised (%r); running each alone", len(reqs), error)
        outputs = []
        for req in reqs:
            if req.finished:
                outputs.append(StepOutput(req, [], True))
                continue
            try:
                outputs += run([req])
            except Exception as error:
                outputs.append(self._fail(req, error))
        return outputs

    def _fail(self, req: Request, error: Exception) -> StepOutput:
        req.error = f"{type(error).__name__}: {error}"
        self.stats["num_errors"] += 1
        self._finish(req, "error")
        return StepOutput(req, [], True)

    def _prefill(self, reqs: list[Request]) -> list[StepOutput]:
        """One prompt chunk per row (``StepRunner.prefill``), committed only now: a failed chunk runs again
        (``_isolated``)."""
        eager = self.scheduler.draft_follows_prefill
        chunk = self.runner.prefill(reqs, room=self.max_model_len + self.max_tree_nodes(), draft=eager)
        now, block_size = time.perf_counter(), self.allocator.block_size
        for r, n, scored in zip(reqs, chunk.counts, chunk.prompt_logprobs):
            r.prompt_logprobs += scored
            r.cache_seqlen += n
            if eager:
                r.draft_len = r.cache_seqlen
            # its full blocks of prompt K/V are final: later requests may take them (prefix caching), this one's
            # still running
            self.allocator.cache(r.blocks, r.block_keys[: r.cache_seqlen // block_size])
            if not r.prefilling and r.metrics.decode_start is None:  # (not again after a preemption)
                r.metrics.decode_start = now
        return []

    @torch.inference_mode()
    def _decode(self, reqs: list[Request]) -> list[StepOutput]:
        for r in reqs:  # a one-token prompt has no prefill: its generation starts with its first decode step
            if r.metrics.decode_start is None:
                r.metrics.decode_start = time.perf_counter()
        gammas = self.choose_gammas(reqs)
        drafts = self._draft_plan(reqs, gammas)
        gammas, suffix_rows = drafts.gammas, drafts.suffix_rows
        # the step's shape for the thread tuner, whose costs compare within one: its depth, tree width (tree="auto"
        # runs chains and trees of one depth), suffix trees' size to a power of two, and whether a prompt caught up
        lag = any(gamma and self._cache_lag(r) > 1 for r, gamma in zip(reqs, gammas))
        width = self.controller.width if self.controller is not None else 0
        self._step_kind = (max(gammas), width, max(drafts.nodes or [1]).bit_length(), lag)
        # steps per native call: none while a request waits for a slot (it is admitted at the next step). A plain
        # call runs a full chain; the controller's plain probe between drafted steps as many as measure the rate
        # drafting must beat (AdaptiveController.plain_probe_steps: a full chain on a small model, a few steps on a
        # large one). An unsure controller (a new request's first drafts) re-decides every few steps and at a
        # rejection: a perfect draft's first choice (depth 1, on the recent requests' rate) would otherwise run a
        # whole call at depth 1.
        cfg, drafted = self.config, max(gammas) > 0
        unsure = drafted and self.controller is not None and self.controller.unsure(reqs)
        full_steps = cfg.spec_chain_steps if drafted else cfg.plain_chain
        max_steps = 0 if self.waiting or (not drafted and cfg.plain_chain < 2) else \
            cfg.unsure_chain_steps if unsure else full_steps  # fmt: skip
        if not drafted and self.controller is not None and self.controller.plain_probe:
            max_steps = min(max_steps, self.controller.plain_probe_steps(len(reqs)))
        if self._thread_probe:  # the thread tuner's probe of the other thread count: a probe's steps, not a chain's
            max_steps = min(max_steps, self.threads.probe_call_steps())
        max_steps = self.scheduler.steps_that_fit(reqs, max(gammas), max_steps)  # (where blocks ran short)
        logprobs = max((r.params.logprobs for r in reqs if r.params.logprobs is not None), default=None)
        plan = self.runner.plan(reqs, gammas, suffix_rows, max_steps=max_steps, full_steps=full_steps,
                                stop_on_reject=unsure, native_verify=cfg.native_tree_step, logprobs=logprobs,
                                width=width)  # fmt: skip
        result = self.runner.run(reqs, plan, gammas, suffix_rows, self._stop_tensor(reqs))
        self.plan_history.append(replace(result.plan, steps_ran=len(result.gammas)))
        if result.plan.path == REGULAR:
            self.stats["num_regular_steps"] += 1
        if drafts.expected is not None:
            self._observe_scores(reqs, drafts, result)
        return self._apply(reqs, result)

    @staticmethod
    def _observe_scores(reqs: list[Request], drafts: DraftPlan, result: StepResult) -> None:
        """Each row drafted with a suffix speculation (a hybrid's suffix rows; every drafted row of a suffix
        drafter) tells its request's score trust what the speculation kept: its raw score (the plan's expected
        tokens, which the drafter scaled by the trust) against the drafts accepted (such steps are regular: one)."""
        for b, req in enumerate(reqs):
            sure = drafts.sure is not None and drafts.sure[b]  # (a grammar's forced chain: no suffix match)
            if drafts.suffix_rows is not None and drafts.suffix_rows[b] and drafts.expected[b] > 0 and not sure:
                req.score_trust.observe(drafts.expected[b] / req.score_trust.value, result.counts[0][b] - 1)

    def _draft_plan(self, reqs: list[Request], gammas: list[int]) -> DraftPlan:
        """The drafter's revision of the step's depths (``Drafter.plan``: a suffix drafter drops the rows nothing
        matches, a hybrid picks suffix or model per row), given the controller's expected accepted drafted tokens
        of the model drafter at each row's depth."""
        if self.drafter is None or not self.drafter.plans:
            return DraftPlan(gammas)
        gains = faster = None
        c = self.controller
        if c is not None:
            gains = [c.expected_accepted(r, gamma) for r, gamma in zip(reqs, gammas)]
            if len(reqs) == 1 and c.target_cost.num_observed and c.draft_cost.num_observed:  # (steps priced)
                model_rate = c.row_rate(reqs[0], 1, gammas[0])

                def faster(b: int, nodes: int, tokens: float) -> bool:
                    return tokens / max(c.target_time(nodes), 1e-9) > model_rate

        plan = self.drafter.plan([r.view() for r in reqs], gammas, gains, faster)
        if self.controller is None or plan.nodes is None:
            return plan
        return priced_plan(plan, lambda width, tokens: self.controller.step_pays(width, tokens, len(reqs)))

    def choose_gammas(self, reqs: list[Request]) -> list[int]:
        """Tree depth per row this step: fixed, or the adaptive controller's choice (0 = not drafted)."""
        if self.controller is not None:
            return self.controller.choose(reqs)
        # a row's last tokens: drafts past max_tokens would be thrown away, and a step that no longer fits a full
        # chain took the regular (Python) step, a visible share of a 64-token request (bench/RESULTS-log.md,
        # "Figures moved out of code comments (2026-11-25)"); undrafted, it is a plain one
        return [min(self.gamma, r.tokens_left - 1) for r in reqs]

    def _apply(self, reqs: list[Request], result: StepResult) -> list[StepOutput]:
        """Commit a decode call (``StepResult``) once: each row's tokens, cut at its stop token or max_tokens (the
        steps after that are not its own), its lengths, the metrics and the controller's evidence."""
        now, S = time.perf_counter(), len(result.counts)
        live: list[list[int]] = [[] for _ in range(S)]  # per step: the rows still running at its start
        follows = self.drafter is None or not self.drafter.keeps_cache  # no cache of its own: it follows L_b
        outputs = []
        for b, req in enumerate(reqs):
            counts = [step[b] for step in result.counts]
            new, stopped = req.cut_at_stop(result.tokens[b], self.detokenize)
            kept, emitted = 1, counts[0]  # the steps whose tokens the row keeps (its first, at least)
            while kept < S and emitted < len(new):
                emitted += counts[kept]
                kept += 1
            req.append(new, result.logprobs[b][: len(new)] if result.logprobs is not None else None)
            req.cache_seqlen += emitted
            if follows:
                req.draft_len = req.cache_seqlen
            elif result.draft_lens is not None:
                req.draft_len = result.draft_lens[b]
            m = req.metrics
            for s in range(kept):
                gamma, n = result.gammas[s][b], counts[s]
                live[s].append(b)
                m.num_steps += 1
                m.num_drafted += gamma
                m.num_accepted += n - 1
                m.accepted_hist.extend([0] * (n - len(m.accepted_hist)))
                m.accepted_hist[n - 1] += 1
                m.gamma_hist.extend([0] * (gamma + 1 - len(m.gamma_hist)))
                m.gamma_hist[gamma] += 1
                self.gamma_hist[gamma] += 1
                self.accepted_hist[n - 1] += 1
                self.stats["num_drafted"] += gamma
                self.stats["num_accepted"] += n - 1
            self.stats["num_steps"] += kept
            self.stats["num_generated"] += len(new)
            if m.first_token_time is None:
                m.first_token_time = now
            if stopped:  # (finished once its tokens are in: the drafter's last look at the request sees them)
                self._finish(req, "stop")
            elif req.finish_reason is None and len(req.output_token_ids) >= req.params.max_tokens:
                self._finish(req, "length")
            outputs.append(StepOutput(req, new, req.finished))
        ran = sum(1 for rows in live if rows)
        self._step_count = ran
        self.gamma_history.extend(max(result.gammas[s]) for s in range(ran))
        if self.controller is not None:
            timed = not self._thread_probe
            costs = result.times[:ran]
            if result.full_steps:  # a native call: its own work spread as a full call spreads it
                costs = chain_step_costs(costs, time.perf_counter() - result.start, result.full_steps)
            learned = result.learned or result.gammas
            widths = result.widths or [None] * ran
            if not any(map(any, result.gammas[:ran])):  # plain steps, priced alike: observed in one call
                B = len(reqs)
                self.controller.observe(reqs, [0] * B, [1] * B, *costs[0], steps=ran, timed=timed)
            else:
                for s in range(ran):
                    rows = live[s]
                    ranks = [result.ranks[s][b] for b in rows] if result.ranks is not None else None
                    self.controller.observe([reqs[b] for b in rows], [learned[s][b] for b in rows],
                                            [result.counts[s][b] for b in rows], *costs[s], timed=timed,
                                            width=widths[s], ranks=ranks)  # fmt: skip
        return outputs

    def _stop_tensor(self, reqs: list[Request]) -> torch.Tensor:
        """int64 [S]: every stop id of the rows that the model can emit (a native chain ends at any of them)."""
        stops = {t for r in reqs for t in r.stop_ids if 0 <= t < self.vocab_size}
        return torch.tensor(sorted(stops), dtype=torch.int64)
