"""Gemma 2 and Gemma 3 against the Llama layer of the same shape: plain greedy decoding, random weights.

Why: Gemma's layer (sandwich norms, GELU-tanh, soft-capping, sliding windows) runs through ``decoder_layers``'
``LayerVariant``; this prices it against a Llama model of the same matrices (the control row, which also has the
native step runners). Each shape writes three random HF checkpoints with transformers (a test-only dependency) into
``--models``, loads each once, then times them round by round, interleaved. Prompts are token ids (no tokenizer).

Shapes: ``smollm2`` (SmolLM2-135M's: hidden 576, 30 layers, 9 heads / 3 KV of 64, MLP 1536, vocab 49152) and
``gemma3-270m`` (Gemma 3 270M's: hidden 640, 18 layers, 4 heads / 1 KV of 256, MLP 2048, vocab 262144); the sliding
window is 512 (Gemma 3's), every Gemma layer type as its config says.

Usage: python bench/bench_gemma.py [--shapes smollm2,gemma3-270m] [--rounds 3] [--tokens 64] [--models DIR]
Results go to bench/out/bench_gemma.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.harness import cpu_name  # noqa: E402
from spec_engine import LLM, SamplingParams  # noqa: E402

SHAPES = {  # name -> (hidden, layers, heads, kv heads, head_dim, intermediate, vocab)
    "smollm2": (576, 30, 9, 3, 64, 1536, 49152),
    "gemma3-270m": (640, 18, 4, 1, 256, 2048, 262144),
}
FAMILIES = ("llama", "gemma2", "gemma3_text")


def write_model(path: Path, family: str, shape: str) -> Path:
    """A random checkpoint of `family` in `shape` (weights N(0, 0.02), the embedding tied to the output as in Gemma;
    Gemma's soft caps and window as its own)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if (path / "config.json").exists():
        return path
    hidden, layers, heads, kv, head_dim, inter, vocab = SHAPES[shape]
    kw = dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
              head_dim=head_dim, intermediate_size=inter, vocab_size=vocab, max_position_embeddings=4096,
              bos_token_id=None, eos_token_id=None, pad_token_id=None, tie_word_embeddings=True)  # fmt: skip
    if family != "llama":
        kw.update(sliding_window=512, query_pre_attn_scalar=head_dim)
    if family == "gemma2":
        kw.update(attn_logit_softcapping=50.0, final_logit_softcapping=30.0)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **kw))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.02)
    model.save_pretrained(path)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="smollm2", help=f"comma-separated, of {list(SHAPES)}")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64, help="tokens generated per request")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--models", default="/tmp/specdec-bench-gemma", help="where the random checkpoints go")
    args = parser.parse_args()
    torch.set_num_threads(2)
    prompt = [{"prompt_token_ids": [(7 * i + 3) % 1000 + 10 for i in range(32)]}]
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    print(f"# {cpu_name()}, 2 threads, {args.dtype}, {args.tokens} tokens after a 32-token prompt", flush=True)
    results = []
    for shape in args.shapes.split(","):
        llms = {}
        for family in FAMILIES:
            path = write_model(Path(args.models) / f"{shape}-{family}", family, shape)
            llms[family] = LLM(str(path), dtype=args.dtype, max_model_len=1024)
            llms[family].generate(prompt, params, use_tqdm=False)  # warm
        rates = {family: [] for family in FAMILIES}
        for _ in range(args.rounds):
            for family, llm in llms.items():
                start = time.perf_counter()
                llm.generate(prompt, params, use_tqdm=False)
                rates[family].append(args.tokens / (time.perf_counter() - start))
        control = statistics.median(rates["llama"])
        for family in FAMILIES:
            rate = statistics.median(rates[family])
            print(f"{shape:12s} {family:12s} {rate:7.1f} tok/s  {rate / control:5.2f}x the Llama layer", flush=True)
            results.append({"shape": shape, "family": family, "tok_s": rates[family], "vs_llama": rate / control})
        del llms
    out = Path(__file__).resolve().parent / "out" / "bench_gemma.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"cpu": cpu_name(), "dtype": args.dtype, "results": results}, indent=1))
    print(f"saved {out}")


if __name__ == "__main__":
    main()
