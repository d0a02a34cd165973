"""CPU threads per decode step, chosen by measurement: all of them when the cores are free, one when they are busy.

Why: every matmul of a forward is an OpenMP region, and a region ends only when all its threads have finished. When
other processes keep the cores busy, one of our threads is often preempted and the region waits a scheduler slice
for it: on a 2-core machine running two other busy processes the default target's forward became two orders of
magnitude slower with 2 threads, while 1 thread stayed near its quiet-machine time. On a quiet machine 2 threads
are faster. Which is better depends on a load we cannot see, so we measure it.

How: decode steps run with the current choice ("many": the caller's ``torch.get_num_threads()``, or "one"). A probe
runs the next ``PROBE_STEPS`` steps with the other choice, and the tuner switches if they cost MIN_GAIN less than
the current choice's cheapest of its last ``PROBE_STEPS`` measurements (adjacent windows, so the batch is about the
same; the cheapest, since load only slows a step: ``_decide``). A measurement is one decode call: a native call of
several steps (spec_engine/runner.py) is one, at its cost per step, and counts its steps toward the intervals and
the probe's length; a probe's first call runs ``LOSS_STEPS`` steps, its next the rest. (Counted in calls, the
intervals stretched by a native chain's length, and after a busy stretch a quiet machine's engine decoded the rest
of a benchmark run on one thread: bench/RESULTS-log.md, "A thread tuner that counts steps".) Probes come at step
``FIRST_INTERVAL`` (a run that starts on busy cores learns it at once), then every ``INTERVAL`` steps, doubling with
every lost probe up to ``MAX_INTERVAL``, and at once when most of the last few steps on many threads took ``SPIKE``
times their median (the cores just turned busy). A probe that is plainly losing (one step 3x the current choice's
median, or its first two steps both slower) ends early: on a quiet machine probing costs a few steps in a thousand.
The engine applies the choice around the decode part of a step only and restores the caller's count after it, so
nothing outside the step (the caller's own torch code, another engine) sees a changed setting.

Measured with ``specdec generate --prompt "import os" --max-tokens 250 --method none`` (figures: bench/RESULTS-log.md,
2026-11-23 "decode threads by measurement"): on busy cores the tuner recovers one to two orders of magnitude; on
a quiet machine it costs nothing measurable (probes lose after two steps and back off, and its bookkeeping is a few
comparisons a step).
"""

from __future__ import annotations

import statistics

PROBE_STEPS = 8  # steps per measurement window
FIRST_INTERVAL = 16  # steps before the first probe: a run that starts on busy cores learns it at once
INTERVAL = 256  # steps between probes after the first, and after a switch; doubled by every lost probe
MAX_INTERVAL = 4096
SPIKE = 3.0  # steps on many threads this many times their median start a probe at once (the cores turned busy)...
SPIKE_STEPS = 3  # ... when most of the last this-many steps are such
MIN_GAIN = 1.1  # the probed choice must be this much faster to take over: noise must not flip it back and forth
LOSS_STEPS = 2  # a probe whose first this many steps were all slower than MIN_GAIN x the current choice ends there
EARLY_LOSS = 3.0  # a probe step this many times the current choice's median ends the probe at once, as lost: a
# probe of many threads on busy cores costs about two orders of magnitude more than a step (bench/RESULTS-log.md,
# 2026-11-23 "decode threads by measurement"), and 8 of them would cost more than the switch saves. LOSS_STEPS probe
# steps all slower than MIN_GAIN x it end it too (one thread on a quiet machine loses by more than that margin:
# bench/RESULTS-log.md, "Figures moved from code comments (2026-11-26)"); a probe's first native call runs only those


class ThreadTuner:
    """Chooses "many" or "one" CPU threads for decode steps by paired probes (see the module doc). It reads no
    clock: the engine times each decode step and feeds ``after_step(seconds, kind, steps)``; tests feed costs.

    ``kind`` names the step's shape (the engine's: its depth, its tree's width and size, and whether a draft caught up
    on a prompt). Costs are compared within a kind only: under the adaptive controller a depth-7 step costs far more
    than a depth-1 step, and windows mixing them read a run of deep steps as cores turning busy and a probe's shallow
    steps as one thread winning (2 runs in 6 then decoded on one thread, slower than plain decoding for the whole
    run: bench/RESULTS-log.md, "Adaptive steps, draft vocabulary" and "Figures moved from code comments
    (2026-11-26)"); so do a chain and a tree of one depth (tree="auto"). A probe whose steps share no kind with the
    current choice's recent steps decides nothing and is retried soon (``_decide``)."""

    def __init__(self) -> None:
        self.single = False  # the current choice
        self.interval = FIRST_INTERVAL
        self.steps_since_probe = 0
        self.probing = 0  # steps left in the running probe
        self.probe_slow = True  # every step of the running probe so far was slower than MIN_GAIN x the current choice
        # per choice and kind, the last PROBE_STEPS costs; the probed choice's windows hold the running probe only
        self.times: dict[bool, dict[object, list[float]]] = {False: {}, True: {}}
        self.steps_on_one = 0  # decode steps run on one thread, probes included (a benchmark reports their share)

    def single_for_step(self) -> bool:
        """Whether the coming decode step runs on one thread."""
        return self.single != bool(self.probing)

    def probe_call_steps(self) -> int:
        """The most steps the coming decode call may run while a probe is on: its first LOSS_STEPS (a probe slower in
        all of them ends there, so a losing probe costs a few steps, not a native chain's), then the rest of it."""
        done = PROBE_STEPS - self.probing
        return LOSS_STEPS - done if done < LOSS_STEPS else self.probing

    def after_step(self, seconds: float, kind: object = None, steps: int = 1) -> None:
        """One decode call ran ``steps`` steps of ``kind`` at ``seconds`` per step."""
        single = self.single_for_step()
        self.steps_on_one += steps if single else 0
        window = self.times[single].setdefault(kind, [])
        window.append(seconds)
        del window[:-PROBE_STEPS]
        ours = self.times[self.single].get(kind, [])
        if self.probing:
            self.probing = max(self.probing - steps, 0)
            done = PROBE_STEPS - self.probing  # probe steps so far
            if ours:
                typical = statistics.median(ours)
                self.probe_slow = self.probe_slow and seconds > MIN_GAIN * typical
                if seconds > EARLY_LOSS * typical or (done >= LOSS_STEPS and self.probe_slow):
                    self.probing, self.interval = 0, self._longer()  # lost, before its end
                    return
            if self.probing == 0:
                self._decide()
            return
        self.steps_since_probe += steps
        if len(ours) < PROBE_STEPS:
            return
        if not self.single and seconds > SPIKE * min(ours) and self._spiking(ours):  # min: a cheap pre-check
            # the cores turned busy: judge many threads by their slow last steps, not by the quiet ones before
            typical = statistics.median(ours)
            self.times[False] = {kind: [t for t in ours[-SPIKE_STEPS:] if t > SPIKE * typical]}
            self.steps_since_probe = self.interval
        if self.steps_since_probe >= self.interval:
            self.probing, self.steps_since_probe, self.probe_slow = PROBE_STEPS, 0, True
            self.times[not self.single] = {}

    @staticmethod
    def _spiking(window: list[float]) -> bool:
        """Whether most of the last SPIKE_STEPS steps took SPIKE times the window's median: a lasting change, not one
        slow step (a page fault, a collection) that a probe would misread."""
        typical = statistics.median(window)
        return sum(t > SPIKE * typical for t in window[-SPIKE_STEPS:]) * 2 > SPIKE_STEPS

    def _longer(self) -> int:
        return min(max(self.interval * 2, INTERVAL), MAX_INTERVAL)

    def _decide(self) -> None:
        """Switch if the probed choice was MIN_GAIN faster: the median, over the probe's steps, of each step's cost
        relative to the current choice's cheapest recent one of its kind (kinds with fewer than 2 such samples left
        out, so a kind seen once does not weigh as much as one seen 8 times). The cheapest, not the median: load
        only slows a step, and a window whose steps ran while other work held the cores, followed by a probe in a
        quiet moment, read one thread as the faster and switched a quiet machine to it (the engine's trace:
        bench/RESULTS-log.md, "A thread tuner that counts steps"). A probe that shares no kind
        decides nothing: another comes after 2 * PROBE_STEPS steps, the interval unchanged (were it lost and the
        interval doubled, a depth change at the moment the cores turned busy kept all threads on for ~1000 steps)."""
        ours, theirs = self.times[self.single], self.times[not self.single]
        ratios = [t / min(ours[k]) for k, ts in theirs.items() if len(ours.get(k, ())) >= 2 for t in ts]
        if not ratios:
            self.steps_since_probe = max(self.interval - 2 * PROBE_STEPS, 0)
        elif statistics.median(ratios) * MIN_GAIN < 1.0:
            self.single, self.interval = not self.single, INTERVAL
        else:
            self.interval = self._longer()
