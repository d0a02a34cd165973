"""The scheduler: which requests run in a step and the KV blocks each holds (the "schedule" of schedule -> run ->
commit).

Each step, before anything runs (``Scheduler.schedule``):
1. each running request, oldest first, takes the blocks its next decode call may write (``make_room``); where none
   are left the newer requests first return blocks they hold beyond their next step, then the newest are preempted
   (vLLM's preemption by recompute: they wait first in the queue with their output, to be prefilled again);
2. waiting requests are admitted while batch slots and blocks allow (first come, first served), each with its
   prompt's blocks and one step's (a cached prefix comes with its blocks: prefix caching);
3. the requests that decode this step take a whole native call's blocks where free blocks allow (``top_up``; the
   engine cuts a call to the steps the blocks hold: ``steps_that_fit``).

The scheduler owns the queues (``waiting``, ``running``), the per-slot rows and the requests' blocks; it returns
what it changed (``Schedule``) and the engine records it. The blocks themselves come from ``BlockAllocator``
(spec_engine/kv_cache.py), which keeps the free list and the prefix cache.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from spec_engine.kv_cache import BlockAllocator
from spec_engine.request import Request, RequestRows


@dataclass
class Schedule:
    """What ``Scheduler.schedule`` changed: the requests it preempted (their blocks returned; waiting first) and
    those it admitted."""

    preempted: list[Request] = field(default_factory=list)
    admitted: list[Request] = field(default_factory=list)


class Scheduler:
    """Admission, KV block growth and preemption over a ``BlockAllocator``, for at most ``max_num_seqs`` running
    requests (see the module docstring).

    ``max_tree_nodes``: the widest tree a step may verify (a step writes that many K/V rows past a request's tokens);
    ``call_tokens``: the most tokens one native decode call may emit; ``prefill_chunk``: the longest prompt chunk a
    step computes; ``draft_follows_prefill``: the drafter's cache sees every prompt chunk (a fixed depth), so a cached
    prefix counts as drafted too.
    """

    def __init__(self, allocator: BlockAllocator, rows: RequestRows, *, max_num_seqs: int, prefill_chunk: int,
                 max_tree_nodes: int, call_tokens: int, draft_follows_prefill: bool):  # fmt: skip
        self.allocator, self.rows = allocator, rows
        self.max_num_seqs, self.prefill_chunk = max_num_seqs, prefill_chunk
        self.max_tree_nodes, self.call_tokens = max_tree_nodes, call_tokens
        self.draft_follows_prefill = draft_follows_prefill
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def schedule(self) -> Schedule:
        """Blocks for the running requests' next steps, then admission (not in a step that preempted: a request
        preempted now is not readmitted at once, its K/V thrown away), then the decoding requests' whole calls."""
        done = Schedule(preempted=self.make_room())
        if not done.preempted:
            done.admitted = self.admit()
        self.top_up()
        return done

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def tokens_to_hold(self, req: Request, whole_call: bool = False) -> int:
        """KV rows ``req`` needs for its next step: its tokens (after a preemption its output's too) and the step's
        tree (which can run past max_tokens); with ``whole_call``, for a whole decode call: the most tokens one call
        can emit (a native chain's), never more than the request can."""
        emitted = min(req.tokens_left, self.call_tokens) if whole_call else 0
        return req.num_tokens + emitted + self.max_tree_nodes

    def steps_that_fit(self, reqs: list[Request], gamma: int, steps: int) -> int:
        """At most ``steps`` native steps at depth ``gamma``: those whose K/V every row's blocks hold
        (``StepRunner``'s reach: the tokens emitted, at most a row's tokens left, then the last step's tree)."""
        for r in reqs:
            room = len(r.blocks) * self.allocator.block_size - r.num_tokens - self.max_tree_nodes
            if room < r.tokens_left:  # (a call ends as a row's tokens run out: room for them all is room enough)
                steps = min(steps, max(room, 0) // (gamma + 1))
        return steps

    def admit(self) -> list[Request]:
        """Admit waiting requests, oldest first, while slots and blocks allow; the requests admitted."""
        admitted, held = [], []  # held: requests that wait a step for prompt blocks a running prefill computes
        spare = len(self.running)  # a block each is left free (as vLLM leaves a watermark of blocks): one admitted
        # now is not preempted as soon as the others grow
        while self.waiting and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if req.block_keys is None:  # (the last token is the first step's root: never in a cached block)
                req.block_keys = self.allocator.keys(req.history[: req.num_tokens - 1])
            # a request asking for its prompt's logprobs computes every position: it takes nothing from the cache
            # (its own blocks are cached for the requests after it)
            lookup = [] if req.params.prompt_logprobs is not None else req.block_keys
            if lookup and self._awaits_shared_prefill(req):
                held.append(self.waiting.popleft())
                continue
            if not self.allocator.can_allocate(self.tokens_to_hold(req), lookup, spare):
                break  # first come, first served: it waits for blocks to return
            req.blocks, cached = self.allocator.allocate(self.tokens_to_hold(req), lookup)
            # a cached prefix (prefix caching) is computed: its K/V, an EAGLE head's features and, where the drafter
            # sees every prompt chunk, the draft cache came with its blocks; the adaptive controller's drafter catches
            # up from the start when it first drafts the request
            req.cache_seqlen = cached * self.allocator.block_size
            if self.draft_follows_prefill:
                req.draft_len = req.cache_seqlen
            req.slot = self.rows.admit(req)
            self.running.append(self.waiting.popleft())
            admitted.append(req)
            spare += 1
        self.waiting.extendleft(reversed(held))
        return admitted

    def make_room(self) -> list[Request]:
        """Give each running request, oldest first, the blocks of its next step (``tokens_to_hold``); the requests
        preempted for them. Where none are left, the newer requests first return the blocks ``top_up`` gave them
        beyond their next step (they hold no K/V yet); then the newest running requests are preempted. The oldest
        request always fits alone (``Engine.check_request``), so every request finishes."""
        i, preempted = 0, []
        while i < len(self.running):
            req = self.running[i]
            missing = self._missing_blocks(req)
            for newer in reversed(self.running[i + 1 :]):
                if missing <= self.allocator.num_free:
                    break
                self._shrink(newer)
            while missing > self.allocator.num_free and self.running[-1] is not req:
                preempted.append(self._preempt(self.running.pop()))
            if missing > self.allocator.num_free:
                preempted.append(self._preempt(self.running.pop()))  # itself, the newest left
                return preempted
            self._grow(req, missing)
            i += 1
        return preempted

    def top_up(self) -> None:
        """Give the running requests that decode this step, oldest first, the blocks of a whole native call where
        free blocks allow, a block each left free as admission left it."""
        for req in self.running:
            if req.num_tokens - 1 - req.cache_seqlen > self.prefill_chunk:  # (still prefilling after this step)
                continue
            spare = self.allocator.num_free - len(self.running)
            self._grow(req, min(self._missing_blocks(req, whole_call=True), spare))

    def release(self, req: Request) -> None:
        """Return ``req``'s blocks (its cached prompt blocks stay cached) and its slot."""
        self.allocator.free(req.blocks)
        req.blocks = []
        if req.slot >= 0:
            self.rows.release(req.slot)
            req.slot = -1

    def abort(self, request_id: str) -> list[Request]:
        """Take the request out of the queues; the requests taken (the caller finishes them)."""
        taken = [r for r in (*self.waiting, *self.running) if r.request_id == request_id]
        for req in taken:
            if req in self.waiting:
                self.waiting.remove(req)
        return taken

    def retire_finished(self) -> None:
        self.running = [r for r in self.running if not r.finished]

    def _missing_blocks(self, req: Request, whole_call: bool = False) -> int:
        return self.allocator.blocks_for(self.tokens_to_hold(req, whole_call)) - len(req.blocks)

    def _grow(self, req: Request, n: int) -> None:
        if n > 0:
            req.blocks += self.allocator.take(n)
            self.rows.set_blocks(req.slot, req.blocks)

    def _shrink(self, req: Request) -> None:
        """Return the blocks ``req`` holds beyond its next step's (never cached: no K/V was written to them)."""
        extra = -self._missing_blocks(req)
        if extra > 0:
            self.allocator.free(req.blocks[-extra:])
            req.blocks = req.blocks[:-extra]
            self.rows.set_blocks(req.slot, req.blocks)  # (the row's table forgets them: padding writes go to scratch)

    def _preempt(self, req: Request) -> Request:
        """Return ``req``'s blocks and slot and queue it first; what it emitted stays (its tokens, its drafter's
        token-keyed state: a suffix tree). The K/V recomputed later is the same bit for bit (batch-invariant kernels),
        so its output is as if it had never stopped."""
        self.release(req)  # (re-admitted, it takes its cached prompt blocks back)
        req.block_keys = None
        req.cache_seqlen = req.draft_len = 0
        if req.params.prompt_logprobs is not None:
            req.prompt_logprobs = [None]  # (computed again with the prompt)
        req.metrics.num_preemptions += 1
        self.waiting.appendleft(req)
        return req

    def _awaits_shared_prefill(self, req: Request) -> bool:
        """Whether ``req`` waits a step rather than compute its prompt's next blocks beside a running request whose
        prefill computes the same ones (prefix caching; the blocks are cached as each chunk completes them): where
        at least half of the chunk it would compute now is such blocks. A burst of requests with one long shared
        prefix (a system prompt) then computes it once, and takes it from the cache as it is computed."""
        keys = req.block_keys
        hits = self.allocator.num_hits(keys)
        if hits == len(keys):
            return False
        shared = hits  # keys[hits:shared]: blocks a running prefill will compute (chained keys: a shared run)
        for r in self.running:
            if r.prefilling and len(r.block_keys) > hits and r.block_keys[hits] == keys[hits]:
                common = min(len(keys), len(r.block_keys))
                shared = max(shared, next((j for j in range(hits, common) if keys[j] != r.block_keys[j]), common))
        block_size = self.allocator.block_size
        chunk = min(self.prefill_chunk, req.num_tokens - 1 - hits * block_size)
        return shared > hits and 2 * (shared - hits) * block_size >= chunk
