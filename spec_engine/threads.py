"""CPU threads per decode step, chosen by measurement: all of them when the cores are free, one when they are busy.

Why: every matmul of a forward is an OpenMP region, and a region ends only when all its threads have finished. When
other processes keep the cores busy, one of our threads is often preempted and the region waits a scheduler slice
for it: the default target's forward went from ~0.6 ms to ~125 ms with 2 threads on a 2-core machine running two
other busy processes (``specdec generate`` at 14 tok/s), while 1 thread kept ~1 ms. On a quiet machine 2 threads
are faster (plain decoding 1.4x in float32). Which is better depends on a load we cannot see, so we measure it.

How: decode steps run with the current choice ("many": the caller's ``torch.get_num_threads()``, or "one"); every
``interval`` steps the next ``PROBE_STEPS`` run with the other, and the tuner keeps whichever had the lower median
step time over its last ``PROBE_STEPS`` steps (adjacent windows, so the batch is about the same). A probe that is
plainly losing (one step 3x the current choice's median, or its first two steps both slower) ends early. A probe
that loses doubles the interval (up to ``MAX_INTERVAL``): on a steady machine probing costs ~1% of steps; a switch
resets it.
The engine applies the choice around the decode part of a step only and restores the caller's count after it, so
nothing outside the step (the caller's own torch code, another engine) sees a changed setting.

Measured (``specdec generate --prompt "import os" --max-tokens 250 --method none``, 2-core machine, bfloat16): with
two other busy processes 13.7 tok/s before, 64-386 tok/s with the tuner (the busy processes' scheduling varies); on
the quiet machine 1060-1807 tok/s with it (its probes lose after two steps and back off).
"""

from __future__ import annotations

import statistics

PROBE_STEPS = 8  # steps per measurement window
FIRST_INTERVAL = 16  # steps before the first probe, and between probes after a switch
MAX_INTERVAL = 2048
MIN_GAIN = 1.1  # the probed choice must be this much faster to take over: noise must not flip it back and forth
EARLY_LOSS = 3.0  # a probe step this many times the current choice's median ends the probe at once, as lost: a
# probe of many threads on busy cores costs ~100x a step, and 8 of them would cost more than the switch saves. Two
# probe steps both slower than MIN_GAIN x it end it too (one thread on a quiet machine: ~1.4x a step)


class ThreadTuner:
    """Chooses "many" or "one" CPU threads for decode steps by paired probes (see the module doc). It reads no
    clock: the engine times each decode step and feeds ``after_step(seconds)``; tests feed costs."""

    def __init__(self) -> None:
        self.single = False  # the current choice
        self.interval = FIRST_INTERVAL
        self.steps_since_probe = 0
        self.probing = 0  # steps left in the running probe
        self.probe_slow = True  # every step of the running probe so far was slower than MIN_GAIN x the current choice
        self.times: dict[bool, list[float]] = {False: [], True: []}  # the last PROBE_STEPS costs of each choice

    def single_for_step(self) -> bool:
        """Whether the coming decode step runs on one thread."""
        return self.single != bool(self.probing)

    def after_step(self, seconds: float) -> None:
        window = self.times[self.single_for_step()]
        window.append(seconds)
        del window[:-PROBE_STEPS]
        if self.probing:
            self.probing -= 1
            done = PROBE_STEPS - self.probing  # probe steps so far
            ours = statistics.median(self.times[self.single])
            self.probe_slow = self.probe_slow and seconds > MIN_GAIN * ours
            if seconds > EARLY_LOSS * ours or (done >= 2 and self.probe_slow):
                self.probing, self.interval = 0, min(self.interval * 2, MAX_INTERVAL)  # lost, before its end
            elif self.probing == 0:
                self._decide()
            return
        self.steps_since_probe += 1
        if self.steps_since_probe >= self.interval and len(self.times[self.single]) >= PROBE_STEPS:
            self.probing, self.steps_since_probe, self.probe_slow = PROBE_STEPS, 0, True

    def _decide(self) -> None:
        ours, theirs = (statistics.median(self.times[choice]) for choice in (self.single, not self.single))
        if theirs * MIN_GAIN < ours:
            self.single, self.interval = not self.single, FIRST_INTERVAL
        else:
            self.interval = min(self.interval * 2, MAX_INTERVAL)
