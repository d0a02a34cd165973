"""The engine: a scheduler around one speculative step (the loop of docs/ARCHITECTURE.md).

Each ``Engine.step()``:
1. admits waiting requests while batch slots and KV blocks allow (a request reserves every block it can need);
2. runs one prefill chunk for the requests still reading their prompt (so a long prompt never stalls decoding);
3. runs one decode call for every decoding request: the regular step (draft, target forward over the tree,
   verify, compact; ``_spec_step``) or a native call of several such steps (a plain or a spec chain); each returns
   a ``StepResult`` that ``_apply`` commits (tokens, lengths, metrics, the adaptive controller's evidence);
4. retires finished requests at once, returning their blocks.

A request's own state and its per-slot rows live in spec_engine/request.py.

A request's prompt is prefilled except its last token, which becomes the first root: the first speculative step
then produces the first output tokens, so prefill needs no logits and no sampling path of its own.
"""

from __future__ import annotations

import contextlib
import itertools
import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from spec_engine.adaptive import AdaptiveController
from spec_engine.drafters.base import Draft, Drafter, DraftPlan, StepBatch
from spec_engine.kv_cache import BlockAllocator, PagedKVCache
from spec_engine.models import Target
from spec_engine.request import Request, RequestRows, StepOutput
from spec_engine.sampling import SEED_MASK, SamplingParams
from spec_engine.threads import ThreadTuner
from spec_engine.transfer import to_device
from spec_engine.tree import causal_mask
from spec_kernels import PAD_NODE, VerifyResult, verify_tree
from spec_kernels.decoder_layers import NativeHead, NativeModel, greedy_steps, spec_chain
from spec_kernels.rng import mix_key

GAMMA_HISTORY_LEN = 4096  # steps of Engine.gamma_history kept
INT63_MASK = (1 << 63) - 1  # a request seed (any 64-bit int) as a non-negative int64 noise seed


@dataclass(frozen=True)
class EngineConfig:
    """The engine's knobs. The defaults are the engine's own choice; tests and benchmarks pass others
    (``LLM(..., engine_config=EngineConfig(plain_chain=1))``) instead of patching module globals.

    plain_chain : plain greedy steps per native chain (``Engine._plain_chain_len``); 1 turns chains off.
    spec_chain_steps : greedy speculative steps per native call (``Engine._spec_chain_steps``); 0 turns it off.
    unsure_chain_steps : the same while the adaptive controller is unsure of a row (``AdaptiveController.unsure``).
    """

    plain_chain: int = 16
    spec_chain_steps: int = 16
    unsure_chain_steps: int = 4


def chain_step_costs(times: list[list[float]], wall: float, steps: int) -> list[tuple[float, float]]:
    """(draft, whole step) seconds of each step a native call ran, as the adaptive controller prices them: ``times``
    the call's native [draft, step] seconds per step run, ``wall`` the call's wall time, ``steps`` the steps of a
    full call (``EngineConfig.spec_chain_steps``; ``plain_chain`` for plain chains).

    Each step carries a share of the call's own work (inputs, dispatch, committing) as a full call would spread it:
    the controller compares drafting and plain decoding as they run when it commits to one (16-step speculative
    calls, 16-step plain chains). Charged to the steps run instead, the short calls of exploring priced both wrong: a
    one-step probe call (its Python comparable to the step itself) made drafting look 1.6x a plain token where full
    calls cost ~1.2x, and the 4-step plain probe chains between drafted steps (~1.8x a full chain's cost per token)
    made drafts at alpha 0.45 look 1.5x faster than plain decoding at depth 2."""
    share = max(wall - sum(t[1] for t in times), 0.0) / max(steps, 1)
    return [(t[0], t[1] + share) for t in times]


def priced_plan(plan: DraftPlan, pays: Callable[[int, float], bool]) -> DraftPlan:
    """A plan whose trees the drafter sized (``DraftPlan.nodes``), cut until its step pays: the step runs every row
    padded to the widest tree (B * T tokens), so the widest rows go undrafted (the least promising first among
    equals) until ``pays(B * T, tokens expected)`` holds or no row is drafted."""
    B, dropped = len(plan.gammas), set()
    drafted = {b for b, g in enumerate(plan.gammas) if g}
    while drafted - dropped:
        rows = drafted - dropped
        T = max(plan.nodes[b] for b in rows)
        if pays(B * T, B + sum(plan.expected[b] for b in rows)):
            break
        dropped.add(max(rows, key=lambda b: (plan.nodes[b], -plan.expected[b])))
    return plan.without(dropped) if dropped else plan


@dataclass
class StepResult:
    """What one decode call did, for ``Engine._apply`` to commit once: the regular step (one step), a plain chain
    (K one-token steps in one native call) or a spec chain (several drafted steps in one native call).

    Per step s the call ran: ``gammas[s]`` [B] each row's depth (0: undrafted), ``tokens[s]`` [B][n] the tokens each
    row emitted (its accepted path and the recovered or bonus token), ``times[s]`` (draft seconds, whole step
    seconds) as measured. ``draft_lens`` [B]: the drafter caches' lengths after the call (what ``Drafter.commit``
    returns; None: unchanged). A native call's own work (inputs, dispatch, committing) is spread over
    ``full_steps`` steps from ``start`` (``chain_step_costs``; 0: the times are final). ``learned`` [S][B]: the depths
    the controller learns acceptance from (None: ``gammas``; a hybrid's suffix rows say nothing of its model
    drafter), ``timed``: whether the costs price step shapes the controller models.
    """

    gammas: list[list[int]]
    tokens: list[list[list[int]]]
    times: list[list[float]]
    draft_lens: list[int] | None = None
    start: float = 0.0
    full_steps: int = 0
    learned: list[list[int]] | None = None
    timed: bool = True


def _native(model, cache: PagedKVCache | None) -> NativeModel | NativeHead | None:
    """``model``'s native handle where its cache is in the handle's dtype, else None."""
    native = getattr(model, "native", None)
    return native if native is not None and cache is not None and cache.data.dtype == native.dtype else None


class Engine:
    """Runs requests to completion on a target model, optionally speculating with ``drafter``.

    ``num_speculative_tokens`` is the tree depth: fixed, or with ``adaptive=True`` the deepest the controller
    (spec_engine/adaptive.py) may choose per row and step, 0 included.

    Device-true: every tensor a step computes on lives on the target's device; the host keeps the bookkeeping
    (lengths, blocks, parameters, token histories) in Python and numpy, sends each step's inputs in one copy per
    dtype, and reads one thing back per step: the emitted tokens (``_read_step``).
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
    ):
        if getattr(target, "vocab_map", None) is not None:
            raise ValueError("the target's vocabulary cannot be restricted (restrict_vocab is for drafts): its logits "
                             "are the output")  # fmt: skip
        self.target, self.kv, self.allocator, self.drafter = target, kv, allocator, drafter
        self.config = config or EngineConfig()  # replaceable between generate calls: a step reads it as it starts
        self.device = kv.data.device
        self.gamma = num_speculative_tokens if drafter is not None else 0
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.prefill_chunk = prefill_chunk
        self.eos_token_ids = set(eos_token_ids or [])
        self.vocab_size = target.config.vocab_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.rows = RequestRows(max_num_seqs, allocator.blocks_for(max_model_len + self.max_tree_nodes()))
        self._ids = itertools.count()
        self._keys = itertools.count()
        # num_regular_steps: decode steps taken by the regular (Python) step, not a native call
        self.stats = {"num_steps": 0, "num_drafted": 0, "num_accepted": 0, "num_generated": 0, "num_errors": 0,
                      "num_regular_steps": 0}  # fmt: skip
        deepest = max(self.gamma, drafter.max_depth if drafter is not None else 0)  # (a hybrid's suffix rows)
        self.accepted_hist = [0] * (deepest + 1)
        self.gamma_history: deque[int] = deque(maxlen=GAMMA_HISTORY_LEN)  # per decode step: the deepest row's depth
        self.gamma_hist = [0] * (deepest + 1)  # [g] = rows drafted at depth g, over all steps
        self.step_times = (0.0, 0.0)  # the last speculative step's (draft, whole step) seconds
        self.threads = ThreadTuner() if self.device.type == "cpu" else None  # CPU threads per decode step
        self._step_count = 1  # steps the current decode call ran (a native chain runs several)
        self._step_kind: tuple[int, bool] = (0, False)  # its depth, and whether a draft caught up: the tuner's kind
        # the native step ops (several greedy steps in one C++ call), decided once: the models' handles where their
        # caches are in their dtype (a CPU model in float32 or bfloat16: spec_kernels.decoder_layers.native_model)
        self.native_target = _native(target, kv)
        self.native_draft = _native(drafter, drafter.kv) if drafter is not None else None
        self.controller = None
        if adaptive and drafter is not None:
            tree = drafter.tree
            self.controller = AdaptiveController(self.gamma, drafter.nodes_for_depth,
                                                 tree=tree is not None and not tree.is_chain,
                                                 cache_lag=self._cache_lag)  # fmt: skip

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
        }

    # --- requests --------------------------------------------------------------------------------------------

    def max_tree_nodes(self) -> int:
        if self.drafter is None:
            return 1
        return max(self.drafter.nodes_for_depth(self.gamma), self.drafter.max_nodes)

    def tokens_to_reserve(self, req: Request) -> int:
        # the tree of the last step can run past max_tokens; its K/V still need rows
        return len(req.prompt_token_ids) + req.params.max_tokens + self.max_tree_nodes()

    def _cache_lag(self, req: Request) -> int:
        return req.num_computed - req.draft_len if self.drafter is not None and self.drafter.keeps_cache else 0

    def check_request(self, ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError for a request that can never run; nothing is queued."""
        params.validate()
        if not ids:
            raise ValueError("the prompt is empty: give at least one token")
        if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size for t in ids):
            raise ValueError(f"prompt token ids must be ints in [0, {self.vocab_size})")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds max_model_len "
                f"({self.max_model_len})"
            )
        if (
            self.allocator.blocks_for(len(ids) + params.max_tokens + self.max_tree_nodes())
            > self.allocator.num_blocks - 1
        ):
            raise ValueError("this request needs more KV blocks than the whole cache holds; raise the KV budget")

    def add_request(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> Request:
        ids = list(prompt_token_ids)
        self.check_request(ids, params)
        seed = params.seed if params.seed is not None else random.getrandbits(62)
        req = Request(request_id or str(next(self._ids)), ids, params, seed, key=next(self._keys))
        req.metrics.arrival_time = time.perf_counter()
        self.waiting.append(req)
        return req

    def abort(self, request_id: str) -> None:
        for req in list(self.waiting):
            if req.request_id == request_id:
                self.waiting.remove(req)
                req.finish_reason = "abort"
        for req in self.running:
            if req.request_id == request_id:
                self._finish(req, "abort")
        self.running = [r for r in self.running if not r.finished]

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if not self.allocator.can_allocate(self.tokens_to_reserve(req)):
                break  # first come, first served: it waits for blocks to return
            req.blocks = self.allocator.allocate(self.tokens_to_reserve(req))
            req.slot = self.rows.admit(req)
            self.running.append(self.waiting.popleft())

    def _finish(self, req: Request, reason: str) -> None:
        req.finish_reason = reason
        req.metrics.finish_time = time.perf_counter()
        self.allocator.free(req.blocks)
        req.blocks = []
        if req.slot >= 0:
            self.rows.release(req.slot)
            req.slot = -1
        if self.drafter is not None:
            self.drafter.finish_request(req.key)

    # --- one engine iteration --------------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        """One iteration: admit, one prefill chunk, one speculative step. A request whose rows make the step fail
        is found by re-running the rows one at a time and finished with reason "error"; the others go on."""
        self._admit()
        outputs = self._isolated(self._prefill, [r for r in self.running if r.prefilling])
        decoding = [r for r in self.running if not r.prefilling]
        with self._decode_threads(bool(decoding)):
            outputs += self._isolated(self._decode, decoding)
        self.running = [r for r in self.running if not r.finished]
        return outputs

    @contextlib.contextmanager
    def _decode_threads(self, active: bool):
        """The decode part of a step on the CPU threads ``self.threads`` chooses (all, or one when other work keeps
        the cores busy; spec_engine/threads.py), timed for it; the caller's thread count is restored after."""
        many = torch.get_num_threads()
        if self.threads is None or not active or many == 1:
            yield
            return
        single = self.threads.single_for_step()
        if single:
            torch.set_num_threads(1)
        self._step_count = 1  # the decode path that runs sets it and the kind
        start = time.perf_counter()
        try:
            yield
        finally:
            self.threads.after_step((time.perf_counter() - start) / self._step_count, self._step_kind)
            if single:
                torch.set_num_threads(many)

    def _isolated(self, run, reqs: list[Request]) -> list[StepOutput]:
        """``run(reqs)``; if it raises, each request alone, failing only those that still raise. A failed run has
        committed nothing (lengths and outputs change only after the step's one sync), so re-running is safe."""
        if not reqs:
            return []
        try:
            return run(reqs)
        except Exception as error:
            if len(reqs) == 1:
                return [self._fail(reqs[0], error)]
        outputs = []
        for req in reqs:
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

    def _block_table(self, reqs: list[Request], max_pos: int) -> torch.Tensor:
        """[B, W] int32 host rows covering positions < max_pos (padding is the scratch block)."""
        width = min(-(-max_pos // self.allocator.block_size), self.rows.block_table.shape[1])
        return self.rows.block_table[[r.slot for r in reqs], :width]

    @torch.inference_mode()
    def _prefill(self, reqs: list[Request]) -> list[StepOutput]:
        counts = [min(len(r.prompt_token_ids) - 1 - r.num_computed, self.prefill_chunk) for r in reqs]
        T = max(counts)
        tokens = np.zeros((len(reqs), T), dtype=np.int64)  # [B, T], ragged rows padded at the end
        for b, (r, n) in enumerate(zip(reqs, counts)):
            tokens[b, :n] = r.history[r.num_computed : r.num_computed + n]
        starts = [r.num_computed for r in reqs]
        seqlens_h = torch.tensor(starts, dtype=torch.int32)  # [B]
        tokens, seqlens, table = to_device(
            self.device, torch.from_numpy(tokens), seqlens_h, self._block_table(reqs, max(starts) + T)
        )
        positions = seqlens.long()[:, None] + torch.arange(T, device=self.device)  # [B, T]
        mask = causal_mask(len(reqs), T, self.device)
        _, features = self._target_pass(tokens, positions, self.kv.data, seqlens, mask, table)
        # With a fixed depth every request is drafted: the drafter sees the prompt now. The adaptive controller may
        # never draft a request (batch 16 on CPU, a useless draft), so there the draft cache is filled by catch-up
        # when it first does, a cost the controller weighs against the evidence; a drafter that reads the target's
        # features keeps them now (they exist only in this pass) and runs on them at that catch-up.
        eager = self.drafter is not None and self.drafter.keeps_cache and self.controller is None
        if eager:
            self.drafter.prefill(tokens, positions, seqlens, mask, table, features)
        elif features is not None:
            self.drafter.store_features(positions, table, features)
        now = time.perf_counter()
        for r, n in zip(reqs, counts):
            r.num_computed += n
            if eager:
                r.draft_len = r.num_computed
            if not r.prefilling:
                r.metrics.decode_start = now
        return []

    @torch.inference_mode()
    def _decode(self, reqs: list[Request]) -> list[StepOutput]:
        for r in reqs:  # a one-token prompt has no prefill: its generation starts with its first decode step
            if r.metrics.decode_start is None:
                r.metrics.decode_start = time.perf_counter()
        gammas = self.choose_gammas(reqs)
        plan = self._plan(reqs, gammas)
        gammas, suffix_rows = plan.gammas, plan.suffix_rows
        # the step's shape for the thread tuner: costs compare within a depth, a prompt's catch-up apart
        self._step_kind = (max(gammas), any(g and self._cache_lag(r) > 1 for r, g in zip(reqs, gammas)))
        # several steps in one native call where possible (None: the regular step below)
        if max(gammas) == 0:
            # (the controller's plain probe between drafted steps too runs a full chain: the rate it measures is the
            # one drafting must beat, and 4-step probe chains right after drafted steps cost ~1.35x a full chain's
            # steps in bfloat16 on a 2-core AVX2 CPU, which kept drafts at alpha ~0.45 drafted at ~0.85x plain
            # decoding's speed)
            chain = self._plain_chain_len(reqs)
            result = self._plain_chain(reqs, chain) if chain else None
        else:
            steps = self._spec_chain_steps(reqs, gammas) if not any(suffix_rows or ()) else 0
            result = self._spec_chain(reqs, gammas[0], steps) if steps else None
        if result is None:
            self.stats["num_regular_steps"] += 1
            result = self._regular_step(reqs, gammas, suffix_rows)
        return self._apply(reqs, result)

    def _regular_step(self, reqs: list[Request], gammas: list[int], suffix_rows: list[bool] | None) -> StepResult:
        """One step in Python: ``_spec_step`` on the step's inputs."""
        batch, sampling = self._step_inputs(reqs, gammas, suffix_rows)
        out_tokens, num_accepted, draft_lens = self._spec_step(batch, sampling)
        # a hybrid's suffix rows teach the controller nothing of the model drafter it prices
        learned = gammas if suffix_rows is None else [0 if s else g for g, s in zip(gammas, suffix_rows)]
        return StepResult([gammas], [[t[:n] for t, n in zip(out_tokens, num_accepted)]], [list(self.step_times)],
                          draft_lens, learned=[learned], timed=not any(suffix_rows or ()))  # fmt: skip

    def _plan(self, reqs: list[Request], gammas: list[int]) -> DraftPlan:
        """The drafter's revision of the step's depths (``Drafter.plan``: a suffix drafter drops the rows nothing
        matches, a hybrid picks suffix or model per row), given the controller's expected accepted drafted tokens
        of the model drafter at each row's depth."""
        if self.drafter is None or not self.drafter.plans:
            return DraftPlan(gammas)
        gains = None
        if self.controller is not None:
            gains = [self.controller.expected_accepted(r, g) for r, g in zip(reqs, gammas)]
        plan = self.drafter.plan([r.view() for r in reqs], gammas, gains)
        if self.controller is None or plan.nodes is None:
            return plan
        return priced_plan(plan, lambda width, tokens: self.controller.step_pays(width, tokens, len(reqs)))

    def _plain_chain_len(self, reqs: list[Request]) -> int:
        """Tokens per row the coming plain greedy step decodes in one native chain (0: the regular one-token step).

        Multi-step decoding (vLLM's ``num_scheduler_steps``): with no drafter or none this step (the adaptive
        controller drafts no row; a drafter that reads the target's features must see every step, so never with
        one of those), all rows greedy and nothing waiting for a slot, the target runs up to ``config.plain_chain``
        forwards in one C++ call (``greedy_steps``), so the step's Python and dispatch, comparable to a small
        model's whole forward, is paid once per chain (longer chains decode faster, with diminishing returns:
        bench/RESULTS.md). Same forwards, same kernels, same tokens (tests/test_native_steps.py); the call ends at a
        row's stop token, so a long chain wastes no forward at a request's end; output arrives up to
        ``plain_chain`` tokens at a time, and a new request waits at most one chain before it is admitted. A chain
        of one (a row's last token) still saves the regular step's Python."""
        if self.config.plain_chain < 2 or (self.drafter is not None and self.drafter.needs_hidden) or self.waiting:
            return 0
        if self.native_target is None or not all(r.params.greedy for r in reqs):
            return 0
        cap = self.drafter.plain_chain_cap if self.drafter is not None else None
        return min(self.config.plain_chain, cap or self.config.plain_chain, min(r.tokens_left for r in reqs))

    def _plain_chain(self, reqs: list[Request], K: int) -> StepResult | None:
        """``K`` plain greedy steps for every row in one native call (``greedy_steps``: the roots at L_b, then
        tokens 1 .. K-1 at L_b + 1 .. L_b + K - 1, their K/V written there, as K one-token steps would), or fewer:
        the call ends at the first token that is a stop token of some row, so a chain spends no forward past a
        request's end. None, with nothing committed, where some row's logits are not finite (the regular step then
        decodes it and sanitises or raises)."""
        start = time.perf_counter()
        lengths = [r.num_computed for r in reqs]
        seqlens = torch.tensor(lengths, dtype=torch.int32)  # [B]: the roots' positions L_b
        roots = torch.tensor([r.last_token for r in reqs], dtype=torch.int64)  # [B]
        table = self._block_table(reqs, max(lengths) + K)  # [B, W]: up to position L_b + K - 1
        stops = self._stop_tensor(reqs)  # [S]
        forwards = time.perf_counter()
        tokens = greedy_steps(
            roots, self.native_target, self.kv.data, seqlens, steps=K, block_table=table, stop_ids=stops
        )  # [B, K' <= K]
        forwards = time.perf_counter() - forwards
        if bool((tokens < 0).any()):
            return None
        K = tokens.shape[1]  # (the call ended at a row's stop token: the rows that go on continue next step)
        rows = tokens.T.tolist()  # [K][B]
        return StepResult([[0] * len(reqs)] * K, [[[t] for t in row] for row in rows], [[0.0, forwards / K]] * K,
                          start=start, full_steps=self.config.plain_chain)  # fmt: skip

    def _spec_chain_steps(self, reqs: list[Request], gammas: list[int]) -> int:
        """Greedy speculative steps the coming step runs in one native call (0: the regular step).

        Where a draft model proposes chains for greedy rows, all at one depth g, with nothing waiting and the draft
        caches' lags (their catch-up: a prompt and the tokens decoded before a row's first drafted step, under the
        adaptive controller) at most a prefill chunk and within g of each other, the whole step (catch-up, chain,
        target pass, acceptance) is C++ (``spec_chain``), and up to ``config.spec_chain_steps`` of them run per
        call while every row has g + 1 tokens of its max_tokens left (the C++ checks before each step). The call's
        Python (inputs and committing, comparable to a whole step of the default pair) is paid once per call; the
        adaptive controller chooses g for the call and learns from each step."""
        g = gammas[0] if gammas else 0
        if g == 0 or self.config.spec_chain_steps < 1 or self.waiting:
            return 0
        if self.native_target is None or self.native_draft is None:
            return 0
        if any(x != g for x in gammas) or not all(r.params.greedy for r in reqs):
            return 0
        lags = [self._cache_lag(r) for r in reqs]
        if max(lags) > self.prefill_chunk or max(lags) - min(lags) > g:
            return 0  # (a ragged catch-up pads rows past their roots: at most g slots, which the step overwrites)
        # steps run while every row has g + 1 tokens of budget left (spec_chain checks before each): a call near the
        # end of a request is not cut to the steps that fit at full acceptance, which split a 64-token request's
        # last ~15 tokens over 3-4 calls, each paying the call's Python
        if min(r.tokens_left for r in reqs) < g + 1:
            return 0
        # an unsure controller (a new request's first drafts) re-decides every few steps: at one 16-step call per
        # choice, a perfect draft's first choice (depth 1, on the recent requests' rate) ran 16 steps at depth 1
        unsure = self.controller is not None and self.controller.unsure(reqs)
        return self.config.unsure_chain_steps if unsure else self.config.spec_chain_steps

    def _spec_chain(self, reqs: list[Request], g: int, max_steps: int) -> StepResult | None:
        """Up to ``max_steps`` greedy speculative steps at depth ``g`` in one ``spec_chain`` call, as a
        ``StepResult`` (``_apply`` commits it as it commits the regular step's). None, with nothing committed, where
        the first step's target logits were not finite."""
        start = time.perf_counter()
        B = len(reqs)
        lags = [self._cache_lag(r) for r in reqs]
        pending = np.zeros((B, max(lags) + 1), dtype=np.int64)  # [B, P]: each draft cache's gap, then the root
        for b, (r, lag) in enumerate(zip(reqs, lags)):
            pending[b, : lag + 1] = r.history[r.num_tokens - 1 - lag : r.num_tokens]
        lengths = [r.num_computed for r in reqs]
        reach = min(max_steps * (g + 1), max(r.tokens_left for r in reqs))  # positions a row may write past L_b
        table = self._block_table(reqs, max(lengths) + reach + 2)  # [B, W]
        result = spec_chain(
            self.native_target, self.native_draft, torch.from_numpy(pending),
            torch.tensor([lag + 1 for lag in lags]), torch.tensor(lengths), self.kv.data, self.drafter.kv.data, table,
            torch.tensor([r.tokens_left for r in reqs]),
            self._stop_tensor(reqs), gamma=g, max_steps=max_steps,
            stop_on_reject=self.controller is not None and self.controller.unsure(reqs),
            draft_features=self.drafter.features,
        )  # fmt: skip
        steps, _, gap_lens, times = result  # [B, S, g + 2], [B, 2], [B], [S, 2]
        steps, gap_lens, times = steps.tolist(), gap_lens.tolist(), times.tolist()
        ran = next((s for s in range(max_steps) if steps[0][s][0] == 0), max_steps)  # every row runs every step
        if ran == 0:
            return None  # the first step's target logits were not finite: the regular step decodes it
        tokens = [[steps[b][s][1 : 1 + steps[b][s][0]] for b in range(B)] for s in range(ran)]  # [S][B][n]
        # the draft cache lags by its gap (the pending tokens before the root) behind the rows' new L_b
        draft_lens = [r.num_computed + sum(len(t[b]) for t in tokens) - (n - 1) for b, (r, n) in
                      enumerate(zip(reqs, gap_lens))]  # fmt: skip
        return StepResult([[g] * B] * ran, tokens, times[:ran], draft_lens, start=start,
                          full_steps=self.config.spec_chain_steps)  # fmt: skip

    def choose_gammas(self, reqs: list[Request]) -> list[int]:
        """Tree depth per row this step: fixed, or the adaptive controller's choice (0 = not drafted)."""
        if self.controller is not None:
            return self.controller.choose(reqs)
        # a row's last tokens: drafts past max_tokens would be thrown away, and a step that no longer fits a full
        # chain took the regular (Python) step, ~5% of a 64-token request; undrafted, it is a plain one
        return [min(self.gamma, r.tokens_left - 1) for r in reqs]

    def _step_inputs(self, reqs: list[Request], gammas: list[int],
                     suffix_rows: list[bool] | None = None) -> tuple[StepBatch, dict]:  # fmt: skip
        """The step's inputs, gathered from the host rows and sent to the device together."""
        # the drafter runs on the drafted rows only; an undrafted row's lag (its whole prompt, under the adaptive
        # controller) must not widen every plain step's block table
        lag = max((self._cache_lag(r) for r, g in zip(reqs, gammas) if g), default=0)
        lengths = [r.num_computed for r in reqs]
        slots = [r.slot for r in reqs]
        # per-row seeds from (request seed, position): a request samples the same alone or in any batch
        seeds = [(r.seed * 1_000_003 + L) & SEED_MASK for r, L in zip(reqs, lengths)]
        host = {
            "seqlens": torch.tensor(lengths, dtype=torch.int32),  # [B]
            "roots": torch.tensor([r.last_token for r in reqs], dtype=torch.int64),  # [B]
            "block_table": self._block_table(reqs, max(lengths) + self.max_tree_nodes() + lag + 1),  # [B, W]
            "temperature": self.rows.temperature[slots],  # [B]
            "keys": torch.tensor([mix_key(s, 1) for s in seeds], dtype=torch.int64),  # [B]: the drafter's stream
        }
        if not all(r.params.greedy for r in reqs):
            host |= {
                "top_k": self.rows.top_k[slots],
                "top_p": self.rows.top_p[slots],
                "min_p": self.rows.min_p[slots],
                "seed": torch.tensor(seeds, dtype=torch.int64),
            }
        if any(r.params.coupled for r in reqs):
            host |= {
                "coupled": torch.tensor([r.params.coupled for r in reqs]),
                "noise_seeds": torch.tensor([r.seed & INT63_MASK for r in reqs], dtype=torch.int64),
            }
        dev = dict(zip(host, to_device(self.device, *host.values())))
        batch = StepBatch([r.view() for r in reqs], dev.pop("seqlens"), dev.pop("roots"), dev.pop("block_table"),
                          dev["temperature"], dev.pop("keys"), gammas, dev.pop("coupled", None),
                          dev.pop("noise_seeds", None), suffix_rows)  # fmt: skip
        return batch, dev

    def _spec_step(self, batch: StepBatch, sampling: dict) -> tuple[list[list[int]], list[int], list[int]]:
        """One speculative step over B rows: draft, verify the whole tree in one target pass, compact the caches.

        Returns the host's (emitted tokens [B][T], num_accepted [B], the draft cache's new lengths [B] where the
        drafter keeps a cache)."""
        start = time.perf_counter()
        rows = [b for b, g in enumerate(batch.gammas) if g > 0] if self.drafter is not None else []
        partial = 0 < len(rows) < batch.size  # some rows drafted, not all: the drafter runs on a sub-batch
        index = to_device(self.device, torch.tensor(rows, dtype=torch.int64))[0] if partial else None  # [B_d]
        draft = self._propose(batch, rows, index)  # tokens/parents [B, T], draft_probs [B, T, V] | None
        drafted = time.perf_counter()
        positions = batch.seqlens.long()[:, None] + draft.depths  # [B, T]: L_b + depth
        hidden, features = self._target_pass(draft.tokens, positions, self.kv.data, batch.seqlens, draft.tree_mask,
                                             batch.block_table)  # fmt: skip
        logits = self.target.logits(hidden)  # [B, T, V]
        if batch.coupled is not None:  # coupled rows: verify_tree samples argmax(z + g_t) in-kernel, walks greedily
            sampling = {**sampling, "noise_seeds": batch.noise_seeds, "positions": positions, "coupled": batch.coupled}
        result = verify_tree(
            logits,
            draft.tokens,
            draft.parents,
            draft_probs=draft.draft_probs,
            draft_sampling=draft.draft_sampling,
            **sampling,
        )
        if draft.tokens.shape[1] > 1:  # a lone root's path is itself: nothing to move
            self.kv.compact_(batch.seqlens, result.accepted_nodes, result.num_accepted, block_table=batch.block_table)
        out_tokens, num_accepted = self._read_step(result)  # the step's one host sync
        draft_lens = [r.draft_len for r in batch.rows]
        if features is not None:  # a drafter that reads the target's features keeps every row's, drafted or not
            draft_lens = self.drafter.commit(batch, result, num_accepted, features)
        elif rows:
            sub = batch.select(rows, index) if partial else batch
            sub_result = VerifyResult(*(x[index] for x in result)) if partial else result
            new_lens = self.drafter.commit(sub, sub_result, [num_accepted[b] for b in rows])
            for b, n in zip(rows, new_lens or []):
                draft_lens[b] = n
        self.step_times = (drafted - start, time.perf_counter() - start)
        return out_tokens, num_accepted, draft_lens

    def _target_pass(self, *args) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The target's forward (``LlamaForCausalLM.forward``'s arguments): its final hidden states [B, T, H] and,
        for a drafter that reads the target's features, those [B, T, F] from the same pass (else None)."""
        drafter = self.drafter
        if drafter is None or not drafter.needs_hidden:
            return self.target(*args), None
        if drafter.target_layers is None:
            hidden = self.target(*args)
            return hidden, hidden
        return self.target.forward_features(*args, layers=drafter.target_layers)

    @staticmethod
    def _read_step(result: VerifyResult) -> tuple[list[list[int]], list[int]]:
        """The step's one device -> host read: emitted tokens [B][T] and their counts [B], in one copy."""
        both = torch.cat([result.output_tokens, result.num_accepted[:, None]], dim=1).tolist()  # [B, T + 1]
        return [row[:-1] for row in both], [row[-1] for row in both]

    def _propose(self, batch: StepBatch, rows: list[int], index: torch.Tensor) -> Draft:
        """The drafter's trees for ``rows`` (depth > 0), run on those rows only; every other row is its root alone.

        ``index`` is ``rows`` on the device (None unless only some rows are drafted)."""
        if rows and len(rows) == batch.size:
            return self.drafter.propose(batch)
        B, dev = batch.size, self.device
        if not rows:
            return Draft(batch.roots[:, None], torch.full((B, 1), PAD_NODE, dtype=torch.int64, device=dev),
                         torch.ones(B, 1, 1, dtype=torch.bool, device=dev),
                         torch.zeros(B, 1, dtype=torch.int64, device=dev))  # fmt: skip
        sub = self.drafter.propose(batch.select(rows, index))  # [B_d, T]
        T = sub.tokens.shape[1]
        tokens = sub.tokens.new_zeros(B, T)  # [B, T]
        tokens[:, 0] = batch.roots
        tokens[index] = sub.tokens
        parents = torch.full((B, T), PAD_NODE, dtype=torch.int64, device=dev)  # undrafted rows: all padding
        parents[index] = sub.parents
        mask = torch.eye(T, dtype=torch.bool, device=dev).expand(B, T, T).clone()  # [B, T, T]: padding sees itself
        mask[index] = sub.tree_mask
        depths = torch.zeros(B, T, dtype=torch.int64, device=dev)
        depths[index] = sub.depths
        probs = None
        if sub.draft_probs is not None:
            probs = sub.draft_probs.new_zeros(B, T, sub.draft_probs.shape[-1])  # [B, T, V]
            probs[index] = sub.draft_probs
        return Draft(tokens, parents, mask, depths, probs, sub.draft_sampling)

    def _apply(self, reqs: list[Request], result: StepResult) -> list[StepOutput]:
        """Commit a decode call (``StepResult``) once: each row's tokens, cut at its stop token or max_tokens (the
        steps after that are not its own), its lengths, the metrics and the controller's evidence."""
        now, S = time.perf_counter(), len(result.tokens)
        live: list[list[int]] = [[] for _ in range(S)]  # per step: the rows still running at its start
        follows = self.drafter is None or not self.drafter.keeps_cache  # no cache of its own: it follows L_b
        outputs = []
        for b, req in enumerate(reqs):
            counts = [len(step[b]) for step in result.tokens]
            new = self._truncate(req, [t for step in result.tokens for t in step[b]])
            kept, emitted = 1, counts[0]  # the steps whose tokens the row keeps (its first, at least)
            while kept < S and emitted < len(new):
                emitted += counts[kept]
                kept += 1
            req.append(new)
            req.num_computed += emitted
            if follows:
                req.draft_len = req.num_computed
            elif result.draft_lens is not None:
                req.draft_len = result.draft_lens[b]
            m = req.metrics
            for s in range(kept):
                g, n = result.gammas[s][b], counts[s]
                live[s].append(b)
                m.num_steps += 1
                m.num_drafted += g
                m.num_accepted += n - 1
                m.accepted_hist.extend([0] * (n - len(m.accepted_hist)))
                m.accepted_hist[n - 1] += 1
                m.gamma_hist.extend([0] * (g + 1 - len(m.gamma_hist)))
                m.gamma_hist[g] += 1
                self.gamma_hist[g] += 1
                self.accepted_hist[n - 1] += 1
                self.stats["num_drafted"] += g
                self.stats["num_accepted"] += n - 1
            self.stats["num_steps"] += kept
            self.stats["num_generated"] += len(new)
            if m.first_token_time is None:
                m.first_token_time = now
            if req.finish_reason is None and len(req.output_token_ids) >= req.params.max_tokens:
                self._finish(req, "length")
            outputs.append(StepOutput(req, new, req.finished))
        ran = sum(1 for rows in live if rows)
        self._step_count = ran
        self.gamma_history.extend(max(result.gammas[s]) for s in range(ran))
        if self.controller is not None:
            costs = result.times[:ran]
            if result.full_steps:  # a native call: its own work spread as a full call spreads it
                costs = chain_step_costs(costs, time.perf_counter() - result.start, result.full_steps)
            learned = result.learned or result.gammas
            if not any(any(g) for g in result.gammas[:ran]):  # plain steps, priced alike: observed in one call
                B = len(reqs)
                self.controller.observe(reqs, [0] * B, [1] * B, *costs[0], steps=ran, timed=result.timed)
            else:
                for s in range(ran):
                    rows = live[s]
                    self.controller.observe([reqs[b] for b in rows], [learned[s][b] for b in rows],
                                            [len(result.tokens[s][b]) for b in rows], *costs[s],
                                            timed=result.timed)  # fmt: skip
        return outputs

    def _stop_ids(self, req: Request) -> set[int]:
        """The tokens that end ``req``: its stop_token_ids, and the EOS ids unless it ignores EOS."""
        stops = set(req.params.stop_token_ids or [])
        return stops if req.params.ignore_eos else stops | self.eos_token_ids

    def _stop_tensor(self, reqs: list[Request]) -> torch.Tensor:
        """int64 [S]: every stop id of the rows that the model can emit (a native chain ends at any of them)."""
        stops = {t for r in reqs for t in self._stop_ids(r) if 0 <= t < self.vocab_size}
        return torch.tensor(sorted(stops), dtype=torch.int64)

    def _truncate(self, req: Request, toks: list[int]) -> list[int]:
        """Cut the emitted tokens at a stop token (kept, as vLLM does for EOS) or at max_tokens."""
        stops = self._stop_ids(req)
        room = req.tokens_left
        for i, t in enumerate(toks[:room]):
            if t in stops:
                self._finish(req, "stop")
                return toks[: i + 1]
        return toks[:room]
