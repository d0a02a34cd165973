"""What a decode call is planned to run (``StepPlan``) and what it, or a prefill chunk, did (``StepResult``,
``PrefillChunk``): the values that pass between the engine (spec_engine/engine.py) and its step runner
(spec_engine/runner.py)."""

from __future__ import annotations

from dataclasses import dataclass

from spec_engine.request import TokenLogprobs

# the paths a decode call takes (``StepPlan.path``)
PLAIN_CHAIN = "plain_chain"  # K plain steps in one native call (plain_steps, or spec_chain at depth 0)
SPEC_CHAIN = "spec_chain"  # up to K speculative steps in one native call (spec_chain)
REGULAR = "regular"  # one step driven from Python (draft, target pass, verify_tree, compaction; or tree_step)


@dataclass(frozen=True)
class StepPlan:
    """What one decode call runs, decided once (``StepRunner.plan``) and recorded in its ``StepResult``.

    ``path``: PLAIN_CHAIN, SPEC_CHAIN or REGULAR; ``steps``: the most steps the call runs (a native call ends early
    at a stop token, a non-finite step or, with ``stop_on_reject``, a step where some row accepted nothing; REGULAR
    runs 1); ``gamma``: a spec chain's depth; ``full_steps``: the steps of a full call, over which a native call's own
    work is priced (``chain_step_costs``); ``native_verify``: a regular step of greedy rows with a deterministic tree
    verifies in one native call (``tree_step``); ``logprobs``: the regular step returns the emitted tokens'
    log-probabilities with this many alternatives (the native calls return none). ``fallback_from``: on a REGULAR
    plan as it ran, the native path that was planned and stepped aside (its first step's logits not finite).
    ``steps_ran``: on a plan as it ran (``Engine.plan_history``), the steps the call ran (None before it runs).
    ``width``: the drafted steps' tree width where the adaptive controller chooses it (``tree="auto"``: 1 a chain,
    k EAGLE-2's dynamic tree of k nodes a level; ``Drafter.tree_for``); 0: the drafter's own tree.
    """

    path: str
    steps: int = 1
    gamma: int = 0
    full_steps: int = 0
    stop_on_reject: bool = False
    native_verify: bool = False
    logprobs: int | None = None
    fallback_from: str | None = None
    steps_ran: int | None = None
    width: int = 0


@dataclass
class PrefillChunk:
    """What one prefill chunk computed (``StepRunner.prefill``), for ``Engine._prefill`` to commit: per row, the
    positions computed and the prompt tokens' ``prompt_logprobs`` entries it scored."""

    counts: list[int]
    prompt_logprobs: list[list[dict[int, float]]]


@dataclass
class StepResult:
    """What one decode call did, for ``Engine._apply`` to commit once: the regular step (one step), a plain chain
    (K one-token steps in one native call) or a spec chain (several drafted steps in one native call).

    ``tokens[b]``: every token row b emitted in the call, in order (each step's accepted path and its recovered or
    bonus token). Per step s the call ran: ``gammas[s]`` [B] each row's depth (0: undrafted), ``counts[s]`` [B] the
    tokens each row emitted in it, ``times[s]`` (draft seconds, whole step seconds) as measured. ``draft_lens`` [B]:
    the drafter caches' lengths after the call (what ``Drafter.commit`` returns; None: unchanged). A native call's own
    work (inputs, dispatch, committing) is spread over ``full_steps`` steps from ``start`` (``chain_step_costs``; 0:
    the times are final). ``learned`` [S][B]: the depths the controller learns acceptance from (None: ``gammas``; a
    hybrid's suffix rows say nothing of its model drafter; nor do a suffix drafter's), ``widths[s]``: the tokens step s
    verified in its target pass (B * T, T the step's widest tree; None: the depths' trees, ``nodes_for_gamma``).
    ``logprobs[b]`` (the regular step, when asked): per token of ``tokens[b]``, its ``TokenLogprobs`` under the target's
    distribution at its parent node. ``ranks[s][b]`` (steps of width > 1 only): row b's accepted path's ranks in
    step s (``spec_engine.tree.path_ranks``), what a chain would have kept (the adaptive controller's evidence).
    ``plan``: the call's ``StepPlan`` as it ran (REGULAR where a planned native call
    found its first step's logits not finite).
    """

    gammas: list[list[int]]
    tokens: list[list[int]]
    counts: list[list[int]]
    times: list[list[float]]
    draft_lens: list[int] | None = None
    start: float = 0.0
    full_steps: int = 0
    learned: list[list[int]] | None = None
    widths: list[int] | None = None
    logprobs: list[list[TokenLogprobs]] | None = None
    ranks: list[list[list[int]]] | None = None
    plan: StepPlan | None = None
