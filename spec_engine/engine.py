"""The engine: a scheduler around one speculative step (``Engine._spec_step``, the loop of ../shared/DESIGN.md).

Each ``Engine.step()``:
1. admits waiting requests while batch slots and KV blocks allow (a request reserves every block it can need);
2. runs one prefill chunk for the requests still reading their prompt (so a long prompt never stalls decoding);
3. runs one speculative step for every decoding request: draft, target forward over the tree, verify, compact;
4. retires finished requests at once, returning their blocks.

A request's prompt is prefilled except its last token, which becomes the first root: the first speculative step
then produces the first output tokens, so prefill needs no logits and no sampling path of its own.
"""

from __future__ import annotations

import itertools
import random
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from spec_engine.adaptive import AdaptiveController, RowState
from spec_engine.drafters.base import Draft, Drafter, StepBatch
from spec_engine.kv_cache import SCRATCH_BLOCK, BlockAllocator, PagedKVCache
from spec_engine.models import LlamaForCausalLM
from spec_engine.sampling import SEED_MASK, SamplingParams
from spec_engine.tree import causal_mask, tree_mask_and_depths
from spec_kernels import PAD_NODE, VerifyResult, compact_kv_, verify_tree

GAMMA_HISTORY_LEN = 4096  # steps of Engine.gamma_history kept


@dataclass
class RequestMetrics:
    num_steps: int = 0  # target passes while decoding
    num_drafted: int = 0  # tree depth asked per step, summed: the chances to accept
    num_accepted: int = 0  # drafted tokens the target kept
    accepted_hist: list[int] = field(default_factory=list)  # [k] = steps that accepted k drafts
    gamma_hist: list[int] = field(default_factory=list)  # [g] = steps this request was drafted at depth g
    alpha_estimate: float | None = None  # the adaptive controller's smoothed acceptance rate (None when fixed)
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None

    def as_dict(self, num_output_tokens: int) -> dict:
        elapsed = (self.finish_time or time.perf_counter()) - self.arrival_time
        return {
            "num_steps": self.num_steps,
            "num_drafted": self.num_drafted,
            "num_accepted": self.num_accepted,
            "acceptance_rate": self.num_accepted / self.num_drafted if self.num_drafted else 0.0,
            "mean_accepted_length": num_output_tokens / self.num_steps if self.num_steps else 0.0,  # tau
            "accepted_length_hist": list(self.accepted_hist),
            "gamma_hist": list(self.gamma_hist),
            "alpha_estimate": self.alpha_estimate,
            "time_to_first_token": (self.first_token_time or 0.0) - self.arrival_time,
            "elapsed": elapsed,
            "tokens_per_s": num_output_tokens / elapsed if elapsed > 0 else 0.0,
        }


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    output_token_ids: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0  # L: positions whose K/V are committed in the target cache
    draft_len: int = 0  # the same for the drafter's cache
    finish_reason: str | None = None
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    draft_generator: torch.Generator | None = None
    spec_state: RowState | None = None  # the adaptive controller's estimates for this request

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def prefilling(self) -> bool:
        return self.num_computed < len(self.prompt_token_ids) - 1

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class StepOutput:
    request: Request
    new_token_ids: list[int]
    finished: bool


class Engine:
    """Runs requests to completion on a target model, optionally speculating with ``drafter``.

    ``num_speculative_tokens`` is the tree depth: fixed, or with ``adaptive=True`` the deepest the controller
    (spec_engine/adaptive.py) may choose per row and step, 0 included.
    """

    def __init__(
        self,
        target: LlamaForCausalLM,
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
    ):
        self.target, self.kv, self.allocator, self.drafter = target, kv, allocator, drafter
        self.gamma = num_speculative_tokens if drafter is not None else 0
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.prefill_chunk = prefill_chunk
        self.eos_token_ids = set(eos_token_ids or [])
        self.vocab_size = target.config.vocab_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._ids = itertools.count()
        self.stats = {"num_steps": 0, "num_drafted": 0, "num_accepted": 0, "num_generated": 0}
        self.accepted_hist = [0] * (self.gamma + 1)
        self.gamma_history: deque[int] = deque(maxlen=GAMMA_HISTORY_LEN)  # per decode step: the deepest row's depth
        self.gamma_hist = [0] * (self.gamma + 1)  # [g] = rows drafted at depth g, over all steps
        self.step_times = (0.0, 0.0)  # the last speculative step's (draft, whole step) seconds
        self.controller = None
        if adaptive and drafter is not None:
            tree = getattr(drafter, "tree", None)
            self.controller = AdaptiveController(self.gamma, drafter.nodes_for_depth,
                                                 tree=tree is not None and not tree.is_chain,
                                                 cache_lag=drafter.cache_lag)  # fmt: skip

    # --- requests --------------------------------------------------------------------------------------------

    def max_tree_nodes(self) -> int:
        return self.drafter.nodes_for_depth(self.gamma) if self.drafter else 1

    def tokens_to_reserve(self, req: Request) -> int:
        # the tree of the last step can run past max_tokens; its K/V still need rows
        return len(req.prompt_token_ids) + req.params.max_tokens + self.max_tree_nodes()

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
        req = Request(request_id or str(next(self._ids)), ids, params, seed)
        req.draft_generator = torch.Generator().manual_seed(seed)
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
            self.running.append(self.waiting.popleft())

    def _finish(self, req: Request, reason: str) -> None:
        req.finish_reason = reason
        req.metrics.finish_time = time.perf_counter()
        self.allocator.free(req.blocks)
        req.blocks = []

    # --- one engine iteration --------------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        self._admit()
        prefilling = [r for r in self.running if r.prefilling]
        if prefilling:
            self._prefill(prefilling)
        decoding = [r for r in self.running if not r.prefilling]
        outputs = self._decode(decoding) if decoding else []
        self.running = [r for r in self.running if not r.finished]
        return outputs

    def _block_table(self, reqs: list[Request], max_pos: int) -> torch.Tensor:
        """[B, W] int32 covering positions < max_pos; rows are padded with the scratch block."""
        width = -(-max_pos // self.allocator.block_size)
        table = torch.full((len(reqs), width), SCRATCH_BLOCK, dtype=torch.int32)
        for b, r in enumerate(reqs):
            n = min(width, len(r.blocks))
            table[b, :n] = torch.tensor(r.blocks[:n], dtype=torch.int32)
        return table

    @torch.inference_mode()
    def _prefill(self, reqs: list[Request]) -> None:
        chunks = [r.prompt_token_ids[r.num_computed : len(r.prompt_token_ids) - 1][: self.prefill_chunk] for r in reqs]
        T = max(len(c) for c in chunks)
        tokens = torch.zeros(len(reqs), T, dtype=torch.int64)  # [B, T], ragged rows padded at the end
        for b, c in enumerate(chunks):
            tokens[b, : len(c)] = torch.tensor(c)
        seqlens = torch.tensor([r.num_computed for r in reqs], dtype=torch.int32)  # [B]
        positions = seqlens.long()[:, None] + torch.arange(T)  # [B, T]
        mask = causal_mask(len(reqs), T)
        table = self._block_table(reqs, int(seqlens.max()) + T)
        self.target(tokens, positions, self.kv.data, seqlens, mask, table)
        # With a fixed depth every request is drafted: the drafter sees the prompt now. The adaptive controller may
        # never draft a request (batch 16 on CPU), so there the draft cache is filled by catch-up when it first does.
        eager = self.drafter is not None and self.controller is None
        if eager:
            self.drafter.prefill(tokens, positions, seqlens, mask, table)
        for r, c in zip(reqs, chunks):
            r.num_computed += len(c)
            if eager:
                r.draft_len = r.num_computed

    @torch.inference_mode()
    def _decode(self, reqs: list[Request]) -> list[StepOutput]:
        gammas = self.choose_gammas(reqs)
        # the drafter runs on the drafted rows only; an undrafted row's lag (its whole prompt, under the adaptive
        # controller) must not widen every plain step's block table
        lag = max((self.drafter.cache_lag(r) for r, g in zip(reqs, gammas) if g), default=0) if self.drafter else 0
        seqlens = torch.tensor([r.num_computed for r in reqs], dtype=torch.int32)  # [B]
        batch = StepBatch(
            requests=reqs,
            seqlens=seqlens,
            roots=torch.tensor([r.all_token_ids[-1] for r in reqs]),
            block_table=self._block_table(reqs, int(seqlens.max()) + self.max_tree_nodes() + lag + 1),
            temperature=torch.tensor([float(r.params.temperature) for r in reqs]),
            gammas=gammas,
        )
        out_tokens, num_accepted = self._spec_step(batch)
        if self.controller is not None:
            self.controller.observe(reqs, gammas, num_accepted, *self.step_times)
        self.gamma_history.append(max(gammas))
        return self._emit(reqs, gammas, out_tokens, num_accepted)

    def choose_gammas(self, reqs: list[Request]) -> list[int]:
        """Tree depth per row this step: fixed, or the adaptive controller's choice (0 = not drafted)."""
        if self.controller is not None:
            return self.controller.choose(reqs)
        return [self.gamma] * len(reqs)

    def _spec_step(self, batch: StepBatch) -> tuple[list[list[int]], list[int]]:
        """One speculative step over B rows: draft, verify the whole tree in one target pass, compact the caches."""
        start = time.perf_counter()
        rows = [b for b, g in enumerate(batch.gammas) if g > 0] if self.drafter is not None else []
        draft = self._propose(batch, rows)  # tokens/parents [B, T], draft_probs [B, T, V] | None
        drafted = time.perf_counter()
        mask, depths = tree_mask_and_depths(draft.parents)  # [B, T, T], [B, T]
        positions = batch.seqlens.long()[:, None] + depths  # [B, T]: L_b + depth
        hidden = self.target(draft.tokens, positions, self.kv.data, batch.seqlens, mask, batch.block_table)
        result = verify_tree(
            self.target.logits(hidden),  # [B, T, V]
            draft.tokens,
            draft.parents,
            draft_probs=draft.draft_probs,
            draft_sampling=draft.draft_sampling,
            **self._sampling_tensors(batch),
        )
        compact_kv_(self.kv.planes, batch.seqlens, result.accepted_nodes, result.num_accepted,
                    block_table=batch.block_table)  # fmt: skip
        if rows:
            self.drafter.commit(*_select_rows(batch, result, rows))
        out = result.output_tokens.tolist(), result.num_accepted.tolist()  # the step's one host sync
        self.step_times = (drafted - start, time.perf_counter() - start)
        return out

    def _propose(self, batch: StepBatch, rows: list[int]) -> Draft:
        """The drafter's trees for ``rows`` (depth > 0), run on those rows only; every other row is its root alone."""
        if len(rows) == batch.size:
            return self.drafter.propose(batch)
        root_only = torch.full((batch.size, 1), PAD_NODE, dtype=torch.int64)
        if not rows:
            return Draft(batch.roots[:, None], root_only)
        sub = self.drafter.propose(_select_rows(batch, None, rows)[0])  # [B_d, T]
        idx = torch.tensor(rows)
        tokens = sub.tokens.new_zeros(batch.size, sub.tokens.shape[1])  # [B, T]
        tokens[:, 0] = batch.roots
        tokens[idx] = sub.tokens
        parents = root_only.expand(-1, tokens.shape[1]).clone()  # [B, T]: undrafted rows are all padding
        parents[idx] = sub.parents
        probs = None
        if sub.draft_probs is not None:
            probs = sub.draft_probs.new_zeros(*tokens.shape, sub.draft_probs.shape[-1])  # [B, T, V]
            probs[idx] = sub.draft_probs
        return Draft(tokens, parents, probs, sub.draft_sampling)

    def _sampling_tensors(self, batch: StepBatch) -> dict:
        params = [r.params for r in batch.requests]
        if all(p.greedy for p in params):
            return {"temperature": batch.temperature}
        # Per-row seeds from (request seed, position): a request samples the same alone or in any batch.
        seeds = [(r.seed * 1_000_003 + int(L)) & SEED_MASK for r, L in zip(batch.requests, batch.seqlens.tolist())]
        return {
            "temperature": batch.temperature,
            "top_k": torch.tensor([p.top_k for p in params]),
            "top_p": torch.tensor([float(p.top_p) for p in params]),
            "min_p": torch.tensor([float(p.min_p) for p in params]),
            "seed": torch.tensor(seeds, dtype=torch.int64),
        }

    def _emit(self, reqs, gammas, out_tokens, num_accepted) -> list[StepOutput]:
        outputs, now = [], time.perf_counter()
        for req, gamma, toks, n in zip(reqs, gammas, out_tokens, num_accepted):
            new = self._truncate(req, toks[:n])
            req.output_token_ids.extend(new)
            req.num_computed += n
            m = req.metrics
            m.num_steps += 1
            m.num_drafted += gamma
            m.num_accepted += n - 1
            m.accepted_hist.extend([0] * (n - len(m.accepted_hist)))
            m.accepted_hist[n - 1] += 1
            m.gamma_hist.extend([0] * (gamma + 1 - len(m.gamma_hist)))
            m.gamma_hist[gamma] += 1
            self.gamma_hist[gamma] += 1
            if m.first_token_time is None:
                m.first_token_time = now
            self.stats["num_steps"] += 1
            self.stats["num_drafted"] += gamma
            self.stats["num_accepted"] += n - 1
            self.stats["num_generated"] += len(new)
            self.accepted_hist[n - 1] += 1
            if req.finish_reason is None and len(req.output_token_ids) >= req.params.max_tokens:
                self._finish(req, "length")
            outputs.append(StepOutput(req, new, req.finished))
        return outputs

    def _truncate(self, req: Request, toks: list[int]) -> list[int]:
        """Cut the emitted tokens at a stop token (kept, as vLLM does for EOS) or at max_tokens."""
        stops = set(req.params.stop_token_ids or [])
        if not req.params.ignore_eos:
            stops |= self.eos_token_ids
        room = req.params.max_tokens - len(req.output_token_ids)
        for i, t in enumerate(toks[:room]):
            if t in stops:
                self._finish(req, "stop")
                return toks[: i + 1]
        return toks[:room]


def _select_rows(batch: StepBatch, result: VerifyResult | None, rows: list[int]) -> tuple[StepBatch, VerifyResult]:
    """The sub-batch (and verify result) of the drafted rows, for drafters that run on those rows only."""
    if len(rows) == batch.size:
        return batch, result
    idx = torch.tensor(rows)
    sub = StepBatch([batch.requests[b] for b in rows], batch.seqlens[idx], batch.roots[idx], batch.block_table[idx],
                    batch.temperature[idx], [batch.gammas[b] for b in rows])  # fmt: skip
    return sub, None if result is None else VerifyResult(*(x[idx.to(x.device)] for x in result))
