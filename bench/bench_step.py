"""Step cost and peers: what one forward of the default pair costs, against its bare matmuls and against llama.cpp.

    python bench/bench_step.py [--quick] [--threads 2] [--llama-bench PATH] [--gguf-dir DIR] [--out FILE]

Three parts, each timed in interleaved rounds (every mode once per round, the order rotated each round, so load
drift on a shared machine hits every mode alike), reported as median [p20, p80] over the rounds:

1. **Step cost** per forward, batch 1, paged cache holding ``CTX`` committed tokens, float32 and bfloat16:
   the engine's own forward + logits for T = 1, 2, 4, 8, 16 tokens of target and draft, and the bare matmuls of
   the same forward. With ``llama-bench`` and the GGUFs, llama.cpp's forward of T tokens at the same depth too.
2. **Plain decode** (greedy, batch 1, held-out prompts): our engine without speculation, HF transformers' greedy
   ``generate`` on the same weights, our default speculative config, and a control (a second no-speculation engine
   timed as if it were a mode: its spread against plain is the run's noise floor).
3. **llama.cpp** on the same weights converted to GGUF (see bench/llama_cpp.md): ``llama-bench`` plain decode
   (f32, f16 weights) and ``llama-speculative-simple`` with draft-max 2..8 on the same prompts, interleaved with
   part 2's modes.

Glossary:
    T        tokens per row in one forward: the verify width (root + drafted nodes of a chain)
    fwd(T)   ``LlamaForCausalLM.forward`` + ``logits`` as the engine calls them (bench.harness.forward_step)
    mm(T)    ``torch.mm`` of a [T, in] activation by every weight matrix that forward multiplies (each 2-D weight but
             the embedding, lm_head included), same dtype: the floor torch's small-M GEMMs set
    r(T)     fwd(T) / fwd(1): what a T-token verify costs in single-token forwards
    c        draft fwd(1) / target fwd(1)
    GB/s     weight bytes / fwd(1): a batch-1 forward streams every weight once, so this against the machine's
             copy bandwidth (``stream``, a large ``copy_``) is the memory roofline
    control  the plain mode timed again under another name; |control / plain - 1| is the noise of the run

Decode tok/s is generation alone, the prompt's processing left out, on every row: ours is the request's
``decode_tokens_per_s`` (max_tokens / the time from its prefill's end to its last token), HF's its ``generate``
less one forward of the prompt, llama.cpp's speculative figure its own "decoded" rate and llama-bench's a 64-token
generation at depth 96 (KV f16: llama-bench accepts no f32 KV). Until 2026-11-23 our rows and HF's included the
prompt's prefill (~11 ms of a ~70 ms float32 request), which llama.cpp's never did. Our adaptive default fills its
draft's cache lazily, so its catch-up on the prompt (~1.2 ms in float32) stays inside its generation time, where
llama.cpp prefills its draft with the prompt.
JSON goes to bench/out/bench_step.json with the machine's name and load average.
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

from bench import llama_cpp  # noqa: E402
from bench.harness import cpu_name, forward_step  # noqa: E402
from bench.modes import Mode, hf_sampler, ours_sampler, run_rounds, timed_ms  # noqa: E402
from spec_engine import LLM, SamplingParams, default_model_paths  # noqa: E402
from spec_engine.drafters.draft_model import read_draft_vocab  # noqa: E402
from spec_engine.llm import _draft_dtype  # noqa: E402

CTX = 64  # committed tokens in the cache under every timed forward
SIZES = (1, 2, 4, 8, 16)
PROMPT_LEN = 96
DRAFT_MAX = (2, 3, 4, 5, 6, 7, 8)
DTYPES = ("float32", "bfloat16")
GGUF_TYPES = ("f32", "f16")
LLAMA_SPEC_BIN = "llama-speculative-simple"


def _fmt(s: dict, spec: str = ".3f") -> str:
    if s["median"] is None:
        return "-"
    return f"{s['median']:{spec}} [{s['p20']:{spec}}, {s['p80']:{spec}}]"


# --- part 1: step cost -------------------------------------------------------------------------------------------


def matrices(model: torch.nn.Module) -> list[torch.Tensor]:
    """Every weight matrix one forward multiplies by: the 2-D parameters except the embedding table (a gather).
    A tied lm_head counts: it is multiplied, under its own name; a reduced draft vocabulary's K rows stand for it."""
    seen, out = set(), []
    for name, p in model.named_parameters(remove_duplicate=False):
        if p.dim() == 2 and not name.endswith("embed_tokens.weight") and name not in seen:
            seen.add(name)
            out.append(model.head_weight if name == "lm_head.weight" and model.vocab_map is not None else p)
    return out


def matmul_step(model: torch.nn.Module, T: int):
    """A callable doing ``torch.mm`` of a [T, in] activation by each weight matrix of ``model`` (its dtype)."""
    weights = matrices(model)
    xs = {w.shape[1]: torch.randn(T, w.shape[1]).to(w.dtype) for w in weights}  # [T, in] per input width

    @torch.inference_mode()
    def once():
        for w in weights:
            torch.mm(xs[w.shape[1]], w.t())  # [T, out]

    return once


def stream_gbps(num_bytes: int = 256 << 20):
    """A sampler: copy bandwidth (read + write) of ``num_bytes`` into a buffer allocated once (a fresh ``clone``
    would time first-touch page faults, not memory)."""
    x = torch.ones(num_bytes // 4, dtype=torch.float32)
    y = torch.empty_like(x).fill_(0.0)

    def sample() -> float:
        t0 = time.perf_counter()
        y.copy_(x)
        return 2 * num_bytes / (time.perf_counter() - t0) / 1e9

    return sample


NATIVE_STEPS = 16  # forwards per plain_steps call in native_step


def native_step(eng):
    """A callable running NATIVE_STEPS native one-token forwards in one call, as the engine's chains run them
    (``plain_steps``: no Python per forward): the per-forward cost c compares in the engine's own steps
    (``spec_chain``)."""
    from spec_kernels.decoder_layers import plain_steps

    block_size = eng.kv.data.shape[3]
    table = torch.arange(1, 2 + (CTX + NATIVE_STEPS) // block_size, dtype=torch.int32)[None]  # [1, W]

    def once():
        plain_steps(torch.tensor([5]), eng.runner.native_target, eng.kv.data, torch.tensor([CTX], dtype=torch.int32),
                     steps=NATIVE_STEPS, block_table=table)  # fmt: skip

    once()  # (builds the extension)
    return once


def step_cost_modes(target_dir: str, draft_dir: str, dtypes: list[str], sizes: list[int], reps: int) -> list[Mode]:
    modes = [Mode("stream copy", stream_gbps(), "GB/s")]
    for dtype in dtypes:
        for role, path in (("target", target_dir), ("draft", draft_dir)):
            llm = LLM(path, None, dtype=dtype, max_num_seqs=1)
            eng = llm.engine
            if role == "draft":  # as the engine drafts with it: its default reduced vocabulary, if it ships one
                ids = read_draft_vocab(path, eng.target.config.vocab_size, None)
                eng.target.restrict_vocab(None if ids is None else ids.to(eng.kv.data.device))
            weight_bytes = sum(w.numel() * w.element_size() for w in matrices(eng.target))
            info = {"dtype": dtype, "model": role, "weight_bytes": weight_bytes,
                    "num_matrices": len(matrices(eng.target))}  # fmt: skip
            native = timed_ms(native_step(eng), reps)  # ms per call of NATIVE_STEPS forwards
            modes.append(Mode(f"{role} {dtype} native fwd T=1", lambda f=native: [t / NATIVE_STEPS for t in f()],
                              "ms", extra={**info, "T": 1}))  # fmt: skip
            for T in sizes:
                fwd = forward_step(eng.target, eng.kv, 1, CTX, T)
                mm = matmul_step(eng.target, T)
                fwd(), mm()  # warm: first-call allocations, lazy builds
                modes.append(Mode(f"{role} {dtype} fwd T={T}", timed_ms(fwd, reps), "ms", extra={**info, "T": T}))
                modes.append(Mode(f"{role} {dtype} mm T={T}", timed_ms(mm, reps), "ms", extra={**info, "T": T}))
                if role == "target" and T == 1:  # the control: the same forward again, as another mode
                    modes.append(Mode(f"target {dtype} fwd T=1 (control)", timed_ms(fwd, reps), "ms",
                                      extra={**info, "T": 1}))  # fmt: skip
    return modes


def derive_step_cost(summary: dict, dtypes: list[str], sizes: list[int]) -> list[dict]:
    """One row per (model, dtype, T): fwd, mm, r(T), fwd/mm, GB/s; plus c per dtype. Each from the medians and from
    the best samples (``*_best``): under load the best is the closer estimate of what the code costs."""
    rows = []
    stream = summary["stream copy"]["max"]
    for dtype in dtypes:
        for role in ("target", "draft"):
            f1 = summary[f"{role} {dtype} fwd T=1"]
            for T in sizes:
                f, m = summary[f"{role} {dtype} fwd T={T}"], summary[f"{role} {dtype} mm T={T}"]
                rows.append({
                    "model": role, "dtype": dtype, "T": T, "fwd_ms": f["median"], "fwd_best": f["min"],
                    "mm_ms": m["median"], "mm_best": m["min"], "r": f["median"] / f1["median"],
                    "r_best": f["min"] / f1["min"], "fwd_over_mm_best": f["min"] / m["min"],
                    "weight_gbps_best": f["weight_bytes"] / f["min"] / 1e6 if T == 1 else None,
                    "roofline_ms": f["weight_bytes"] / (stream * 1e6) if T == 1 and stream else None,
                })  # fmt: skip
        # c with the draft in the target's dtype, and in the engine's default draft dtype where that differs (a
        # float32 target drafts in bfloat16 on CPUs with AVX512-BF16: speculative_config's "draft_dtype")
        for draft_dtype in dict.fromkeys([dtype, _draft_dtype(dtype, "cpu")]):
            if f"draft {draft_dtype} fwd T=1" not in summary:
                continue
            t1, d1 = summary[f"target {dtype} fwd T=1"], summary[f"draft {draft_dtype} fwd T=1"]
            label = dtype if draft_dtype == dtype else f"{dtype} target, {draft_dtype} draft (the default)"
            rows.append({"model": "c", "dtype": label, "T": 1, "c": d1["median"] / t1["median"],
                         "c_best": d1["min"] / t1["min"],
                         "c_mm_best": summary[f"draft {draft_dtype} mm T=1"]["min"]
                         / summary[f"target {dtype} mm T=1"]["min"],
                         "control_over_fwd": summary[f"target {dtype} fwd T=1 (control)"]["median"] / t1["median"],
                         "control_over_fwd_best": summary[f"target {dtype} fwd T=1 (control)"]["min"] / t1["min"],
                         "c_native": summary[f"draft {draft_dtype} native fwd T=1"]["median"]
                         / summary[f"target {dtype} native fwd T=1"]["median"],
                         "c_native_best": summary[f"draft {draft_dtype} native fwd T=1"]["min"]
                         / summary[f"target {dtype} native fwd T=1"]["min"],
                         "target_native_ms": summary[f"target {dtype} native fwd T=1"]["median"],
                         "draft_native_ms": summary[f"draft {draft_dtype} native fwd T=1"]["median"],
                         })  # fmt: skip
    return rows


# --- llama.cpp ---------------------------------------------------------------------------------------------------


def find_llama(args) -> tuple[Path | None, Path | None, str]:
    """(llama-bench, GGUF dir) or Nones with the reason."""
    bench = args.llama_bench or llama_cpp.binary(os.environ.get("LLAMA_CPP_DIR"), "llama-bench")
    bench = bench or shutil.which("llama-bench")
    if bench is None or not Path(bench).is_file():
        return None, None, "llama.cpp skipped: no llama-bench (pass --llama-bench PATH or set $LLAMA_CPP_DIR)"
    gguf = Path(args.gguf_dir) if args.gguf_dir else None
    need = [f"{m}-{t}.gguf" for m in ("target", "draft") for t in GGUF_TYPES]
    if gguf is None or any(not (gguf / n).is_file() for n in need):
        return None, None, f"llama.cpp skipped: --gguf-dir must hold {', '.join(need)} (see bench/llama_cpp.md)"
    return Path(bench), gguf, ""


# --- part 2: decode ----------------------------------------------------------------------------------------------


def held_out_prompts(llm: LLM, num: int, length: int = PROMPT_LEN) -> list[tuple[str, list[int]]]:
    """``length``-token slices of numpy's own sources (not the stdlib the zoo trained on), a third into each file
    (past license headers and imports), from evenly spaced files."""
    import numpy

    root = Path(numpy.__file__).parent
    files = sorted(p for p in root.rglob("*.py") if "tests" not in p.parts and p.stat().st_size > 8000)
    picked = [files[(2 * i + 1) * len(files) // (2 * num)] for i in range(num)]
    out = []
    for p in picked:
        ids = llm.encode(p.read_text(encoding="utf-8"))
        start = len(ids) // 3
        out.append((f"numpy/{p.relative_to(root)}", ids[start : start + length]))
    return out


def paired(a: Mode, b: Mode) -> dict:
    """Per-sample ratios a/b (the same prompt, the same round): median [p20, p80] and the minimum."""
    ratios = sorted(x / y for x, y in zip(a.samples, b.samples))
    q = statistics.quantiles(ratios, n=10, method="inclusive") if len(ratios) > 1 else [ratios[0]] * 9
    return {"median": statistics.median(ratios), "p20": q[1], "p80": q[7], "min": ratios[0], "n": len(ratios)}


def per_prompt_ratio(a: Mode, b: Mode, num_prompts: int) -> list[float]:
    """Median over rounds of a/b per prompt (samples are laid out round by round, prompt by prompt)."""
    out = []
    for i in range(num_prompts):
        out.append(statistics.median(x / y for x, y in zip(a.samples[i::num_prompts], b.samples[i::num_prompts])))
    return out


def held_out_phase(llms: dict[str, LLM], prompts: list[tuple[str, list[int]]], max_tokens: int,
                   rounds: int) -> dict:  # fmt: skip
    """Part 4: our modes alone, prompt by prompt, ``rounds`` times: per prompt, each mode's decode tok/s over plain's,
    as the median over rounds and as the best run's over plain's best (the machine's other jobs only slow a run, so
    under load the best is the closer estimate of what the code costs). The control is plain decoding under another
    name: its ratios are the noise floor. Each measured run follows an unmeasured 2-token run of the same engine on
    the same prompt: a run right after another engine's pays for the weights the other evicted from the L3 cache
    (~3-5% of a 64-token run here), and with the modes' order reversed every other prompt the middle mode always
    did, the others half the time (the default spec mode, never drafting, read 0.90x plain decoding beside a
    control at 1.02x)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    warm = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    names = list(llms)
    tps = {n: [[] for _ in prompts] for n in names}  # [mode][prompt][round]
    drafted = {n: [0, 0] for n in names}  # [mode]: drafted steps, steps
    for r in range(rounds):
        for i, (_, ids) in enumerate(prompts):
            k = (r + i) % len(names)
            for n in names[k:] + names[:k]:
                llms[n].generate([{"prompt_token_ids": ids}], warm, use_tqdm=False)
                (o,) = llms[n].generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
                tps[n][i].append(o.metrics["decode_tokens_per_s"])
                drafted[n][0] += sum(o.metrics.get("gamma_hist", [0])[1:])
                drafted[n][1] += o.metrics["num_steps"]
        print(f"  [held-out] round {r + 1}/{rounds} done, load {os.getloadavg()[0]:.1f}", flush=True)
    base = tps[names[0]]
    out = {"rounds": rounds, "modes": names[1:]}
    for n in names[1:]:
        out[n] = {
            "median": [statistics.median(a / b for a, b in zip(x, y)) for x, y in zip(tps[n], base)],
            "best": [max(x) / max(y) for x, y in zip(tps[n], base)],
            "drafted_steps": drafted[n][0] / max(drafted[n][1], 1),
        }
    return out


# --- main --------------------------------------------------------------------------------------------------------


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer rounds, prompts and draft-max values")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default=None, help="target directory (default: the zoo's)")
    ap.add_argument("--draft", default=None, help="draft directory (default: the zoo's)")
    ap.add_argument("--decode-dtype", default="float32", choices=DTYPES, help="dtype of the decode comparisons")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--llama-bench", default=None, help="path of llama.cpp's llama-bench ($LLAMA_CPP_DIR also works)")
    ap.add_argument("--gguf-dir", default=None, help="holds target-{f32,f16}.gguf and draft-{f32,f16}.gguf")
    ap.add_argument("--step-rounds", type=int, default=None, help="rounds of part 1 (default 7, quick 3)")
    ap.add_argument("--decode-rounds", type=int, default=None, help="rounds of parts 2-3 (default 3, quick 1)")
    ap.add_argument("--num-prompts", type=int, default=None, help="held-out prompts (default 6, quick 2)")
    ap.add_argument("--held-out-rounds", type=int, default=None,
                    help="rounds of part 4, our modes alone per prompt (default 9, quick 2; 0 skips it)")  # fmt: skip
    ap.add_argument("--skip-step", action="store_true", help="skip part 1")
    ap.add_argument("--skip-decode", action="store_true", help="skip parts 2 and 3")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "out" / "bench_step.json"))
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    target_dir, draft_dir = default_model_paths()
    target_dir, draft_dir = args.model or target_dir, args.draft or draft_dir
    quick = args.quick
    step_rounds, step_reps = (3, 3) if quick else (7, 5)
    decode_rounds, num_prompts = (1, 2) if quick else (3, 6)
    step_rounds = args.step_rounds or step_rounds
    decode_rounds, num_prompts = args.decode_rounds or decode_rounds, args.num_prompts or num_prompts
    draft_max = (2, 4, 8) if quick else DRAFT_MAX
    bench, gguf, llama_note = find_llama(args)
    spec_bin = bench.parent / LLAMA_SPEC_BIN if bench else None
    notes = [llama_note] if llama_note else []
    if spec_bin is not None and not spec_bin.is_file():
        notes.append(f"llama.cpp speculative skipped: no {LLAMA_SPEC_BIN} next to llama-bench")
        spec_bin = None
    for n in notes:
        print(f"[bench_step] {n}")
    result = {
        "command": " ".join(sys.argv),
        "machine": platform.node(),
        "cpu": cpu_name(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "threads": args.threads,
        "torch": torch.__version__,
        "ctx": CTX,
        "quick": quick,
        "loadavg_start": os.getloadavg(),
        "notes": notes,
    }

    if not args.skip_step:
        print(f"[bench_step] part 1: step cost, T in {SIZES}, {list(DTYPES)}, {step_rounds} rounds x {step_reps} reps")
        modes = step_cost_modes(target_dir, draft_dir, list(DTYPES), list(SIZES), step_reps)
        if bench is not None:
            for gtype in GGUF_TYPES:
                for role in ("target", "draft"):
                    for T in SIZES:
                        fwd = llama_cpp.forward_sampler(bench, gguf / f"{role}-{gtype}.gguf", args.threads, T, CTX, 3)
                        modes.append(Mode(f"llama.cpp {role} {gtype} fwd T={T}", fwd, "ms",
                                          extra={"model": role, "gguf": gtype, "T": T}))  # fmt: skip
        run_rounds(modes, step_rounds, "step cost")
        summary = {m.name: m.summary() for m in modes}
        result["step_cost"] = summary
        result["step_cost_derived"] = derive_step_cost(summary, list(DTYPES), list(SIZES))
        if bench is not None:
            result["llama_fwd_derived"] = []
            for g in GGUF_TYPES:
                for role in ("target", "draft"):
                    f1 = summary[f"llama.cpp {role} {g} fwd T=1"]
                    for T in SIZES:
                        f = summary[f"llama.cpp {role} {g} fwd T={T}"]
                        result["llama_fwd_derived"].append({"model": role, "gguf": g, "T": T, "fwd_ms": f["median"],
                                                            "fwd_best": f["min"], "r": f["median"] / f1["median"],
                                                            "r_best": f["min"] / f1["min"]})  # fmt: skip
        print_step_cost(result)
        save(result, Path(args.out))

    if not args.skip_decode:
        dtype = args.decode_dtype
        plain = LLM(target_dir, None, dtype=dtype)
        prompts = held_out_prompts(plain, num_prompts)
        print(f"[bench_step] part 2/3: decode, {len(prompts)} prompts x {args.max_tokens} tokens x {decode_rounds} "
              f"rounds, {dtype}")  # fmt: skip
        records: dict[str, dict] = {}
        spec = LLM(target_dir, {"method": "draft_model", "model": draft_dir}, dtype=dtype)
        control = LLM(target_dir, None, dtype=dtype)
        modes = []
        ours = (("specdec plain", plain), ("specdec default spec", spec), ("specdec plain (control)", control))
        for name, llm in ours:
            records[name] = {}
            llm.generate([{"prompt_token_ids": prompts[0][1][:32]}], SamplingParams(max_tokens=8), use_tqdm=False)
            modes.append(Mode(name, ours_sampler(llm, prompts, args.max_tokens, records[name]), "tok/s"))
        try:
            records["HF greedy"] = {}
            torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
            modes.append(Mode("HF greedy", hf_sampler(target_dir, torch_dtype, prompts, args.max_tokens,
                                                      records["HF greedy"]), "tok/s"))  # fmt: skip
        except ImportError:
            notes.append("HF greedy skipped: transformers is not installed (pip install 'specdec[test]')")
        llama_stats: dict[str, dict] = {}
        with tempfile.TemporaryDirectory() as tmp:
            prompt_files = []
            for i, (_, ids) in enumerate(prompts):
                p = Path(tmp) / f"prompt{i}.txt"
                p.write_text(plain.decode(ids))
                prompt_files.append(p)
            if bench is not None:
                for gtype in GGUF_TYPES:
                    gen = ["-p", "0", "-n", str(args.max_tokens), "-d", str(PROMPT_LEN), "-r", str(num_prompts)]
                    modes.append(Mode(f"llama.cpp plain {gtype}", llama_cpp.bench_sampler(
                        bench, gguf / f"target-{gtype}.gguf", args.threads, gen, "samples_ts"), "tok/s"))  # fmt: skip
            if spec_bin is not None:
                for gtype in GGUF_TYPES:
                    for d in draft_max:
                        name = f"llama.cpp spec {gtype} draft-max {d}"
                        llama_stats[name] = {}
                        modes.append(Mode(name, llama_cpp.spec_sampler(spec_bin, gguf, gtype, d, prompt_files,
                                                                   args.threads, args.max_tokens, llama_stats[name]),
                                          "tok/s"))  # fmt: skip
            run_rounds(modes, decode_rounds, "decode")
        by_name = {m.name: m for m in modes}
        summary = {m.name: m.summary() for m in modes}
        for name, st in llama_stats.items():
            if st.get("drafted"):
                summary[name]["acceptance_rate"] = st["accepted"] / st["drafted"]
            summary[name]["lost_logs"] = st.get("lost_logs", 0)
        base = by_name["specdec plain"]
        # our modes and HF ran the same prompts in the same order: ratios pair up; llama.cpp's compare medians
        vs_plain = {n: paired(m, base) for n, m in by_name.items() if n != base.name and not n.startswith("llama")}
        for s in summary.values():
            s["median_over_plain"] = s["median"] / summary[base.name]["median"] if s["median"] else None
        ref = records["specdec plain"]
        same = {
            n: sum(rec.get(p, {}).get("tokens") == ref[p]["tokens"] for p in ref)
            for n, rec in records.items()
            if n != "specdec plain"
        }
        result["decode"] = {
            "dtype": dtype,
            "prompts": [name for name, _ in prompts],
            "max_tokens": args.max_tokens,
            "rounds": decode_rounds,
            "modes": summary,
            "paired_vs_plain": vs_plain,
            "spec_per_prompt_vs_plain": per_prompt_ratio(by_name["specdec default spec"], base, len(prompts)),
            "spec_metrics": {
                p: {k: v for k, v in r.items() if k != "tokens"} for p, r in records["specdec default spec"].items()
            },  # fmt: skip
            "same_tokens_as_plain": {n: f"{k}/{len(ref)}" for n, k in same.items()},
        }
        held_rounds = args.held_out_rounds if args.held_out_rounds is not None else (2 if quick else 9)
        if held_rounds:
            print(f"[bench_step] part 4: held-out, our modes alone, {len(prompts)} prompts x {held_rounds} rounds")
            llms = {"specdec plain": plain, "specdec default spec": spec, "specdec plain (control)": control}
            result["decode"]["held_out"] = held_out_phase(llms, prompts, args.max_tokens, held_rounds)
        print_decode(result)

    save(result, Path(args.out))
    return 0


def save(result: dict, out: Path) -> None:
    result["loadavg_end"] = os.getloadavg()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(result))
    print(f"[bench_step] wrote {out} and {out.with_suffix('.md')}")


def print_step_cost(result: dict) -> None:
    s = result["step_cost"]
    print(f"\nstream copy: {_fmt(s['stream copy'], '.1f')} GB/s (best {s['stream copy']['max']:.1f})")
    print("ms per forward, median [p20, p80] and best; r(T) = fwd(T)/fwd(1) from medians | from bests")
    head = f"{'':<10}{'model':<7}{'dtype':<9}{'T':>3}  {'fwd ms [p20, p80]':<27}{'best':>7}{'mm best':>8}"
    print(f"{head}{'r(T)':>7}{'r best':>7}{'fwd/mm':>7}{'GB/s':>6}")
    for row in result["step_cost_derived"]:
        if row["model"] == "c":
            print(f"  c = draft/target fwd(1), {row['dtype']}: {row['c']:.3f} (best {row['c_best']:.3f}; bare matmuls "
                  f"{row['c_mm_best']:.3f}); control/fwd {row['control_over_fwd']:.3f}")  # fmt: skip
            print(f"  c native (one-token forwards in one plain_steps call, as the engine's chains run them), "
                  f"{row['dtype']}: {row['c_native']:.3f} (best {row['c_native_best']:.3f}): draft "
                  f"{row['draft_native_ms']:.3f} ms, target {row['target_native_ms']:.3f} ms")  # fmt: skip
            continue
        f = s[f"{row['model']} {row['dtype']} fwd T={row['T']}"]
        gbps = f"{row['weight_gbps_best']:.1f}" if row["weight_gbps_best"] else ""
        cols = f"{row['mm_best']:>8.3f}{row['r']:>7.2f}{row['r_best']:>7.2f}{row['fwd_over_mm_best']:>7.2f}{gbps:>6}"
        name = f"{'specdec':<10}{row['model']:<7}{row['dtype']:<9}{row['T']:>3}"
        print(f"{name}  {_fmt(f):<27}{row['fwd_best']:>7.3f}{cols}")
    for row in result.get("llama_fwd_derived", []):
        f = s[f"llama.cpp {row['model']} {row['gguf']} fwd T={row['T']}"]
        print(f"{'llama.cpp':<10}{row['model']:<7}{row['gguf']:<9}{row['T']:>3}  {_fmt(f):<27}{row['fwd_best']:>7.3f}"
              f"{'':>8}{row['r']:>7.2f}{row['r_best']:>7.2f}")  # fmt: skip


def print_decode(result: dict) -> None:
    d = result["decode"]
    print(f"\ndecode, {d['dtype']}, batch 1, greedy, {len(d['prompts'])} prompts x {d['max_tokens']} tokens:")
    for name, s in d["modes"].items():
        extra = f"  acceptance {s['acceptance_rate']:.2f}" if "acceptance_rate" in s else ""
        p = d["paired_vs_plain"].get(name)
        rel = f"  vs plain {p['median']:.2f}x [{p['p20']:.2f}, {p['p80']:.2f}] min {p['min']:.2f}" if p else ""
        if not p and s["median_over_plain"]:
            rel = f"  vs plain {s['median_over_plain']:.2f}x (medians)"
        print(f"  {name:<34}{_fmt(s, '.1f'):<28}tok/s{rel}{extra}")
    print(f"  default spec per prompt vs plain: {', '.join(f'{x:.2f}' for x in d['spec_per_prompt_vs_plain'])}")
    print(f"  same tokens as plain: {d['same_tokens_as_plain']}")
    h = d.get("held_out")
    if h:
        print(f"held-out, our modes alone, {h['rounds']} rounds per prompt, vs plain (median over rounds | best runs):")
        for n in h["modes"]:
            med, best = (", ".join(f"{x:.2f}" for x in h[n][k]) for k in ("median", "best"))
            print(f"  {n:<26} {med} | {best}  (drafted steps {h[n]['drafted_steps']:.0%})")


def _row(*cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def markdown(result: dict) -> str:
    """The tables of bench/RESULTS.md's "Step cost and peers" section."""
    lines = []
    if "step_cost" in result:
        s = result["step_cost"]
        lines += [f"Copy bandwidth: {_fmt(s['stream copy'], '.1f')} GB/s, best {s['stream copy']['max']:.1f}.", "",
                  _row("model", "dtype", "T", "fwd ms, median [p20, p80]", "fwd best", "mm best", "r(T)", "r(T) best",
                       "fwd/mm best"), _row(*["---"] * 9)]  # fmt: skip
        for row in result["step_cost_derived"]:
            if row["model"] == "c":
                continue
            f = s[f"{row['model']} {row['dtype']} fwd T={row['T']}"]
            lines.append(_row(row["model"], row["dtype"], row["T"], _fmt(f, ".2f"), f"{row['fwd_best']:.2f}",
                              f"{row['mm_best']:.2f}", f"{row['r']:.2f}", f"{row['r_best']:.2f}",
                              f"{row['fwd_over_mm_best']:.2f}"))  # fmt: skip
        lines.append("")
        for row in result["step_cost_derived"]:
            if row["model"] == "c":
                lines.append(f"- c ({row['dtype']}): {row['c']:.3f} from medians, {row['c_best']:.3f} from bests (bare "
                             f"matmuls {row['c_mm_best']:.3f}); control / fwd(1): {row['control_over_fwd']:.2f} "
                             f"(bests {row['control_over_fwd_best']:.2f}); native forwards (plain_steps, as the "
                             f"engine's chains): {row['c_native']:.3f} from medians, {row['c_native_best']:.3f} from "
                             f"bests (draft {row['draft_native_ms']:.3f} ms, target "
                             f"{row['target_native_ms']:.3f} ms)")  # fmt: skip
        if result.get("llama_fwd_derived"):
            lines += ["", "| llama.cpp | GGUF | T | fwd ms, median [p20, p80] | fwd best | r(T) | r(T) best |",
                      "|---|---|---|---|---|---|---|"]  # fmt: skip
            for row in result["llama_fwd_derived"]:
                f = s[f"llama.cpp {row['model']} {row['gguf']} fwd T={row['T']}"]
                lines.append(_row(row["model"], row["gguf"], row["T"], _fmt(f, ".2f"), f"{row['fwd_best']:.2f}",
                                  f"{row['r']:.2f}", f"{row['r_best']:.2f}"))  # fmt: skip
    if "decode" in result:
        d = result["decode"]
        lines += ["", "| mode | tok/s, median [p20, p80] | best | vs plain | acceptance | same tokens |",
                  "|---|---|---|---|---|---|"]  # fmt: skip
        for name, s in d["modes"].items():
            p = d["paired_vs_plain"].get(name)
            rel = f"{p['median']:.2f}x [{p['p20']:.2f}, {p['p80']:.2f}], min {p['min']:.2f}" if p else ""
            if not p and s["median_over_plain"]:
                rel = f"{s['median_over_plain']:.2f}x (medians)"
            acc = s.get("acceptance_rate")
            if name == "specdec default spec":
                metrics = d["spec_metrics"].values()
                acc = statistics.mean(m["acceptance_rate"] for m in metrics)
            same = d["same_tokens_as_plain"].get(name, "")
            lines.append(f"| {name} | {_fmt(s, '.1f')} | {s['max']:.1f} | {rel} | {f'{acc:.2f}' if acc else ''} | "
                         f"{same} |")  # fmt: skip
        per_prompt = ", ".join(f"{x:.2f}" for x in d["spec_per_prompt_vs_plain"])
        lines += ["", f"Default speculative config / plain, per prompt (median over rounds): {per_prompt}."]
        h = d.get("held_out")
        if h:
            lines += [
                "",
                f"Held-out, our modes alone ({h['rounds']} rounds per prompt), per prompt vs plain:",
                "",
                _row("mode", "median over rounds", "best run / plain's best"),
                _row("---", "---", "---"),
            ]
            for n in h["modes"]:
                lines.append(_row(n, *(", ".join(f"{x:.2f}" for x in h[n][k]) for k in ("median", "best"))))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
