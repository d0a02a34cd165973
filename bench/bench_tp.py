"""Tensor parallelism on this host: TP=1 against TP=N, per forward and end to end, plus the bytes it all-reduces.

    python bench/bench_tp.py [--tp 2] [--rounds 3] [--prompts 4] [--max-tokens 96] [--dtype auto] [--out FILE]

The default target has 5 attention heads, which 2 ranks cannot split. The benchmark shards an exact copy with the
heads padded to a multiple of N: the extra heads have zero q/k/v rows and zero o_proj columns, so they add exact
zeros to every sum and the model computes the same function (checked: same greedy tokens), at 6/5 of the
attention's q and o work. The draft model is the default draft, on rank 0 only.

Modes, every one timed once per round in rotated order (load drift hits all alike); medians over rounds:
    tp1         the default target, one process, the engine's native one-call forward; per forward at 2 threads
                (tp1-2t) and 1 thread (tp1-1t), end to end with the engine's thread tuner (up to 2 threads)
    tp1-loop-1t the padded target through the tensor-parallel code with N=1 (the layer loop of torch ops, no
                peers), 1 thread: what one rank's path costs before any communication
    tpN         the padded target over N ranks (gloo), 1 thread per rank (the host's 2 cores split between them)

Per forward: ``forward + logits`` of T tokens over a 64-token prefix (bench.harness.forward_step), with rank
0's time inside collectives (command broadcast, all-reduces, logits gather) measured by timers around them.
End to end: greedy ``generate`` of ``--max-tokens`` per held-out prompt, plain and with the default draft (adaptive
depth), tok/s and tau. JSON to bench/out/bench_tp.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a file: the repository root, not bench/, heads the import path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import build_prompts, forward_step  # noqa: E402
from spec_engine import LLM, SamplingParams, default_model_paths  # noqa: E402

CTX = 64


def pad_heads(src: Path, dst: Path, multiple: int) -> Path:
    """A copy of ``src`` whose query heads are padded with zero heads up to a multiple of ``multiple`` (one KV head
    only, so every query head reads the same KV head and the padding cannot change the grouping)."""
    from safetensors.torch import load_file, save_file

    cfg = json.loads((src / "config.json").read_text())
    Hq = cfg["num_attention_heads"]
    D = cfg.get("head_dim") or cfg["hidden_size"] // Hq
    pad = -Hq % multiple
    assert cfg.get("num_key_value_heads", Hq) == 1 or pad == 0, "padding heads needs a single KV head"
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy(f, dst / f.name)
    state = {}
    for f in sorted(src.glob("*.safetensors")):
        state.update(load_file(str(f)))
    for name, w in list(state.items()):
        if name.endswith("q_proj.weight"):
            state[name] = torch.cat([w, w.new_zeros(pad * D, w.shape[1])])
        elif name.endswith("q_proj.bias"):
            state[name] = torch.cat([w, w.new_zeros(pad * D)])
        elif name.endswith("o_proj.weight"):
            state[name] = torch.cat([w, w.new_zeros(w.shape[0], pad * D)], dim=1)
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg.update(num_attention_heads=Hq + pad, head_dim=D)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


class CommTimer:
    """Seconds rank 0 spends inside the group's collectives (wraps one ``Comm``'s methods)."""

    def __init__(self, comm):
        self.seconds, self.calls = 0.0, 0
        for name in ("all_reduce", "broadcast", "gather"):
            setattr(comm, name, self._timed(getattr(comm, name)))

    def _timed(self, fn):
        def inner(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.seconds += time.perf_counter() - t0
                self.calls += 1

        return inner


def with_threads(n: int, fn):
    def inner():
        before = torch.get_num_threads()
        torch.set_num_threads(n)
        try:
            return fn()
        finally:
            torch.set_num_threads(before)

    return inner


def rotated(rounds: int, modes: dict, run) -> dict:
    """{mode: [result per round]}, every mode once per round, the order rotated each round."""
    names = list(modes)
    out = {k: [] for k in names}
    for r in range(rounds):
        for k in names[r % len(names) :] + names[: r % len(names)]:
            out[k].append(run(k, modes[k]))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=30, help="forwards per mode per round (per-forward part)")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--out", default=str(Path(__file__).parent / "out" / "bench_tp.json"))
    args = ap.parse_args()
    N = args.tp
    target, draft = (Path(p) for p in default_model_paths())
    tmp = Path(tempfile.mkdtemp(prefix="bench_tp_"))
    padded = pad_heads(target, tmp / "target", N)
    spec = {"method": "draft_model", "model": str(draft)}
    torch.set_num_threads(2)
    llms = {
        "tp1": (LLM(str(target), dtype=args.dtype), 2),
        f"tp{N}": (LLM(str(padded), dtype=args.dtype, tensor_parallel_size=N), 1),
    }
    from spec_engine.distributed import launch

    dtype = llms["tp1"][0].target.lm_head.weight.dtype
    loop = launch(padded, 1, dtype=dtype)
    loop_kv = loop.kv_cache(llms["tp1"][0].allocator.num_blocks, 32)
    timers = {f"tp{N}": CommTimer(llms[f"tp{N}"][0].target.comm)}
    report = {"machine": platform.node(), "load_avg": os.getloadavg(), "tp": N, "dtype": str(dtype),
              "note": "shared 2-core host, a training job running beside the benchmark"}  # fmt: skip

    prompts, source = build_prompts(llms["tp1"][0], args.prompts, 0)
    greedy = SamplingParams(max_tokens=32, temperature=0.0)
    same = [llm.generate([{"prompt_token_ids": prompts[0].ids}], greedy, use_tqdm=False)[0].outputs[0].token_ids
            for llm in (llms["tp1"][0], llms[f"tp{N}"][0])]  # fmt: skip
    report["padded_same_greedy_tokens"] = same[0] == same[1]
    print(f"[bench_tp] {dtype}, padded TP={N} greedy tokens == TP=1: {same[0] == same[1]}", flush=True)

    # --- per forward --------------------------------------------------------------------------------------------
    fwd = {}
    for T in (1, 5, 16):
        fns = {
            "tp1-2t": with_threads(2, forward_step(llms["tp1"][0].target, llms["tp1"][0].engine.kv, 1, CTX, T)),
            "tp1-1t": with_threads(1, forward_step(llms["tp1"][0].target, llms["tp1"][0].engine.kv, 1, CTX, T)),
            "tp1-loop-1t": with_threads(1, forward_step(loop, loop_kv, 1, CTX, T)),
            f"tp{N}": with_threads(1, forward_step(llms[f"tp{N}"][0].target, llms[f"tp{N}"][0].engine.kv, 1, CTX, T)),
        }
        for fn in fns.values():
            fn()

        def run(name, fn, T=T):
            timer = timers.get(name)
            c0 = timer.seconds if timer else 0.0
            t0 = time.perf_counter()
            for _ in range(args.reps):
                fn()
            wall = (time.perf_counter() - t0) / args.reps
            return wall, ((timer.seconds - c0) / args.reps if timer else 0.0)

        res = rotated(args.rounds, fns, run)
        fwd[T] = {k: {"ms": 1e3 * statistics.median(w for w, _ in v),
                      "comm_ms": 1e3 * statistics.median(c for _, c in v)} for k, v in res.items()}  # fmt: skip
        print(f"[bench_tp] forward+logits T={T:2d}: " + " | ".join(
            f"{k} {x['ms']:.2f} ms" + (f" (collectives {x['comm_ms']:.2f})" if k in timers else "")
            for k, x in fwd[T].items()), flush=True)  # fmt: skip
    report["forward"] = fwd

    # --- end to end ---------------------------------------------------------------------------------------------
    spec_llms = {
        "tp1+draft": (LLM(str(target), spec, dtype=args.dtype), 2),
        f"tp{N}+draft": (LLM(str(padded), spec, dtype=args.dtype, tensor_parallel_size=N), 1),
    }
    modes = {k: v for k, v in {**llms, **spec_llms}.items() if v[0] is not None}
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)

    def generate(name, mode):
        llm, threads = mode
        n = tau = elapsed = 0
        for p in prompts:
            out = with_threads(threads, lambda ids=p.ids: llm.generate([{"prompt_token_ids": ids}], params,
                                                                        use_tqdm=False))()  # fmt: skip
            m = out[0].metrics
            n += len(out[0].outputs[0].token_ids)
            elapsed += m["elapsed"]
            tau += m["mean_accepted_length"]
        return n / elapsed, tau / len(prompts)

    res = rotated(args.rounds, modes, generate)
    e2e = {k: {"tok_s": statistics.median(t for t, _ in v), "tok_s_rounds": [t for t, _ in v],
               "tau": statistics.median(x for _, x in v)} for k, v in res.items()}  # fmt: skip
    for k, v in e2e.items():
        print(f"[bench_tp] generate {k:10s}: {v['tok_s']:7.1f} tok/s  tau {v['tau']:.2f}  rounds "
              f"{[round(x) for x in v['tok_s_rounds']]}", flush=True)  # fmt: skip
    report["generate"] = e2e
    report["prompts"] = {"source": source, "count": len(prompts), "max_tokens": args.max_tokens}
    for llm, _ in (*llms.values(), *spec_llms.values()):
        if llm is not None:
            llm.close()
    loop.close()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
