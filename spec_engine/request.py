"""A request's life in the engine: its state (``Request``: tokens, lengths, blocks, parameters), its metrics, its rows
in the engine's persistent per-slot buffers (``RequestRows``), and what a step returns for it (``StepOutput``)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from spec_engine.adaptive import RowState
from spec_engine.drafters.base import RowView
from spec_engine.kv_cache import SCRATCH_BLOCK
from spec_engine.sampling import SamplingParams, stop_string_end
from spec_engine.structured import MAX_FORCED_DRAFT, GrammarState


@dataclass
class RequestMetrics:
    num_steps: int = 0  # target passes while decoding
    num_drafted: int = 0  # tree depth asked per step, summed: the chances to accept
    num_accepted: int = 0  # drafted tokens the target kept
    accepted_hist: list[int] = field(default_factory=list)  # [k] = steps that accepted k drafts
    gamma_hist: list[int] = field(default_factory=list)  # [gamma] = steps this request was drafted at depth gamma
    alpha_estimate: float | None = None  # the adaptive controller's smoothed acceptance rate (None when fixed)
    arrival_time: float = 0.0
    first_token_time: float | None = None
    decode_start: float | None = None  # when the prompt's last prefill chunk was done
    num_cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache (not computed)
    num_preemptions: int = 0  # times its blocks were taken for older requests (it was prefilled again after)
    finish_time: float | None = None

    def as_dict(self, num_output_tokens: int) -> dict:
        end = self.finish_time or time.perf_counter()
        elapsed = end - self.arrival_time
        decoding = end - self.decode_start if self.decode_start is not None else 0.0
        return {
            "num_steps": self.num_steps,
            "num_drafted": self.num_drafted,
            "num_accepted": self.num_accepted,
            "acceptance_rate": self.num_accepted / self.num_drafted if self.num_drafted else 0.0,
            "mean_accepted_length": num_output_tokens / self.num_steps if self.num_steps else 0.0,  # tau
            "accepted_length_hist": list(self.accepted_hist),
            "num_cached_tokens": self.num_cached_tokens,
            "num_preemptions": self.num_preemptions,
            "gamma_hist": list(self.gamma_hist),
            "alpha_estimate": self.alpha_estimate,
            # (None for a request that ended before its first token: aborted, failed)
            "time_to_first_token": None if self.first_token_time is None else self.first_token_time - self.arrival_time,
            "elapsed": elapsed,
            "tokens_per_s": num_output_tokens / elapsed if elapsed > 0 else 0.0,
            # generation alone (prompt processing and queueing left out): what llama.cpp's "decoded N tokens in S
            # seconds" and llama-bench -n report
            "decode_tokens_per_s": num_output_tokens / decoding if decoding > 0 else 0.0,
        }


TRUST_PRIOR = 2.0  # expected tokens at ratio 1 a request's score trust starts from: a few failed drafts undo it
TRUST_DECAY = 0.8  # per suffix-drafted step: the trust follows the text (a code block after prose) within ~5 steps


@dataclass
class ScoreTrust:
    """accepted / expected drafted tokens of a request's suffix speculations, forgetful, shrunk toward 1: a match
    score (the speculation's estimated probabilities, summed) promises as much on chat prose, where a 1-2 token
    suffix recurs with any continuation, as on a passage repeated verbatim; the scores' own scale cannot tell the
    two apart, what the rows accepted can."""

    accepted: float = 0.0
    expected: float = 0.0

    @property
    def value(self) -> float:
        return (self.accepted + TRUST_PRIOR) / (self.expected + TRUST_PRIOR)

    def observe(self, expected: float, accepted: int) -> None:
        """A suffix-drafted step whose speculation's raw score was ``expected`` kept ``accepted`` drafted
        tokens."""
        self.accepted = TRUST_DECAY * self.accepted + accepted
        self.expected = TRUST_DECAY * self.expected + expected


class TokenLogprobs(NamedTuple):
    """One emitted (or prompt) token's log-probability under the target and the ``k`` most likely tokens' (their ids
    and log-probabilities, in rank order), as a step reads them (``spec_engine.logprobs.token_logprobs``)."""

    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    output_token_ids: list[int] = field(default_factory=list)
    # per output token, where the request asks (params.logprobs): {token: its log-probability, then its
    # params.logprobs most likely alternatives: theirs, in rank order}
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    # the same per prompt token where it asks (params.prompt_logprobs), None for the first (nothing precedes it)
    prompt_logprobs: list[dict[int, float] | None] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    cache_seqlen: int = 0  # L: positions whose K/V are committed in the target cache
    draft_len: int = 0  # the same for the drafter's cache (what its last commit returned)
    finish_reason: str | None = None
    error: str | None = None  # why the engine failed this request (finish_reason "error")
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    spec_state: RowState | None = None  # the adaptive controller's estimates for this request
    slot: int = -1  # this request's row in the engine's RequestRows while it runs
    score_trust: ScoreTrust = field(default_factory=ScoreTrust)  # what its suffix speculations kept (RowView)
    key: int = 0  # the engine's own name for it, never reused (request ids are the caller's): RowView.key
    stop_ids: frozenset[int] = frozenset()  # the tokens that end it (RequestLimits.stop_ids: stop_token_ids, EOS)
    grammar: GrammarState | None = None  # its guided_json / guided_regex / guided_grammar, following the output
    block_keys: list[bytes] | None = None  # its prefix-cache keys (BlockAllocator.keys) of the tokens its prefill
    # computes: its prompt's, computed at its first admission; after a preemption its output's too
    coupled: bool = False  # sampled through the position-keyed coupling (SamplingParams.coupled, or the engine's
    # choice for unseeded requests: EngineConfig.couple_unseeded)
    history: np.ndarray = field(init=False, repr=False)  # [capacity] int64: prompt then output tokens
    num_tokens: int = field(init=False)  # filled length of history

    def __post_init__(self):
        self.history = np.zeros(len(self.prompt_token_ids) + self.params.max_tokens, dtype=np.int64)
        self.history[: len(self.prompt_token_ids)] = self.prompt_token_ids
        self.num_tokens = len(self.prompt_token_ids)
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]  # the first token: nothing precedes it (the prefill adds the others')

    @staticmethod
    def logprobs_entry(token: int, logprobs: TokenLogprobs, k: int) -> dict[int, float]:
        """{token: its log-probability, then the ``k`` most likely others': theirs}."""
        top = zip(logprobs.top_ids[:k], logprobs.top_logprobs[:k])
        return {token: logprobs.logprob, **{i: v for i, v in top if i != token}}

    def append(self, tokens: list[int], logprobs: list[TokenLogprobs] | None = None) -> None:
        """Emitted ``tokens``; ``logprobs`` theirs (``StepResult.logprobs``), kept where the request asks."""
        k = self.params.logprobs
        if k is not None:
            if logprobs is None or len(logprobs) != len(tokens):
                raise RuntimeError(f"request {self.request_id} asks for logprobs but its step returned none")
            self.output_logprobs += [self.logprobs_entry(t, row, k) for t, row in zip(tokens, logprobs)]
        self.output_token_ids.extend(tokens)
        self.history[self.num_tokens : self.num_tokens + len(tokens)] = tokens
        self.num_tokens += len(tokens)

    @property
    def text_token_ids(self) -> list[int]:
        """The output tokens its text shows: all but a stop token that ended it (EOS, ``stop_token_ids``), whose
        text is left out unless ``include_stop_str_in_output`` (vLLM's)."""
        ids = self.output_token_ids
        if (self.finish_reason == "stop" and ids and ids[-1] in self.stop_ids
                and not self.params.include_stop_str_in_output):  # fmt: skip
            return ids[:-1]
        return ids

    def cut_at_stop(self, toks: list[int], detokenize) -> tuple[list[int], bool]:
        """Cut tokens a decode call emitted at a stop token (kept, as vLLM does for EOS), at the token whose text
        completes a stop string (kept; the text ends before the string: ``visible_text``) or at max_tokens: what
        decoding one token a step would have emitted; and whether it stopped. ``detokenize``: the engine's."""
        toks = toks[: self.tokens_left]
        completes = stop_string_end(self.params, self.output_token_ids, toks, detokenize, self.prompt_token_ids)
        for i, t in enumerate(toks):
            if t in self.stop_ids or i + 1 == completes:
                return toks[: i + 1], True
        return toks, False

    @property
    def tokens_left(self) -> int:
        """Output tokens this request may still emit (max_tokens minus those emitted)."""
        return self.params.max_tokens - len(self.output_token_ids)

    @property
    def processes_logits(self) -> bool:
        """Whether a logits processor changes this request's logits from its next token on: ``min_tokens`` only until
        that many tokens are out (past them it holds nothing back, and the request takes the native calls as one
        without it does: ``StepRunner.plan``)."""
        p = self.params
        return p.processes_logits_past_min_tokens or p.min_tokens > len(self.output_token_ids)

    @property
    def last_token(self) -> int:
        return int(self.history[self.num_tokens - 1])

    def view(self) -> RowView:
        tokens = self.history[: self.num_tokens]
        tokens.flags.writeable = False  # a view: the drafter reads, the engine writes
        forced = ()
        if self.grammar is not None and not self.prefilling and not self.finished:
            forced = self.grammar.forced(tokens[len(self.prompt_token_ids) :], MAX_FORCED_DRAFT)
        return RowView(tokens, self.cache_seqlen, self.draft_len, self.params.greedy, self.key,
                       len(self.prompt_token_ids), self.score_trust.value, self.coupled, forced,
                       max(self.tokens_left - 1, 0))  # fmt: skip

    @property
    def prefilling(self) -> bool:
        """Whether K/V is still to be computed before its root (the last token): its prompt's, or after a
        preemption its output's too."""
        return self.cache_seqlen < self.num_tokens - 1

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class StepOutput:
    request: Request
    new_token_ids: list[int]
    finished: bool


class RequestRows:
    """Per-request step inputs in persistent host rows ``[max_num_seqs, ...]`` (vLLM's input batch), filled once at
    admission; a step gathers its rows and sends them to the device in one copy per dtype (``to_device``).

    Shapes: block_table [S, max_blocks] int32 (padded with the scratch block); temperature, top_p, min_p [S] float32;
    top_k [S] int64.
    """

    def __init__(self, max_num_seqs: int, max_blocks: int):
        self.block_table = torch.full((max_num_seqs, max_blocks), SCRATCH_BLOCK, dtype=torch.int32)
        self.temperature = torch.zeros(max_num_seqs, dtype=torch.float32)
        self.top_k = torch.zeros(max_num_seqs, dtype=torch.int64)
        self.top_p = torch.ones(max_num_seqs, dtype=torch.float32)
        self.min_p = torch.zeros(max_num_seqs, dtype=torch.float32)
        self._free = list(range(max_num_seqs - 1, -1, -1))

    def admit(self, req: Request) -> int:
        slot = self._free.pop()
        p = req.params
        self.set_blocks(slot, req.blocks)
        self.temperature[slot], self.top_k[slot], self.top_p[slot], self.min_p[slot] = (
            p.temperature,
            p.top_k,
            p.top_p,
            p.min_p,
        )
        return slot

    def set_blocks(self, slot: int, blocks: list[int]) -> None:
        """The request in ``slot`` now holds ``blocks`` (as it grows or returns unwritten ones); past them, scratch."""
        self.block_table[slot] = SCRATCH_BLOCK
        self.block_table[slot, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)

    def release(self, slot: int) -> None:
        self._free.append(slot)
