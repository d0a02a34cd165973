"""ThreadTuner: the choice of CPU threads per decode step, fed injected step costs (no wall clock)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import make_model

import spec_engine.runner as runner_mod
from spec_engine import LLM, SamplingParams
from spec_engine.step import PLAIN_CHAIN
from spec_engine.threads import FIRST_INTERVAL, INTERVAL, MAX_INTERVAL, PROBE_STEPS, ThreadTuner


def run(tuner: ThreadTuner, steps: int, cost_many: float, cost_one: float, per_call: int = 1) -> list[bool]:
    """Feed ``steps`` decode calls of ``per_call`` steps (a native chain's) costing ``cost_many`` / ``cost_one``
    seconds a step; return the choices made."""
    chosen = []
    for _ in range(steps):
        single = tuner.single_for_step()
        chosen.append(single)
        tuner.after_step(cost_one if single else cost_many, None, per_call)
    return chosen


def test_a_quiet_machine_keeps_all_threads_and_probes_ever_less():
    tuner = ThreadTuner()
    chosen = run(tuner, 5000, cost_many=1.0, cost_one=1.4)
    assert not tuner.single
    probes = sum(chosen)
    # probes at FIRST_INTERVAL, then INTERVAL, 2x, 4x ... apart, each lost after 2 steps: a few steps in a thousand
    assert 0 < probes <= 2 * (2 + (MAX_INTERVAL // INTERVAL).bit_length())
    assert tuner.interval == MAX_INTERVAL
    assert tuner.steps_on_one == probes  # the count a benchmark reports: here the probes' steps alone


def test_steps_on_one_thread_counts_a_native_calls_steps():
    tuner = ThreadTuner()
    chosen = run(tuner, 40, cost_many=50.0, cost_one=1.0, per_call=4)  # busy cores: one thread from the probe on
    assert tuner.single and 0 < sum(chosen) < 40
    assert tuner.steps_on_one == 4 * sum(chosen)  # steps, not calls


def test_busy_cores_switch_to_one_thread_within_one_probe_and_back_when_they_free_up():
    tuner = ThreadTuner()
    run(tuner, 100, cost_many=1.0, cost_one=1.4)  # quiet: stays
    assert not tuner.single
    chosen = run(tuner, 2 * PROBE_STEPS, cost_many=50.0, cost_one=1.5)  # preempted threads: two slow steps probe
    assert tuner.single and chosen.index(True) == 2
    chosen = run(tuner, 2 * MAX_INTERVAL, cost_many=1.0, cost_one=1.4)  # the load is gone
    assert not tuner.single and not chosen[-1]


def test_a_native_calls_steps_count_toward_the_intervals():
    """Native chains decode 16 steps a call: the intervals count those steps, so an engine whose cores freed up is
    back on all threads within INTERVAL steps. Counted in calls, that was 16x longer, and a probe that won kept a
    quiet machine's engine on one thread through the rest of a benchmark run."""
    tuner = ThreadTuner()
    run(tuner, 8, cost_many=1.0, cost_one=1.9, per_call=16)
    busy = run(tuner, 8, cost_many=50.0, cost_one=1.9, per_call=16)
    assert tuner.single and busy.index(True) <= 3
    quiet = run(tuner, 4 * INTERVAL // 16, cost_many=1.0, cost_one=1.9, per_call=16)  # the load is gone
    back = quiet.index(False)
    assert not tuner.single and back <= (INTERVAL + PROBE_STEPS) // 16 + 1  # calls until the probe of many threads
    # and on a quiet machine the probes of one thread stay rare in steps: one 16-step call each, doubling apart
    chosen = run(tuner, 8 * MAX_INTERVAL // 16, cost_many=1.0, cost_one=1.9, per_call=16)
    assert not tuner.single and sum(chosen) * 16 <= 0.01 * len(chosen) * 16


def test_a_probe_in_a_quiet_moment_after_a_busy_stretch_keeps_all_threads():
    """Calls of many threads slowed by other work, then the cores free up as the probe of one thread runs: the probe
    is compared with many threads' cheapest recent call, not with the stretch's median (which read one thread as 2x
    faster and switched a quiet machine to it: the engine's trace, bench/RESULTS-log.md, "A thread tuner that counts
    steps")."""
    tuner = ThreadTuner()
    costs = [1.0, 6.5, 3.9, 3.7, 4.0, 4.2, 3.2, 1.05]  # the traced calls' cost a step, in quiet steps' units
    for cost in costs:
        assert not tuner.probing
        tuner.after_step(cost, None, 16)
    assert tuner.probing and tuner.single_for_step()
    tuner.after_step(1.75, None, 16)  # one thread on the quiet machine
    assert not tuner.single


def test_one_slow_step_is_not_a_busy_machine():
    """A lone slow step (a page fault, a collection) starts no probe; a lasting slowdown does."""
    tuner = ThreadTuner()
    run(tuner, 40, cost_many=1.0, cost_one=1.4)
    probing_before = tuner.steps_since_probe
    tuner.after_step(60.0)
    assert not tuner.probing and tuner.steps_since_probe == probing_before + 1
    run(tuner, 100, cost_many=1.0, cost_one=1.4)
    assert not tuner.single


def test_noise_within_the_margin_never_switches():
    tuner = ThreadTuner()
    chosen = run(tuner, 3000, cost_many=1.0, cost_one=0.95)  # one thread 5% faster: inside MIN_GAIN
    assert not tuner.single and sum(chosen) <= (2 + (MAX_INTERVAL // INTERVAL).bit_length()) * PROBE_STEPS  # probes


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("threads") / "t", "llama_gqa", logit_scale=4.0)


def test_engine_decodes_on_the_chosen_threads_and_restores_the_callers(target, monkeypatch):
    torch.set_num_threads(2)
    llm = LLM(str(target))
    seen = []

    def spy(real):
        def run(*args, **kwargs):
            seen.append(torch.get_num_threads())
            return real(*args, **kwargs)

        return run

    monkeypatch.setattr(llm.engine.target, "forward", spy(llm.engine.target.forward))  # the prefill's forward
    monkeypatch.setattr(runner_mod, "plain_steps", spy(runner_mod.plain_steps))  # the decode steps' native chains
    monkeypatch.setattr(llm.engine.threads, "single_for_step", lambda: True)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    single = llm.generate([{"prompt_token_ids": [1, 2, 3]}], params, use_tqdm=False)[0].outputs[0].token_ids
    assert seen[0] == 2 and set(seen[1:]) == {1}  # the prefill on the caller's threads, decode steps on one
    assert torch.get_num_threads() == 2  # restored
    monkeypatch.setattr(llm.engine.threads, "single_for_step", lambda: False)
    seen.clear()
    many = llm.generate([{"prompt_token_ids": [1, 2, 3]}], params, use_tqdm=False)[0].outputs[0].token_ids
    assert set(seen) == {2} and many == single  # results never depend on the thread count


def test_a_probes_native_calls_run_its_first_steps_then_the_rest(target, monkeypatch):
    """A probe's first call runs LOSS_STEPS steps (a probe slower in all of them ends there, so a losing probe costs
    a few steps of the other thread count, not a 16-step chain), the next the rest of its PROBE_STEPS, then chains
    run whole again."""
    from spec_engine.threads import LOSS_STEPS

    torch.set_num_threads(2)
    llm = LLM(str(target))
    tuner = llm.engine.threads
    tuner.probing, tuner.interval = PROBE_STEPS, 10**9  # a probe starts now; no other comes
    tuner.times = {False: {(0, 0, 1, False): [1.0] * PROBE_STEPS}, True: {}}  # the probe is never slower: it runs whole
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], params, use_tqdm=False)
    lengths = [p.steps for p in llm.engine.plan_history if p.path == PLAIN_CHAIN]
    assert lengths[:3] == [LOSS_STEPS, PROBE_STEPS - LOSS_STEPS, llm.engine.config.plain_chain], lengths
    assert torch.get_num_threads() == 2


def test_a_thread_probes_steps_price_nothing(target):
    """Decode calls run while the tuner probes the other thread count teach the adaptive controller their
    acceptance, not their costs (a probe's single-thread steps priced a depth at 2x for the rest of a run); the
    same calls outside a probe do (the control)."""
    torch.set_num_threads(2)
    draft = {"method": "draft_model", "model": str(target)}  # (the target as its own draft: every draft accepted)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    counts = {}
    for probing in (10**6, 0):
        llm = LLM(str(target), speculative_config=draft)
        llm.engine.threads.probing = probing  # every call of the run is a probe's (or none is)
        llm.engine.threads.interval = 10**6
        llm.generate([{"prompt_token_ids": [1, 2, 3]}], params, use_tqdm=False)
        controller = llm.engine.controller
        counts[probing] = (controller.target_cost.num_observed, controller.population.num_trials)
    assert counts[10**6][0] == 0 and counts[10**6][1] > 0  # acceptance learned, no cost
    assert counts[0][0] > 0


def test_a_hopeless_probe_ends_after_one_step():
    """On busy cores a probe of many threads costs ~100x a step: one such step ends it, as lost."""
    tuner = ThreadTuner()
    run(tuner, FIRST_INTERVAL + PROBE_STEPS, cost_many=50.0, cost_one=1.5)  # busy from the start: no spike to see
    assert tuner.single  # switched at the first probe
    chosen = run(tuner, 4 * MAX_INTERVAL, cost_many=50.0, cost_one=1.5)
    probes = [i for i in range(1, len(chosen)) if not chosen[i] and chosen[i - 1]]
    assert probes and all(chosen[i + 1] for i in probes if i + 1 < len(chosen))  # every probe lasted one step


def test_a_probe_slower_in_its_first_two_steps_ends_there():
    """One thread on a quiet machine (1.4x a step) loses its probes after two steps, not eight."""
    tuner = ThreadTuner()
    chosen = run(tuner, 1000, cost_many=1.0, cost_one=1.4)
    runs, length = [], 0
    for single in chosen + [False]:
        if single:
            length += 1
        elif length:
            runs.append(length)
            length = 0
    assert runs and set(runs) == {2} and not tuner.single


def run_kinds(tuner: ThreadTuner, schedule: list[str], costs: dict[str, float], slow_one: float, kinds: bool):
    """Feed steps of the kinds in ``schedule``: ``costs[kind]`` on many threads, ``slow_one`` x that on one."""
    for kind in schedule:
        single = tuner.single_for_step()
        tuner.after_step(costs[kind] * (slow_one if single else 1.0), kind if kinds else None)


# The adaptive controller's steps: depth-1 steps cost 1, depth-7 steps 2.5, in stretches; the first probe lands on
# depth-1 steps right after depth-7 ones, and one thread is 1.4x slower at each depth: it must not look faster.
MIXED = ["shallow"] * 8 + ["deep"] * 8 + ["shallow"] * 100
STEP_COSTS = {"deep": 2.5, "shallow": 1.0}


def test_steps_of_different_depths_compare_within_their_kind():
    tuner = ThreadTuner()
    run_kinds(tuner, MIXED, STEP_COSTS, slow_one=1.4, kinds=True)
    assert not tuner.single and tuner.interval > FIRST_INTERVAL  # the probe ran and lost


def test_planted_bug_kinds_ignored_one_thread_looks_faster():
    """The comparison can fail: the same steps without their kinds (costs across depths compared) switch to one
    thread, as the engine did before it passed kinds (0.66-0.77x plain decoding for the rest of a run)."""
    tuner = ThreadTuner()
    run_kinds(tuner, MIXED, STEP_COSTS, slow_one=1.4, kinds=False)
    assert tuner.single


def test_busy_cores_still_switch_with_kinds():
    tuner = ThreadTuner()
    run_kinds(tuner, MIXED[:64], STEP_COSTS, slow_one=1.4, kinds=True)
    assert not tuner.single
    busy = ["shallow", "deep"] * 2 * PROBE_STEPS  # preempted threads: every step ~50x, one thread ~1.5x
    run_kinds(tuner, busy, {"deep": 125.0, "shallow": 50.0}, slow_one=0.03, kinds=True)
    assert tuner.single


def test_cores_turning_busy_as_the_depth_changes_still_switch():
    """The spike keeps only its own kind's steps; a probe that then sees other kinds decides nothing and is
    retried soon, instead of counting as lost (which kept all threads on for ~1000 busy steps)."""
    tuner = ThreadTuner()
    run_kinds(tuner, ["depth 3"] * 300, {"depth 3": 1.0}, slow_one=1.4, kinds=True)
    assert not tuner.single
    busy = ["depth 3"] * 2 + ["plain"] * 200  # the cores turn busy, and the controller moves to plain chains
    run_kinds(tuner, busy, {"depth 3": 50.0, "plain": 40.0}, slow_one=0.03, kinds=True)
    assert tuner.single


def test_a_kind_seen_once_does_not_outvote_one_seen_often():
    """Each probe step votes; a kind with a single sample on the current choice (a long prompt's catch-up, say)
    is left out: its one cheap probe step must not switch to one thread that is 1.4x slower everywhere else."""
    tuner = ThreadTuner()
    run_kinds(tuner, ["depth 1"] * 8, {"depth 1": 1.0}, slow_one=1.4, kinds=True)
    tuner.after_step(10.0, "catch-up")  # many threads, a 10x longer prompt than the probe's
    while not tuner.probing:
        tuner.after_step(1.0, "depth 1")
    tuner.after_step(2.0, "catch-up")  # the probe's first step: one thread, a short catch-up
    while tuner.probing:
        tuner.after_step(1.4 if tuner.single_for_step() else 1.0, "depth 1")
    assert not tuner.single
