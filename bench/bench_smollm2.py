"""SmolLM2-135M-Instruct, a real model whose weights stream from DRAM: our plain decoding against llama.cpp and HF
transformers on the same weights, the bandwidth each reaches, the verify cost r(T), and batch throughput.

    python bench/bench_smollm2.py [--quick] [--model smollm2|FILE.gguf] [--llama-cpp DIR] [--threads 2]

1. **Bandwidth**: the read probe (``bench/bench_bandwidth.py``): what a step that streams its weights can reach.
2. **Batch-1 greedy decode** (tok/s, generation only): ours in bfloat16 (the GGUF dequantized at load), ours on the
   file's weights as stored (``quantization="gguf"``; the pulled file is Q4_1), a control (our bfloat16 again,
   under another name: its ratio is the noise floor), HF transformers (float32, from an export of the same GGUF),
   llama.cpp (``llama-bench -n``) on an F16 copy of the same tensors and on the file itself. Every mode once per
   round, the order rotating. Our rows also report the weight bytes streamed per token times tok/s, as GB/s and as
   a share of the read probe.
3. **r(T)**: one T-token forward (+ logits) over a CTX-token cache, divided by a 1-token forward, ours against
   llama.cpp's (``llama-bench -p T -d CTX``: one ubatch of T tokens).
4. **Batch throughput**: plain greedy decoding of B requests together (B = 1, 4, 16), summed generation tok/s, ours
   against ``llama-batched-bench`` (its S_TG) on the same F16 tensors.

llama.cpp is a peer, never a dependency (bench/llama_cpp.md builds it under /tmp); without ``--llama-cpp`` (or
``$LLAMA_CPP_DIR``) its rows are skipped with one line. JSON goes to bench/out/bench_smollm2.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a file: the repository root, not bench/, heads the import path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import llama_cpp  # noqa: E402
from bench.bench_bandwidth import probe  # noqa: E402
from bench.harness import cpu_name, forward_step  # noqa: E402
from bench.modes import Mode, hf_sampler, ours_sampler, run_rounds, timed_ms  # noqa: E402
from spec_engine import LLM  # noqa: E402

CTX = 96  # committed tokens under every timed forward, as issue 34 measured
SIZES = (1, 2, 4, 8, 16)
BATCHES = (1, 4, 16)
CHAT_PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "Explain the difference between a list and a tuple in Python.",
    "What causes the seasons on Earth?",
    "Write a haiku about the sea.",
    "How do I reverse a string in JavaScript?",
    "Give three tips for writing clear emails.",
]


def resolve_gguf(model: str) -> Path:
    """The GGUF file: a path, or a registry name (``smollm2``) pulled on first use."""
    if model.endswith(".gguf"):
        return Path(model)
    from spec_engine.zoo.pull import pull

    return pull(model)


def stored_weights(gguf_path: Path) -> tuple[str, int, int]:
    """The file read once: its type name as llama.cpp gives it (``general.file_type``: "Q4_1", "Q4_K_M", ...), and
    the bytes of the matrices one decode token streams, as stored and as bfloat16: every 2-D tensor (the tied
    embedding is the lm_head, read whole; the embedding lookup itself reads one row)."""
    from gguf import GGUFReader, LlamaFileType

    reader = GGUFReader(str(gguf_path))
    field = reader.fields.get("general.file_type")
    name = "quantized" if field is None else LlamaFileType(int(field.contents())).name.removeprefix("MOSTLY_")
    tensors = [t for t in reader.tensors if len(t.shape) == 2]
    return name, sum(int(t.n_bytes) for t in tensors), sum(2 * int(t.n_elements) for t in tensors)


def chat_prompts(llm: LLM, num: int) -> list[tuple[str, list[int]]]:
    """The first ``num`` prompts, each one user turn through the model's chat template."""
    return [(text[:40], llm.render_chat([{"role": "user", "content": text}])[1]) for text in CHAT_PROMPTS[:num]]


def hf_export(gguf_path: Path, out_dir: Path) -> Path:
    """An HF float32 directory of the same weights, made once by transformers' GGUF loader (the HF row's input)."""
    if (out_dir / "config.json").is_file():
        return out_dir
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    kw = {"gguf_file": gguf_path.name}
    tok = AutoTokenizer.from_pretrained(gguf_path.parent, **kw)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, dtype=torch.float32,
                                                 quantization_config=GgufConfig(dequantize=True), **kw)  # fmt: skip
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return out_dir


# --- ours --------------------------------------------------------------------------------------------------------


def batch_tps(llm: LLM, prompts: list[list[int]], n: int) -> float:
    """Summed generation tok/s of ``prompts`` decoded together: tokens over the longest request's decode time."""
    from spec_engine import SamplingParams

    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True), use_tqdm=False)  # fmt: skip
    decode_s = max(len(o.outputs[0].token_ids) / o.metrics["decode_tokens_per_s"] for o in outs)
    return sum(len(o.outputs[0].token_ids) for o in outs) / decode_s


def summarize(modes: list[Mode]) -> dict:
    return {m.name: m.summary() for m in modes}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer rounds and prompts")
    ap.add_argument("--model", default="smollm2", help="a GGUF file or a registry name (default smollm2)")
    ap.add_argument("--llama-cpp", default=os.environ.get("LLAMA_CPP_DIR"), help="llama.cpp source dir with build/")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=None, help="rounds of parts 2-4 (default 5, quick 2)")
    ap.add_argument("--skip-hf", action="store_true", help="leave HF transformers out (its load takes ~1 min)")
    ap.add_argument("--cache", default="/tmp/specdec-bench-smollm2", help="F16 copy and HF export land here")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "out" / "bench_smollm2.json"))
    args = ap.parse_args(argv)
    rounds = args.rounds or (2 if args.quick else 5)
    num_prompts = 2 if args.quick else len(CHAT_PROMPTS)
    torch.set_num_threads(args.threads)
    cache = Path(args.cache)
    cache.mkdir(parents=True, exist_ok=True)
    gguf = resolve_gguf(args.model)
    notes: list[str] = []
    result: dict = {"machine": platform.node(), "cpu": cpu_name(), "threads": args.threads, "model": str(gguf)}

    result["bandwidth"] = probe(args.threads)
    read = result["bandwidth"]["read_gbps"]
    print(f"[1] read probe {read:.1f} GB/s (copy {result['bandwidth']['copy_gbps']:.1f})", flush=True)

    root = Path(args.llama_cpp) if args.llama_cpp else None
    lbench, lbatched, lquant = (
        llama_cpp.binary(root, n) for n in ("llama-bench", "llama-batched-bench", "llama-quantize")
    )
    if not (lbench and lquant):
        notes.append("llama.cpp skipped: no llama-bench/llama-quantize under --llama-cpp (see bench/llama_cpp.md)")
    f16 = llama_cpp.f16_copy(lquant, gguf, cache) if lquant else None

    stored, stored_bytes, bf16_bytes = stored_weights(gguf)  # the type: Q4_1 for the pulled SmolLM2
    llms = {"ours bf16": LLM(str(gguf), None, dtype="bfloat16", max_num_seqs=max(BATCHES))}
    try:
        llms[f"ours {stored} as stored"] = LLM(str(gguf), None, dtype="bfloat16", quantization="gguf",
                                               max_num_seqs=max(BATCHES))  # fmt: skip
    except (TypeError, ValueError) as e:
        notes.append(f"ours {stored} as stored skipped: {e}")
    prompts = chat_prompts(llms["ours bf16"], num_prompts)
    records: dict = {}
    bytes_per_token = {"ours bf16": bf16_bytes, f"ours {stored} as stored": stored_bytes}

    # part 2: batch-1 decode
    modes = [Mode(name, ours_sampler(llm, prompts, args.max_tokens, records.setdefault(name, {})), "tok/s")
             for name, llm in llms.items()]  # fmt: skip
    modes.append(Mode("ours bf16 (control)", ours_sampler(llms["ours bf16"], prompts, args.max_tokens, {}), "tok/s"))
    if not args.skip_hf:
        hf_dir = hf_export(gguf, cache / "hf")
        modes.append(Mode("HF transformers f32", hf_sampler(str(hf_dir), torch.float32, prompts, args.max_tokens,
                                                            records.setdefault("hf", {})), "tok/s"))  # fmt: skip
    if lbench:
        for label, path in (("llama.cpp F16", f16), (f"llama.cpp {stored}", gguf)):
            if path is None:  # (no llama-quantize: no F16 copy to time)
                continue
            modes.append(
                Mode(label, llama_cpp.decode_sampler(lbench, path, args.threads, args.max_tokens, CTX, 2), "tok/s")
            )
    run_rounds(modes, rounds, "decode")
    result["decode"] = summarize(modes)
    for name, s in result["decode"].items():
        base = name.removesuffix(" (control)")
        if base in bytes_per_token and s["median"]:
            s["gbps"] = s["median"] * bytes_per_token[base] / 1e9
            s["of_probe"] = s["gbps"] / read
    ref = records.get("hf")
    if ref:
        same = sum(records["ours bf16"][k]["tokens"][:8] == ref[k]["tokens"][:8] for k in ref)
        notes.append(f"first 8 greedy tokens, ours bf16 vs HF f32: {same}/{len(ref)} prompts identical")

    # part 3: r(T)
    eng = llms["ours bf16"].engine
    fwd_modes = []
    for T in SIZES:
        fn = forward_step(eng.target, eng.kv, 1, CTX, T)
        fn()
        fwd_modes.append(Mode(f"ours fwd T={T}", timed_ms(fn, 5), "ms"))
        if lbench and f16:
            fwd_modes.append(
                Mode(f"llama.cpp F16 fwd T={T}", llama_cpp.forward_sampler(lbench, f16, args.threads, T, CTX, 5), "ms")
            )
    run_rounds(fwd_modes, rounds, "r(T)")
    fwd = summarize(fwd_modes)
    for who in ("ours", "llama.cpp F16"):
        if f"{who} fwd T=1" in fwd:
            one = fwd[f"{who} fwd T=1"]["median"]
            for T in SIZES:
                fwd[f"{who} fwd T={T}"]["r"] = fwd[f"{who} fwd T={T}"]["median"] / one
    result["forward"] = fwd

    # part 4: batch throughput
    ids = [p[1] for p in prompts]
    batch_modes = [Mode(f"ours bf16 B={B}", lambda B=B: batch_tps(llms["ours bf16"], (ids * B)[:B], args.max_tokens),
                        "tok/s") for B in BATCHES]  # fmt: skip
    if lbatched:
        for B in BATCHES:  # one llama-batched-bench run serves every B: the first mode runs it, the others read it
            batch_modes.append(Mode(f"llama.cpp F16 B={B}", None, "tok/s"))
        runs: list[dict[int, float]] = []

        def llama_round(B: int):
            if B == BATCHES[0]:
                runs.append(llama_cpp.batched(lbatched, f16, args.threads, args.max_tokens, CTX, BATCHES))
            return runs[-1][B]

        for m in batch_modes[len(BATCHES) :]:
            m.fn = lambda B=int(m.name.split("=")[1]): llama_round(B)
    run_rounds(batch_modes, rounds, "batch")
    result["batch"] = summarize(batch_modes)

    result["notes"] = notes
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(markdown(result))
    print(f"JSON: {out}")
    return 0


def markdown(result: dict) -> str:
    def fmt(s):
        return "-" if s.get("median") is None else f"{s['median']:.2f} [{s['p20']:.2f}, {s['p80']:.2f}]"

    lines = [f"machine: {result['cpu']}, {result['threads']} threads; read probe "
             f"{result['bandwidth']['read_gbps']:.1f} GB/s", "", "| decode, batch 1 | tok/s | GB/s | of probe |",
             "|---|---|---|---|"]  # fmt: skip
    for name, s in result["decode"].items():
        gb = f"{s['gbps']:.1f}" if "gbps" in s else "-"
        share = f"{100 * s['of_probe']:.0f}%" if "of_probe" in s else "-"
        lines.append(f"| {name} | {fmt(s)} | {gb} | {share} |")
    lines += ["", "| forward | ms | r(T) |", "|---|---|---|"]
    for name, s in result["forward"].items():
        lines.append(f"| {name} | {fmt(s)} | {s.get('r', 0):.2f} |")
    lines += ["", "| batch | summed tok/s |", "|---|---|"]
    for name, s in result["batch"].items():
        lines.append(f"| {name} | {fmt(s)} |")
    lines += ["", *(f"- {n}" for n in result["notes"])]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
