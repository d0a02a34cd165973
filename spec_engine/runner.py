"""The step runner: prefill chunks and decode calls, the "run" of schedule -> run -> commit.

The engine chooses the rows, their depths and at most how many steps a call may run; ``StepRunner.plan`` decides
the call's path and steps (one ``StepPlan``: the only place that decides it), ``StepRunner.run`` runs it and returns
what changed as one ``StepResult`` for ``Engine._apply`` to commit (``StepRunner.prefill``: one ``PrefillChunk``):

- a plain chain: K plain steps in one C++ call (``plain_steps``; ``spec_chain`` at depth 0 where a head reads the
  target's features), of greedy rows and coupled sampled ones;
- a spec chain: up to ``max_steps`` greedy speculative steps of a draft model's or an EAGLE-3 head's chains (a
  head's static and dynamic trees too) in one C++ call (``spec_chain``); with a head's chains and dynamic trees,
  coupled sampled rows too (``_greedy_or_coupled``: the position-keyed coupling's tokens, as the regular step draws
  them);
- the regular step (``_spec_step``): draft, the target's pass over the tree, ``verify_tree``, compaction, in
  Python-driven ops: any tree, other sampled rows, a hybrid's suffix rows, any device; where every row is greedy with a
  deterministic tree and the target runs natively, the pass, verification and compaction are one native call
  (``tree_step``: the step every native call runs, once).

Glossary: L_b a row's root position (``cache_seqlen``); lag its draft cache's catch-up (``cache_lag``: the tokens
the draft has not seen, before the root).
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import torch

from spec_engine.cuda_graphs import CapturedForward, captured_forward
from spec_engine.drafters.base import Draft, Drafter, StepBatch, propose_rows
from spec_engine.kv_cache import PagedKVCache
from spec_engine.logits_processors import process_logits_
from spec_engine.logprobs import step_logprobs, token_logprobs
from spec_engine.models import Target
from spec_engine.request import Request, RequestRows
from spec_engine.sampling import SEED_MASK
from spec_engine.step import PLAIN_CHAIN, REGULAR, SPEC_CHAIN, PrefillChunk, StepPlan, StepResult
from spec_engine.transfer import to_device
from spec_engine.tree import causal_mask, path_ranks
from spec_kernels import VerifyResult, verify_tree
from spec_kernels.decoder_layers import (
    SPEC_CHAIN_MAX_NODES,
    NativeHead,
    NativeModel,
    plain_steps,
    spec_chain,
    tree_step,
)
from spec_kernels.rng import mix_key

INT63_MASK = (1 << 63) - 1  # a request seed (any 64-bit int) as a non-negative int64 noise seed


def _noise_seeds(reqs: list[Request]) -> torch.Tensor:
    """[B] int64: each row's coupling noise seed, its request seed as a non-negative int64."""
    return torch.tensor([r.seed & INT63_MASK for r in reqs], dtype=torch.int64)


def _greedy_or_coupled(reqs: list[Request]) -> bool:
    """Whether the native calls can sample these rows: each greedy, or coupled (``Request.coupled``: its tokens the
    position-keyed coupling's, as the regular step draws them, top-k, top-p and min-p included)."""
    return all(r.params.greedy or r.coupled for r in reqs)


def _native(model, cache: PagedKVCache | None) -> NativeModel | NativeHead | None:
    """``model``'s native handle where its cache is in the handle's dtype, else None."""
    native = getattr(model, "native", None)
    return native if native is not None and cache is not None and cache.data.dtype == native.dtype else None


class StepRunner:
    """Runs the decode calls of an engine's rows on its target and drafter (see the module docstring).

    ``rows``: the scheduler's per-slot host buffers (block tables, sampling parameters); ``block_size`` the KV
    cache's; ``max_tree_nodes`` the widest tree a step may verify; ``prefill_chunk`` the longest catch-up a native
    call takes. The native handles are decided here, once.
    """

    def __init__(self, target: Target, kv: PagedKVCache, drafter: Drafter | None, rows: RequestRows, *,
                 block_size: int, max_tree_nodes: int, prefill_chunk: int):  # fmt: skip
        self.target, self.kv, self.drafter, self.rows = target, kv, drafter, rows
        self.device = kv.data.device
        self.block_size, self.max_tree_nodes, self.prefill_chunk = block_size, max_tree_nodes, prefill_chunk
        self.step_times = (0.0, 0.0)  # the last regular step's (draft, whole step) seconds
        self.spec_chain_max_nodes = SPEC_CHAIN_MAX_NODES  # the widest tree a spec chain takes; wider: regular steps
        # the native step ops (several greedy steps in one C++ call), decided once: the models' handles where their
        # caches are in their dtype (a CPU model in float32 or bfloat16: spec_kernels.decoder_layers.native_model)
        self.native_target = _native(target, kv)
        self.native_draft = _native(drafter, drafter.kv) if drafter is not None else None
        # a regular step's greedy trees verify in one call (tree_step) on the native target, which also returns the
        # features of a drafter that reads streams of target layers (a head on the final hidden states: the separate
        # ops' pass returns those)
        reads = drafter is not None and drafter.needs_hidden
        self.native_tree = None if reads and drafter.target_layers is None else self.native_target
        self.tree_capture = tuple(drafter.target_layers) if reads and self.native_tree is not None else ()
        # the native calls sample coupled rows: a head's chains and dynamic trees (tree="auto"'s widths too: a chain
        # and a dynamic tree) and its target's plain steps (spec_chain), and a target's plain steps where nothing
        # drafts (plain_steps); a static tree's children are no draws of the coupling's noise
        tree = drafter.tree if drafter is not None else None
        drafts = tree is None or tree.is_chain or bool(tree.topk)
        self.head_samples = isinstance(self.native_draft, NativeHead) and drafts
        self.samples_natively = self.native_target is not None and (drafter is None or self.head_samples)
        self.graphs: CapturedForward | None = None  # the regular step's captured target pass (use_graphs)
        self._graph_mechanism: str | None = None

    def use_graphs(self, enforce_eager: bool, mechanism: str | None = None, widths: tuple[int, ...] = ()) -> None:
        """The regular step's target pass replayed from graphs per bucket (spec_engine/cuda_graphs.py: on CUDA, or by
        ``mechanism``; start-up buckets at verify ``widths`` captured now), or eager; kept while the choice stands."""
        enforce_eager = enforce_eager or not self.target.capturable  # (tensor parallelism: a host broadcast a call)
        if enforce_eager or self.graphs is None or mechanism != self._graph_mechanism:
            rows, width = self.rows.block_table.shape
            self.graphs = None if enforce_eager else captured_forward(
                self.target_logits, self.device, table_width=width, max_rows=rows, max_width=self.max_tree_nodes,
                mechanism=mechanism, name="target's pass", startup_widths=widths)  # fmt: skip
            if self.drafter is not None:  # (a draft model's forwards too; drafters without one ignore it)
                self.drafter.use_graphs(enforce_eager, mechanism, table_width=width, max_rows=rows)
        self._graph_mechanism = mechanism

    def cache_lag(self, req: Request) -> int:
        """Tokens before ``req``'s root that its draft cache has not seen (0 for a drafter without a cache)."""
        return req.cache_seqlen - req.draft_len if self.drafter is not None and self.drafter.keeps_cache else 0

    @torch.inference_mode()
    def prefill(self, reqs: list[Request], *, room: int, draft: bool) -> PrefillChunk:
        """One chunk of each row's prompt (at most ``prefill_chunk`` tokens; none past position ``room``) through the
        target, writing its K/V. ``draft``: the drafter's cache sees the chunk too (a fixed depth drafts every
        request); else a drafter that reads the target's features keeps them (they exist only in this pass) and its
        cache catches up when the adaptive controller first drafts the row, a cost the controller weighs."""
        counts = [min(r.num_tokens - 1 - r.cache_seqlen, self.prefill_chunk) for r in reqs]
        # rows are padded to the widest chunk: a padded slot's position stays inside the RoPE table (a short last
        # chunk beside a long one, near the end of the context); past the row's blocks its K/V lands in scratch
        T = min(max(counts), min(room - r.cache_seqlen for r in reqs))
        counts = [min(n, T) for n in counts]
        tokens = np.zeros((len(reqs), T), dtype=np.int64)  # [B, T], ragged rows padded at the end
        for b, (r, n) in enumerate(zip(reqs, counts)):
            tokens[b, :n] = r.history[r.cache_seqlen : r.cache_seqlen + n]
        starts = [r.cache_seqlen for r in reqs]
        seqlens_h = torch.tensor(starts, dtype=torch.int32)  # [B]
        tokens, cache_seqlens, table = to_device(
            self.device, torch.from_numpy(tokens), seqlens_h, self.block_table(reqs, max(starts) + T)
        )
        positions = cache_seqlens.long()[:, None] + torch.arange(T, device=self.device)  # [B, T]
        mask = causal_mask(len(reqs), T, self.device)
        hidden, features = self.target_pass(tokens, positions, self.kv.data, cache_seqlens, mask, table)
        scored = [[] for _ in reqs]  # (a preempted request's chunk can run past its prompt, into its output)
        for b, (r, n) in enumerate(zip(reqs, counts)):
            m = min(n, len(r.prompt_token_ids) - 1 - r.cache_seqlen)
            if r.params.prompt_logprobs is not None and m > 0:
                scored[b] = self._prompt_logprobs(r, hidden[b, :m], m)
        if draft:
            self.drafter.prefill(tokens, positions, cache_seqlens, mask, table, features)
        elif features is not None:
            self.drafter.store_features(positions, table, features)
        return PrefillChunk(counts, scored)

    def _prompt_logprobs(self, req: Request, hidden: torch.Tensor, n: int) -> list[dict[int, float]]:
        """The ``Request.prompt_logprobs`` entries of the prompt tokens after a prefill chunk's ``n`` positions
        (``hidden`` [n, H]: each position's final hidden state predicts the next prompt token)."""
        start = req.cache_seqlen
        nxt = req.prompt_token_ids[start + 1 : start + n + 1]  # (the chunk ends before the last prompt token)
        targets = to_device(self.device, torch.tensor(nxt, dtype=torch.int64))[0]  # [n]
        rows = token_logprobs(self.target.logits(hidden), targets, req.params.prompt_logprobs)
        return [req.logprobs_entry(t, row, req.params.prompt_logprobs) for t, row in zip(nxt, rows)]

    def plan(self, reqs: list[Request], gammas: list[int], suffix_rows: list[bool] | None, *, max_steps: int,
             full_steps: int, stop_on_reject: bool = False, native_verify: bool = True,
             logprobs: int | None = None, width: int = 0) -> StepPlan:  # fmt: skip
        """The path and length of one decode call for ``reqs`` at depths ``gammas`` [B] (0: undrafted), the one place
        that decides it: up to ``max_steps`` steps in one native call where it can run them (0: the regular step),
        else the regular step. ``full_steps``, ``stop_on_reject``: as ``StepPlan``'s; ``native_verify``: the regular
        step of greedy rows may verify in one native call; ``logprobs``: the call returns each emitted token's
        log-probabilities and this many alternatives' (only the regular step does, as it alone runs logits
        processors); ``width``: the drafted steps' tree width (``StepPlan.width``)."""
        regular = StepPlan(REGULAR, logprobs=logprobs, native_verify=native_verify and self.native_tree is not None
                           and all(r.params.greedy for r in reqs), width=width)  # fmt: skip
        if logprobs is not None or any(r.processes_logits for r in reqs):
            return dataclasses.replace(regular, native_verify=False)
        if max_steps and max(gammas) == 0:
            K = self._plain_chain_len(reqs, max_steps)
            if K:
                return dataclasses.replace(regular, path=PLAIN_CHAIN, steps=K, full_steps=full_steps)
        elif max_steps and not any(suffix_rows or ()) and self._spec_chain_fits(reqs, gammas, width):
            return dataclasses.replace(regular, path=SPEC_CHAIN, steps=max_steps, gamma=gammas[0],
                                       full_steps=full_steps, stop_on_reject=stop_on_reject)  # fmt: skip
        return regular

    def run(self, reqs: list[Request], plan: StepPlan, gammas: list[int], suffix_rows: list[bool] | None,
            stops: torch.Tensor) -> StepResult:  # fmt: skip
        """One decode call as ``plan`` says (``StepRunner.plan``). ``stops`` [S] every stop id of the rows (a native
        call ends at any of them). A native call whose first step's logits are not finite commits nothing; the
        regular step then decodes it (and sanitises or raises)."""
        result = None
        if plan.path == PLAIN_CHAIN:
            result = self._plain_chain(reqs, plan.steps, stops, plan.full_steps)
        elif plan.path == SPEC_CHAIN:
            result = self._spec_chain(reqs, plan, stops)
        if result is None:
            plan = dataclasses.replace(plan, path=REGULAR, steps=1, gamma=0, full_steps=0, stop_on_reject=False,
                                       fallback_from=plan.path if plan.path != REGULAR else None)  # fmt: skip
            processed = reqs if any(r.processes_logits for r in reqs) else None
            result = self._regular_step(reqs, gammas, suffix_rows, plan, processed)
        result.plan = plan
        return result

    def _plain_chain_len(self, reqs: list[Request], max_steps: int) -> int:
        """Tokens per row a plain native chain decodes (0: the regular one-token step).

        Multi-step decoding (vLLM's ``num_scheduler_steps``): with no drafter or none this step (a drafter that reads
        the target's features must see every step, so only a native head, whose features the call stores) and all
        rows greedy or coupled (``_greedy_or_coupled``), the target runs up to ``max_steps``
        forwards in one C++ call, so the step's Python and dispatch, comparable to a small model's whole forward, is
        paid once per chain. Same forwards, same kernels, same tokens (tests/test_native_steps.py); the call ends at a
        row's stop token, so a long chain wastes no forward at a request's end. A chain of one (a row's last token)
        still saves the regular step's Python."""
        head_target = self.drafter is not None and self.drafter.needs_hidden
        if self.native_target is None or (head_target and not isinstance(self.native_draft, NativeHead)):
            return 0
        if not _greedy_or_coupled(reqs):  # (coupled sampled rows: spec_chain at depth 0 and plain_steps sample them)
            return 0
        cap = self.drafter.plain_chain_cap if self.drafter is not None else None
        return min(max_steps, cap or max_steps, min(r.tokens_left for r in reqs))

    def _plain_chain(self, reqs: list[Request], K: int, stops: torch.Tensor, full_steps: int) -> StepResult | None:
        """``K`` plain steps for every row in one native call (``plain_steps``: the roots at L_b, then
        tokens 1 .. K-1 at L_b + 1 .. L_b + K - 1, their K/V written there, as K one-token steps would), or fewer:
        the call ends at the first token that is a stop token of some row, so a chain spends no forward past a
        request's end, and before a step where some row's logits are not finite. None, with nothing committed, where
        the first step's are not (the regular step then decodes it and sanitises or raises)."""
        start = time.perf_counter()
        lengths = [r.cache_seqlen for r in reqs]
        cache_seqlens = torch.tensor(lengths, dtype=torch.int32)  # [B]: the roots' positions L_b
        roots = torch.tensor([r.last_token for r in reqs], dtype=torch.int64)  # [B]
        table = self.block_table(reqs, max(lengths) + K)  # [B, W]: up to position L_b + K - 1
        forwards = time.perf_counter()
        if self.drafter is not None and self.drafter.needs_hidden:  # a head's target: the steps store its features
            B = len(reqs)
            steps, _, _, _, _ = spec_chain(
                self.native_target, self.native_draft, roots[:, None], torch.ones(B, dtype=torch.int64), cache_seqlens,
                self.kv.data, self.drafter.kv.data, table, torch.tensor([r.tokens_left for r in reqs]), stops,
                gamma=0, max_steps=K, draft_features=self.drafter.features, **self._sampling(reqs),
            )  # fmt: skip  # [B, K, 2]: per step 1 (0 where not run) then the token
            tokens = steps[:, : int((steps[0, :, 0] > 0).sum()), 1]  # [B, K' <= K]
        else:
            tokens = plain_steps(roots, self.native_target, self.kv.data, cache_seqlens, steps=K, block_table=table,
                                  stop_ids=stops, **self._sampling(reqs))  # fmt: skip  # [B, K' <= K]
        forwards = time.perf_counter() - forwards
        if tokens.shape[1] == 0:
            return None
        K = tokens.shape[1]  # (the call ended at a row's stop token: the rows that go on continue next step)
        B = len(reqs)
        return StepResult([[0] * B] * K, tokens.tolist(), [[1] * B] * K, [[0.0, forwards / K]] * K, start=start,
                          full_steps=full_steps)  # fmt: skip

    def _spec_chain_fits(self, reqs: list[Request], gammas: list[int], width: int) -> bool:
        """Whether a native call can run the rows' speculative steps: a draft model proposing chains or a native head
        proposing chains or trees (static, dynamic), for greedy rows (a head's chains and dynamic trees: coupled
        sampled rows too), at one
        gamma, the draft caches' lags (their catch-up: a prompt and the tokens decoded before a row's first drafted
        step, under the adaptive controller) at most a prefill chunk and within gamma of each other, and every row
        with gamma + 1 tokens of its max_tokens left (the C++ checks before each step: a call near the end of a
        request is not cut to the steps that fit at full acceptance)."""
        gamma = gammas[0]
        if self.native_target is None or self.native_draft is None:
            return False
        if any(x != gamma for x in gammas) or self.drafter.nodes_for_gamma(gamma, width) > self.spec_chain_max_nodes:
            return False
        if not all(r.params.greedy for r in reqs) and not (self.head_samples and _greedy_or_coupled(reqs)):
            return False  # (sampled rows: coupled, drafted by a head's chains or dynamic trees)
        lags = [self.cache_lag(r) for r in reqs]
        # (a ragged catch-up pads rows past their roots: at most gamma slots, which the step overwrites)
        tokens_left = min(r.tokens_left for r in reqs)
        return max(lags) <= self.prefill_chunk and max(lags) - min(lags) <= gamma and tokens_left > gamma

    def _spec_chain(self, reqs: list[Request], plan: StepPlan, stops: torch.Tensor) -> StepResult | None:
        """Up to ``plan.steps`` speculative steps at depth ``plan.gamma`` in one ``spec_chain`` call, as a
        ``StepResult`` (``_apply`` commits it as it commits the regular step's). None, with nothing committed, where
        the first step's target logits were not finite."""
        start = time.perf_counter()
        gamma, max_steps = plan.gamma, plan.steps
        B = len(reqs)
        lags = [self.cache_lag(r) for r in reqs]
        catch_up = np.zeros((B, max(lags) + 1), dtype=np.int64)  # [B, P]: each draft cache's lag, then the root
        for b, (r, lag) in enumerate(zip(reqs, lags)):
            catch_up[b, : lag + 1] = r.history[r.num_tokens - 1 - lag : r.num_tokens]
        lengths = [r.cache_seqlen for r in reqs]
        tree = self.drafter.tree_for(plan.width)
        branching, topk = tree.native_shape(gamma) if tree is not None else ((), 0)  # (a head's tree, cut)
        # positions a row may write past L_b: its emitted tokens, then the last step's tree
        reach = min(max_steps * (gamma + 1), max(r.tokens_left for r in reqs)) + self.drafter.nodes_for_gamma(
            gamma, plan.width
        )
        table = self.block_table(reqs, max(lengths) + reach + 2)  # [B, W]
        result = spec_chain(
            self.native_target, self.native_draft, torch.from_numpy(catch_up),
            torch.tensor([lag + 1 for lag in lags]), torch.tensor(lengths), self.kv.data, self.drafter.kv.data, table,
            torch.tensor([r.tokens_left for r in reqs]),
            stops, gamma=gamma, max_steps=max_steps, stop_on_reject=plan.stop_on_reject,
            draft_features=self.drafter.features, tree=branching, topk=topk, **self._sampling(reqs),
        )  # fmt: skip
        steps, _, catch_up_lens, times, ranks = result  # [B, S, gamma + 2], [B, 2], [B], [S, 2], [B, S, gamma + 1]
        steps, catch_up_lens, times = steps.tolist(), catch_up_lens.tolist(), times.tolist()
        ran = next((s for s in range(max_steps) if steps[0][s][0] == 0), max_steps)  # every row runs every step
        if ran == 0:
            return None  # the first step's target logits were not finite: the regular step decodes it
        counts = [[steps[b][s][0] for b in range(B)] for s in range(ran)]  # [S][B]
        tokens = [[t for s in range(ran) for t in steps[b][s][1 : 1 + steps[b][s][0]]] for b in range(B)]  # [B][n]
        # the draft cache lags by its catch-up's tokens before the root (its lag) behind the rows' new L_b
        draft_lens = [r.cache_seqlen + len(t) - (n - 1) for r, t, n in zip(reqs, tokens, catch_up_lens)]
        # a tree's accepted paths' ranks: what a chain would have kept (the controller's width choice)
        ranks = [[row[:n] for row, n in zip(r, c)] for r, c in zip(ranks.transpose(0, 1).tolist(), counts)] \
            if plan.width > 1 else None  # fmt: skip
        return StepResult([[gamma] * B] * ran, tokens, counts, times[:ran], draft_lens, start=start,
                          full_steps=plan.full_steps, ranks=ranks)  # fmt: skip

    def _sampling(self, reqs: list[Request]) -> dict:
        """A native call's sampling inputs: each row's temperature [B] float32 (0: greedy) and noise seed [B] int64,
        and where a row has top-k, top-p or min-p, every row's (``top_k`` [B] int64, ``top_p``, ``min_p`` [B]
        float32), the regular step's (``step_inputs``); none where every row is greedy."""
        if all(r.params.greedy for r in reqs):
            return {}
        slots = [r.slot for r in reqs]
        sampling = {"temperature": self.rows.temperature[slots].float().contiguous(), "noise_seeds": _noise_seeds(reqs)}
        if any(r.params.filtered for r in reqs):
            sampling.update(top_k=self.rows.top_k[slots], top_p=self.rows.top_p[slots], min_p=self.rows.min_p[slots])
        return sampling

    def _regular_step(self, reqs: list[Request], gammas: list[int], suffix_rows: list[bool] | None, plan: StepPlan,
                      processed: list[Request] | None = None) -> StepResult:  # fmt: skip
        """One step driven from Python: ``_spec_step`` on the step's inputs (``processed``: ``reqs`` where a row's
        logits are processed)."""
        batch, sampling = self.step_inputs(reqs, gammas, suffix_rows, plan.width)
        out_tokens, num_accepted, draft_lens, width, lps, ranks = self._spec_step(batch, sampling, plan.native_verify,
                                                                                  plan.logprobs, processed)  # fmt: skip
        # suffix rows (a hybrid's, a suffix drafter's) teach the controller nothing of a model drafter's acceptance;
        # their pass, as wide as the drafter shaped it, prices that width
        learned = gammas if suffix_rows is None else [0 if s else gamma for gamma, s in zip(gammas, suffix_rows)]
        return StepResult([gammas], [t[:n] for t, n in zip(out_tokens, num_accepted)], [num_accepted],
                          [list(self.step_times)], draft_lens, learned=[learned], widths=[width],
                          logprobs=lps, ranks=ranks and [ranks])  # fmt: skip

    def step_inputs(self, reqs: list[Request], gammas: list[int], suffix_rows: list[bool] | None = None,
                    width: int = 0) -> tuple[StepBatch, dict]:  # fmt: skip
        """The step's inputs, gathered from the host rows and sent to the device together."""
        # the drafter runs on the drafted rows only; an undrafted row's lag (its whole prompt, under the adaptive
        # controller) must not widen every plain step's block table
        lag = max((self.cache_lag(r) for r, gamma in zip(reqs, gammas) if gamma), default=0)
        lengths = [r.cache_seqlen for r in reqs]
        slots = [r.slot for r in reqs]
        # per-row seeds from (request seed, position): a request samples the same alone or in any batch
        seeds = [(r.seed * 1_000_003 + L) & SEED_MASK for r, L in zip(reqs, lengths)]
        host = {
            "cache_seqlens": torch.tensor(lengths, dtype=torch.int32),  # [B]
            "roots": torch.tensor([r.last_token for r in reqs], dtype=torch.int64),  # [B]
            "block_table": self.block_table(reqs, max(lengths) + self.max_tree_nodes + lag + 1),  # [B, W]
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
        if any(r.coupled for r in reqs):
            host |= {
                "coupled": torch.tensor([r.coupled for r in reqs]),
                "noise_seeds": _noise_seeds(reqs),
            }
        dev = dict(zip(host, to_device(self.device, *host.values())))
        batch = StepBatch([r.view() for r in reqs], dev.pop("cache_seqlens"), dev.pop("roots"), dev.pop("block_table"),
                          dev["temperature"], dev.pop("keys"), gammas, dev.pop("coupled", None),
                          dev.pop("noise_seeds", None), suffix_rows, width)  # fmt: skip
        return batch, dev

    def _spec_step(self, batch: StepBatch, sampling: dict, native_verify: bool = False, logprobs: int | None = None,
                   processed: list[Request] | None = None,
                   ) -> tuple[list[list[int]], list[int], list[int], int, list | None, list | None]:  # fmt: skip
        """One speculative step over B rows: draft, verify the whole tree in one target pass, compact the caches.

        Returns the host's (emitted tokens [B][T], num_accepted [B], the draft cache's new lengths [B] where the
        drafter keeps a cache, the tokens the target pass verified: B * T, the emitted tokens' log-probabilities
        with ``logprobs`` alternatives each where asked: ``StepResult.logprobs``, else None; a tree of width > 1's
        accepted paths' ranks [B][n], ``StepResult.ranks``' step, else None). ``processed``: the
        step's requests where some row's logits are processed (``spec_engine.logits_processors``)."""
        start = time.perf_counter()
        rows = [b for b, gamma in enumerate(batch.gammas) if gamma > 0] if self.drafter is not None else []
        partial = 0 < len(rows) < batch.size  # some rows drafted, not all: the drafter runs on a sub-batch
        index = to_device(self.device, torch.tensor(rows, dtype=torch.int64))[0] if partial else None  # [B_d]
        draft = propose_rows(self.drafter, batch, rows, index)  # tokens/parents [B, T], draft_probs [B, T, V] | None
        drafted = time.perf_counter()
        verified = self._native_verify(batch, draft) if native_verify else None
        logits = None
        if verified is not None:
            result, features = verified
        else:
            result, features, logits = self._verify(batch, draft, sampling, processed, raw=logprobs is not None)
        # the step's one host sync (and logprobs' one more); a tree's accepted path and parents ride along (its ranks)
        trees = batch.width > 1
        out_tokens, num_accepted, paths, parents = self._read_step(result, draft.parents if trees else None)
        lps = step_logprobs(logits, result, num_accepted, logprobs) if logprobs is not None else None
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
        ranks = [path_ranks(p, path[:n]) for p, path, n in zip(parents, paths, num_accepted)] if trees else None
        return out_tokens, num_accepted, draft_lens, draft.tokens.numel(), lps, ranks

    def _native_verify(self, batch: StepBatch, draft: Draft) -> tuple[VerifyResult, torch.Tensor | None] | None:
        """The step's target pass, greedy verification and compaction in one native call (``tree_step``), for a plan
        that allows it (``StepPlan.native_verify``: every row greedy, the target native) and a deterministic tree (a
        drafter that reads the target's features: the streams of its ``target_layers``, which the call returns);
        else None, as also where the call leaves a row to the regular path (``_verify``)."""
        if draft.draft_probs is not None:  # (the plan allowed it for greedy rows: here the tree is deterministic too)
            return None
        return tree_step(self.native_tree, draft.tokens, draft.parents, batch.cache_seqlens, self.kv.data,
                         batch.block_table, capture=self.tree_capture)  # fmt: skip

    def _verify(self, batch: StepBatch, draft: Draft, sampling: dict,
                processed: list[Request] | None = None,
                raw: bool = False) -> tuple[VerifyResult, torch.Tensor | None, torch.Tensor]:  # fmt: skip
        """The regular step's target pass over the tree, ``verify_tree`` and the target cache's compaction: the
        result, the features of a drafter that reads the target's (else None) and the pass's logits [B, T, V] (as
        the target gave them where ``raw``, even where ``processed``'s logits processors changed those verified)."""
        positions = batch.cache_seqlens.long()[:, None] + draft.depths  # [B, T]: L_b + depth
        forward = self.target_logits if self.graphs is None else self.graphs  # (a captured bucket, or eager)
        logits, features = forward(draft.tokens, positions, batch.cache_seqlens, draft.tree_mask, batch.block_table)
        given = logits
        if processed is not None:
            logits = process_logits_(logits.clone() if raw else logits, draft.tokens, draft.parents, processed)
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
            self.kv.compact_(
                batch.cache_seqlens, result.accepted_nodes, result.num_accepted, block_table=batch.block_table
            )
        return result, features, given

    def target_logits(self, tokens, positions, cache_seqlens, tree_mask, block_table):  # fmt: skip
        """The regular step's target pass over tokens [B, T]: logits [B, T, V] float32, and the features [B, T, F]
        of a drafter that reads the target's (else None). What ``graphs`` captures."""
        hidden, features = self.target_pass(tokens, positions, self.kv.data, cache_seqlens, tree_mask, block_table)
        return self.target.logits(hidden), features

    def target_pass(self, *args) -> tuple[torch.Tensor, torch.Tensor | None]:
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
    def _read_step(result: VerifyResult, parents: torch.Tensor | None = None) -> tuple[list, list, list, list]:
        """The step's one device -> host read, in one copy: emitted tokens [B][T] and their counts [B]; with a tree's
        ``parents`` [B, T] (a step the controller priced by width), its accepted nodes [B][T] and those parents
        ([] each without)."""
        T = result.output_tokens.shape[1]
        parts = [result.output_tokens, result.num_accepted[:, None]]
        if parents is not None:
            parts += [result.accepted_nodes, parents]
        rows = torch.cat(parts, dim=1).tolist()  # [B, T + 1 (+ 2T)]
        tokens, counts = [r[:T] for r in rows], [r[T] for r in rows]
        if parents is None:
            return tokens, counts, [], []
        return tokens, counts, [r[T + 1 : 2 * T + 1] for r in rows], [r[2 * T + 1 :] for r in rows]

    def block_table(self, reqs: list[Request], max_pos: int) -> torch.Tensor:
        """[B, W] int32 host rows covering positions < max_pos (padding is the scratch block)."""
        slots = [r.slot for r in reqs]
        if min(slots) < 0:  # a finished request: row -1 is another request's, whose K/V its step would overwrite
            raise RuntimeError("a step was given a finished request (it holds no blocks)")
        width = min(-(-max_pos // self.block_size), self.rows.block_table.shape[1])
        return self.rows.block_table[slots, :width]
