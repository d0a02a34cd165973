"""Timed modes for the benchmarks that interleave several things in rounds (bench_step.py, bench_smollm2.py): a
``Mode`` collects one sampler's samples, ``run_rounds`` calls every mode once per round with the order rotating, so
load drift on a shared machine hits every mode alike. The samplers: single calls timed in ms (``timed_ms``), our
engine's and HF transformers' generation tok/s per prompt (``ours_sampler``, ``hf_sampler``).
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, field

import torch

from spec_engine import LLM, SamplingParams


@dataclass
class Mode:
    """One timed thing: ``fn()`` returns a sample (ms or tok/s); samples collect over rounds."""

    name: str
    fn: object
    unit: str
    samples: list[float] = field(default_factory=list)
    extra: dict = field(default_factory=dict)

    def summary(self) -> dict:
        s = sorted(self.samples)
        if not s:
            return {"median": None, "p20": None, "p80": None, "min": None, "max": None, "n": 0, "unit": self.unit,
                **self.extra}  # fmt: skip
        q = statistics.quantiles(s, n=10, method="inclusive") if len(s) > 1 else [s[0]] * 9
        return {"median": statistics.median(s), "p20": q[1], "p80": q[7], "min": s[0], "max": s[-1], "n": len(s),
                "unit": self.unit,
                **self.extra}  # fmt: skip


def run_rounds(modes: list[Mode], rounds: int, label: str) -> None:
    """Every mode once per round, starting one later each round (A B C, B C A, ...)."""
    for r in range(rounds):
        k = r % len(modes)
        for m in modes[k:] + modes[:k]:
            out = m.fn()
            m.samples.extend(out if isinstance(out, list) else [out])
        print(f"  [{label}] round {r + 1}/{rounds} done, load {os.getloadavg()[0]:.1f}", flush=True)


def timed_ms(fn, reps: int):
    """A sampler: ``reps`` back-to-back calls, each its own sample in ms. Single calls, not means over a batch of
    calls: on a shared machine the quiet moments then show in the low percentiles instead of being averaged away."""

    def sample() -> list[float]:
        out = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            out.append(1e3 * (time.perf_counter() - t0))
        return out

    return sample


def ours_sampler(llm: LLM, prompts: list[tuple[str, list[int]]], max_tokens: int, record: dict):
    """A sampler: one ``generate`` per prompt, its generation tok/s each (``decode_tokens_per_s``: the prompt's
    processing left out, as llama.cpp reports); the first pass's tokens and metrics go to ``record``."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    def sample() -> list[float]:
        out = []
        for name, ids in prompts:
            (o,) = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
            out.append(o.metrics["decode_tokens_per_s"])
            if name not in record:
                m = o.metrics
                record[name] = {"tokens": o.outputs[0].token_ids, "acceptance_rate": m["acceptance_rate"],
                                "tau": m["mean_accepted_length"]}  # fmt: skip
        return out

    return sample


def hf_sampler(model_dir: str, dtype: torch.dtype, prompts: list[tuple[str, list[int]]], max_tokens: int,
               record: dict):  # fmt: skip
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    model.generation_config.eos_token_id = None  # like ignore_eos: exactly max_tokens every run
    model.generation_config.pad_token_id = 0

    @torch.inference_mode()
    def sample() -> list[float]:
        out = []
        for name, ids in prompts:
            x = torch.tensor([ids])
            t0 = time.perf_counter()
            model(x)  # the prompt's forward alone, subtracted below: generation tok/s like the other rows
            prompt_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens,
                               min_new_tokens=max_tokens, do_sample=False)  # fmt: skip
            toks = y[0, len(ids) :].tolist()
            # the prompt's forward also gave the first token: N - 1 decode forwards remain for the other N - 1
            out.append((len(toks) - 1) / max(time.perf_counter() - t0 - prompt_s, 1e-9))
            record.setdefault(name, {"tokens": toks})
        return out

    with torch.inference_mode():  # warm
        model.generate(torch.tensor([prompts[0][1][:32]]), max_new_tokens=8, do_sample=False)
    return sample
