"""Speed at real sizes, on synthetic weights: us against llama.cpp on GGUF files in the shapes of Llama-3.2-1B and
Llama-3.1-8B.

Each shape is written once as a random-weight F16 GGUF (``gguf``'s writer, tensor by tensor, so an 8B file never sits
in memory), with SmolLM2's tokenizer (copied from its GGUF, so the vocabulary is real: 49,152 tokens instead of
Llama 3's 128,256), then ``llama-quantize`` makes the other types (Q8_0, Q4_K_M, ...). On each file, rounds interleave
us and llama.cpp (``llama-bench``, 2 threads):

- ``decode``: plain greedy decoding tok/s after a ``CTX``-token context (ours: one engine forward + logits per token
  on the paged cache, ``bench.harness.forward_step`` at T = 1; llama.cpp: ``tg`` at depth ``CTX``);
- ``prefill``: a 512-token prompt's forward, tok/s (``pp512``);
- ``r(T)``: a T-token forward over the ``CTX``-token context over a 1-token one, T = 1, 2, 4, 5, 8, 16 (llama.cpp: ``pp
  T`` at depth ``CTX``, one ubatch);
- ``control``: our T = 1 forward timed twice per round; its ratio is the run's noise;
- ``rss_gib``: our process's resident memory with the model and a ``max_model_len``-token KV cache loaded.

``--types Q4_K_M-random`` writes a file of random K-quant blocks in Q4_K_M's mix instead (``random_mix_type``, no
``llama-quantize``; without ``--llama-cpp`` only our rows run): our speed on a machine without llama.cpp.
``Q8_0-random`` likewise, every matrix Q8_0: an 8B Q8_0 file without the 16 GB F16 file first.

``--quant-activations float,int8`` runs our engine on a quantized file in each numeric mode (``quant_activations``),
one model per mode, interleaved with each other and llama.cpp in every round (rows ``ours`` and ``ours int8``);
by default the engine's own mode (``default_quant_activations``: int8 with AVX2 and up).

Usage: python bench/bench_sizes.py --llama-cpp DIR [--shapes 1b,8b] [--types F16,Q8_0,Q4_K_M] [--dir /tmp/sizes]
[--rounds 3] [--quick] [--quant-activations float,int8]. Writes bench/out/bench_sizes.json and prints one markdown
table per file.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from a checkout

from bench.harness import cpu_name, forward_step  # noqa: E402
from bench.llama_cpp import binary, forward_sampler  # noqa: E402

# Llama-3.2-1B and Llama-3.1-8B (their config.json), with SmolLM2's vocabulary; 1b ties its embeddings as the real one
SHAPES = {
    "1b": dict(hidden=2048, ffn=8192, layers=16, heads=32, kv_heads=8, tied=True),
    "8b": dict(hidden=4096, ffn=14336, layers=32, heads=32, kv_heads=8, tied=False),
    "tiny": dict(hidden=256, ffn=512, layers=2, heads=4, kv_heads=2, tied=True),  # the script's own check (--quick)
}
WIDTHS = (1, 2, 4, 5, 8, 16)
CTX = 256
REPS = 3  # timed calls of ours per width and round, after one untimed (llama-bench warms up and repeats likewise)
PREFILL = 512
THREADS = 2
FLOAT_TYPES = ("F32", "F16", "BF16")


def random_mix_type(name: str, layer: int) -> str:
    """The block type of tensor ``name`` (in layer ``layer``) in a random-blocks file: Q4_K_M's mix as llama-quantize
    makes it, simplified (Q6_K for the output and for attn_v and ffn_down in every other layer; the embedding Q6_K
    too, where llama-quantize keeps an untied one Q4_K: a step reads one row of it)."""
    if name.startswith(("token_embd", "output.")) or (name.endswith(("attn_v.weight", "ffn_down.weight"))
                                                      and layer % 2 == 0):  # fmt: skip
        return "Q6_K"
    return "Q4_K"


# --types' names for files of random blocks (no llama-quantize needed): each matrix's type (of its name and layer),
# the file's type
RANDOM_TYPES = {"Q4_K_M-random": (random_mix_type, "MOSTLY_Q4_K_M"),
                "Q8_0-random": (lambda name, layer: "Q8_0", "MOSTLY_Q8_0")}  # fmt: skip


def write_random_gguf(path: Path, shape: dict, tokenizer_gguf: Path, seed: int = 0, blocks: str | None = None) -> None:
    """A llama-architecture F16 GGUF of ``shape`` with N(0, 0.02) weights and unit norms, written tensor by tensor;
    with ``blocks`` (a key of ``RANDOM_TYPES``), its matrices random blocks instead (Q4_K_M's mix: ``random_mix_type``;
    scales as ``bench_quant_linear``'s): our side's speed on a machine without llama.cpp."""
    import gguf

    from bench.bench_quant_linear import random_blocks
    from spec_kernels.types import quant_row_bytes

    reader = gguf.GGUFReader(str(tokenizer_gguf))
    tokens = [bytes(reader.fields["tokenizer.ggml.tokens"].parts[i]).decode("utf-8")
              for i in reader.fields["tokenizer.ggml.tokens"].data]  # fmt: skip
    vocab, H, F, L = len(tokens), shape["hidden"], shape["ffn"], shape["layers"]
    head_dim = H // shape["heads"]
    tensors = [("token_embd.weight", (vocab, H)), ("output_norm.weight", (H,))]
    tensors += [] if shape["tied"] else [("output.weight", (vocab, H))]
    for i in range(L):
        p = f"blk.{i}."
        kv = shape["kv_heads"] * head_dim
        dims = {"attn_norm": (H,), "ffn_norm": (H,), "attn_q": (H, H), "attn_k": (kv, H), "attn_v": (kv, H),
                "attn_output": (H, H), "ffn_gate": (F, H), "ffn_up": (F, H), "ffn_down": (H, F)}  # fmt: skip
        tensors += [(f"{p}{name}.weight", d) for name, d in dims.items()]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(f"random-llama-{path.stem}")
    w.add_context_length(8192)
    w.add_embedding_length(H)
    w.add_feed_forward_length(F)
    w.add_block_count(L)
    w.add_head_count(shape["heads"])
    w.add_head_count_kv(shape["kv_heads"])
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    matrix_type, file_type = RANDOM_TYPES[blocks] if blocks else (None, "MOSTLY_F16")  # (name, layer) -> type
    w.add_file_type(getattr(gguf.LlamaFileType, file_type))
    for name, field in reader.fields.items():  # the tokenizer, as SmolLM2's file holds it
        if name.startswith("tokenizer."):
            value = field.contents()
            w.add_key_value(name, value, field.types[0], field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY
                            else None)  # fmt: skip
    rng = np.random.default_rng(seed)

    def qtype(name: str) -> str | None:
        layer = int(name.split(".")[1]) if name.startswith("blk.") else 0
        return None if name.endswith("norm.weight") or not blocks else matrix_type(name, layer)

    types = {name: qtype(name) for name, _ in tensors}
    for name, dims in tensors:
        if types[name] is not None:
            byte_shape = (dims[0], quant_row_bytes(types[name], dims[1]))
            w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)),
                              raw_dtype=getattr(gguf.GGMLQuantizationType, types[name]))  # fmt: skip
            continue
        dtype = np.float32 if name.endswith("norm.weight") else np.float16
        nbytes = int(np.prod(dims)) * np.dtype(dtype).itemsize
        w.add_tensor_info(name, dims, np.dtype(dtype), nbytes)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, dims in tensors:
        if name.endswith("norm.weight"):
            data = np.ones(dims, dtype=np.float32)
        elif types[name] is not None:
            data = random_blocks(dims[0], dims[1], types[name], rng).numpy()  # [N, row bytes]
        else:
            data = (rng.standard_normal(dims, dtype=np.float32) * 0.02).astype(np.float16)
        w.write_tensor_data(data)
    w.close()


def make_files(out_dir: Path, shape_name: str, types: list[str], quantize: Path | None, tokenizer: Path) -> dict:
    """{type: path} for ``shape_name``: the F16 file written once, each other type quantized from it once
    (``RANDOM_TYPES``: written with random blocks instead, no F16 file)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    f16 = out_dir / f"{shape_name}.F16.gguf"
    if not f16.is_file() and any(t not in RANDOM_TYPES for t in types):
        print(f"writing {f16} ...", flush=True)
        write_random_gguf(f16.with_suffix(".tmp"), SHAPES[shape_name], tokenizer)
        f16.with_suffix(".tmp").rename(f16)
    files = {}
    for t in types:
        path = out_dir / f"{shape_name}.{t}.gguf"
        if t in RANDOM_TYPES and not path.is_file():
            print(f"writing {path} (random blocks) ...", flush=True)
            write_random_gguf(path.with_suffix(".tmp"), SHAPES[shape_name], tokenizer, blocks=t)
            path.with_suffix(".tmp").rename(path)
        if t != "F16" and t not in RANDOM_TYPES and not path.is_file():
            if quantize is None:
                raise SystemExit(f"{t} needs llama-quantize (--llama-cpp DIR)")
            print(f"llama-quantize {t} ...", flush=True)
            part = path.with_name(path.stem + ".part.gguf").resolve()  # (absolute: llama-quantize reads an output
            # name that starts with a digit, "1b.Q4_K_M.gguf", as a numeric type)
            subprocess.run([str(quantize), "--allow-requantize", str(f16.resolve()), str(part), t], check=True,
                           capture_output=True)  # fmt: skip
            part.rename(path)
        files[t] = path
    return files


def rss_gib() -> float:
    """This process's resident memory (VmRSS), GiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 2**20
    return float("nan")


def ours(path: Path, qtype: str, rounds: int, activations: str = "float"):
    """Our engine on ``path`` (quantized weights: in ``activations`` mode): samplers of ms per forward keyed like
    llama.cpp's, and the resident memory."""
    from spec_engine.llm import LLM

    quant = None if qtype in FLOAT_TYPES else "gguf"
    kw = {} if quant is None else {"quant_activations": activations}
    llm = LLM(model=str(path), dtype="bfloat16", quantization=quant, max_num_seqs=1, max_model_len=1024, **kw)
    eng = llm.engine
    fns = {f"T{t}": forward_step(eng.target, eng.kv, 1, CTX, t) for t in WIDTHS}
    fns["prefill"] = forward_step(eng.target, eng.kv, 1, 0, PREFILL)
    for fn in fns.values():
        fn()  # warm-up: lazy builds, first-call allocations

    def timed(fn, reps: int, warm: bool = True):
        def sample() -> list[float]:
            if warm:  # untimed: the first call after llama.cpp's process ran finds cold caches
                fn()
            out = []
            for _ in range(reps):
                start = time.perf_counter()
                fn()
                out.append(1e3 * (time.perf_counter() - start))
            return out

        return sample

    samplers = {k: timed(fn, REPS) for k, fn in fns.items() if k != "prefill"}
    samplers["prefill"] = timed(fns["prefill"], 1, warm=False)  # (compute-bound: a cold cache costs it little)
    samplers["control"] = timed(fns["T1"], REPS)
    return llm, samplers, rss_gib()


def theirs(llama_bench: Path, path: Path, reps: int) -> dict:
    """llama-bench samplers of ms per forward, keyed as ``ours``."""
    samplers = {f"T{t}": forward_sampler(llama_bench, path, THREADS, t, CTX, reps) for t in WIDTHS}
    samplers["prefill"] = forward_sampler(llama_bench, path, THREADS, PREFILL, 0, 1)
    return samplers


def _who(activations: str) -> str:
    return "ours" if activations == "float" else f"ours {activations}"


def run_file(path: Path, qtype: str, llama_bench: Path | None, rounds: int, modes: tuple[str, ...] = ("float",)):
    """Rounds alternating us (in each numeric mode of ``modes``; a float file: once) and llama.cpp on one file; the
    medians, tok/s and r(T)."""
    torch.set_num_threads(THREADS)
    if qtype in FLOAT_TYPES:
        modes = ("float",)
    contenders, models, rss = {}, [], float("nan")
    for mode in modes:
        llm, contenders[_who(mode)], rss = ours(path, qtype, rounds, mode)
        models.append(llm)
    if llama_bench is not None:
        contenders["llama.cpp"] = theirs(llama_bench, path, REPS)
    samples = {(who, k): [] for who, fns in contenders.items() for k in fns}
    for r in range(rounds):
        for who, fns in contenders.items():
            for k, fn in fns.items():
                samples[(who, k)] += fn()
        print(f"  round {r + 1}/{rounds}", flush=True)
    del llm, models
    gc.collect()
    med = {key: statistics.median(v) if v else None for key, v in samples.items()}
    result = {"type": qtype, "file_gib": path.stat().st_size / 2**30, "rss_gib": rss}  # (the last model loaded)
    for who in contenders:
        ms = {k: med.get((who, k)) for k in [f"T{t}" for t in WIDTHS] + ["prefill", "control"]}
        if ms["T1"] is None:
            continue
        result[who] = {
            "decode_tok_s": 1e3 / ms["T1"],
            "prefill_tok_s": PREFILL * 1e3 / ms["prefill"] if ms["prefill"] else None,
            "r": {t: ms[f"T{t}"] / ms["T1"] for t in WIDTHS},
            "ms": ms,
        }
    for who in _ours(result):
        if "llama.cpp" in result:
            result[f"{who.replace(' ', '_')}_over_llama_cpp"] = {
                "decode": result[who]["decode_tok_s"] / result["llama.cpp"]["decode_tok_s"],
                "prefill": result[who]["prefill_tok_s"] / result["llama.cpp"]["prefill_tok_s"],
                "control": result[who]["ms"]["T1"] / result[who]["ms"]["control"],
            }
    return result


def _ours(res: dict) -> list[str]:
    """Our rows of a result: ``ours`` and ``ours <mode>``."""
    return [k for k in res if k.startswith("ours") and not k.endswith("_over_llama_cpp")]


def markdown(name: str, res: dict) -> str:
    rows = [f"### {name} {res['type']} ({res['file_gib']:.2f} GiB file; ours resident {res['rss_gib']:.2f} GiB)", "",
            "| | decode tok/s | prefill 512 tok/s | " + " | ".join(f"r({t})" for t in WIDTHS) + " |",
            "|---" * (3 + len(WIDTHS)) + "|"]  # fmt: skip
    for who in [*_ours(res), "llama.cpp"]:
        if who in res:
            x = res[who]
            pre = f"{x['prefill_tok_s']:.1f}" if x["prefill_tok_s"] else "-"
            rows.append(f"| {who} | {x['decode_tok_s']:.2f} | {pre} | " + " | ".join(f"{x['r'][t]:.2f}" for t in WIDTHS)
                        + " |")  # fmt: skip
    for who in _ours(res):
        q = res.get(f"{who.replace(' ', '_')}_over_llama_cpp")
        if q is not None:
            rows.append(
                f"| {who} / llama.cpp | {q['decode']:.2f}x | {q['prefill']:.2f}x | control {q['control']:.3f} |"
            )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-cpp", type=Path, help="llama.cpp source or install dir (bench/llama_cpp.md)")
    parser.add_argument("--shapes", default="1b", help="comma-separated: 1b, 8b (tiny: the script's own check)")
    parser.add_argument("--types", default="F16,Q8_0,Q4_K_M", help="GGUF types (llama-quantize's names)")
    parser.add_argument("--dir", type=Path, default=Path("/tmp/specdec-sizes"), help="where the files are kept")
    parser.add_argument("--tokenizer", type=Path, help="a GGUF whose tokenizer to copy (default: SmolLM2's, pulled)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="the tiny shape, F16 only, one round")
    parser.add_argument("--out", type=Path, default=Path("bench/out/bench_sizes.json"))
    parser.add_argument("--quant-activations", default=None,
                        help="comma-separated numeric modes of ours on quantized files: float, int8 (default: the "
                             "engine's own)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.quant_activations is None:
        from spec_engine.models.loader import default_quant_activations

        args.quant_activations = default_quant_activations()
    modes = tuple(args.quant_activations.split(","))
    if not modes or any(m not in ("float", "int8") for m in modes):
        parser.error(f"--quant-activations takes float and/or int8, got {args.quant_activations!r}")
    if args.quick:
        args.shapes, args.types, args.rounds = "tiny", "F16", 1
    if args.tokenizer is None:
        from spec_engine.zoo.pull import pull

        args.tokenizer = Path(pull("smollm2"))
    quantize = binary(args.llama_cpp, "llama-quantize")
    llama_bench = binary(args.llama_cpp, "llama-bench")
    report = {"cpu": cpu_name(), "threads": THREADS, "ctx": CTX, "torch": torch.__version__, "files": {}}
    for shape in args.shapes.split(","):
        files = make_files(args.dir, shape, args.types.split(","), quantize, args.tokenizer)
        for qtype, path in files.items():
            print(f"== {shape} {qtype}", flush=True)
            res = run_file(path, qtype, llama_bench, args.rounds, modes)
            report["files"][f"{shape}.{qtype}"] = res
            print(markdown(shape, res), flush=True)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(report, indent=1))  # after each file: a long run keeps what it measured
    return 0


if __name__ == "__main__":
    sys.exit(main())
