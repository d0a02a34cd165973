"""The training data of an EAGLE-3 head: the target's own answers to a prompt set, with its features.

    python -m spec_engine.zoo.eagle_data --target /tmp/smol/hf --out runs/eagle3/data
    python -m spec_engine.zoo.eagle_data --target smollm2 --out DIR --temperature 0.8 --seed 1 --device cuda

Each batch of ``--batch`` prompts (ChatML-rendered with the target's default system prompt) is answered by our engine
(``LLM.generate``, ``--max-tokens``; greedy, or sampled at ``--temperature`` for more varied contexts), then the
target runs once more over every prompt + answer and the residual streams entering the head's target layers are
kept, with the target's greedy next token at every position (the head's label: for a greedy answer, the answer's own
next token). On the CPU that pass is ``forward_features`` (the engine's own kernel and precision, the features the
head is handed at inference); on other devices it is the same model in batched torch ops (``torch_features``). One
shard per batch (``shard_NNNNN.pt``):

    ids [N] int64          the prompts' ids in the prompt set
    offsets [N + 1] int64  sample i's tokens are tokens[offsets[i]:offsets[i + 1]]
    prompt_lens [N] int64  how many of them are the prompt (the loss is on the answer)
    tokens [M] int32       prompt + answer, every sample back to back
    features [M, 3 H] bf16 the target layers' input streams at every token, concatenated
    next [M] int32         the target's greedy token after each position (absent in shards of older runs)
    temperature float      the answers' sampling temperature (0: greedy)

Resumable and stoppable at any time: a shard is written whole (temporary name, then renamed), and a restart skips
the prompts already in a shard. ``--max-seconds`` stops starting new batches after that long (a time-boxed run).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from spec_engine.drafters.eagle import eagle3_target_layers

SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def chatml(user: str, system: str = SYSTEM) -> str:
    """A single-turn ChatML request ending where the assistant's answer starts (SmolLM2's template)."""
    return f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


@torch.no_grad()
def target_features(target, tokens: list[int], layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """(the residual streams entering ``layers`` [T, len(layers) * H], the target's greedy next token [T] int64) at
    every token of one sequence.

    The engine's prefill over the whole sequence in one causal pass, on a throwaway contiguous KV cache."""
    cfg = target.config
    T = len(tokens)
    dtype = target.model.embed_tokens.weight.dtype
    kv = torch.zeros(cfg.num_hidden_layers, 2, 1, T, cfg.num_key_value_heads, cfg.head_dim, dtype=dtype)
    ids = torch.tensor(tokens, dtype=torch.int64)[None]  # [1, T]
    mask = torch.ones(T, T, dtype=torch.bool).tril()[None]  # [1, T, T]
    hidden, feats = target.forward_features(ids, torch.arange(T)[None], kv, torch.zeros(1, dtype=torch.int32), mask,
                                            layers=layers)  # fmt: skip
    return feats[0], target.logits(hidden[0]).argmax(-1)


@torch.no_grad()
def torch_features(target, tokens: torch.Tensor, layers) -> tuple[torch.Tensor, torch.Tensor]:
    """(the residual streams entering ``layers``, concatenated [B, S, n H]; the target's greedy next token [B, S])
    for token windows [B, S] (right-padded: causal, so padding changes no earlier position), in plain torch ops on
    the target's device (no cache, no native kernels)."""
    B, S = tokens.shape
    h = target.model.embed_tokens(tokens)
    cos, sin = target._rope(torch.arange(S, device=tokens.device).expand(B, S), h.dtype).unsqueeze(3)
    streams = {}
    for i, layer in enumerate(target.model.layers):
        streams[i] = h
        h = h + layer.self_attn.forward_train(layer.input_layernorm(h), cos, sin)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    nxt = target.lm_head(target.model.norm(h)).argmax(-1)  # [B, S]
    return torch.cat([streams[i] for i in layers], -1), nxt


def answer_features(target, seqs: list[list[int]], layers, max_tokens: int = 32768) -> list[tuple]:
    """(streams [T, n H] bf16 on the CPU, next [T] int32) of each sequence: ``target_features`` one by one on the
    CPU, ``torch_features`` over padded groups of about ``max_tokens`` tokens elsewhere."""
    device = target.model.embed_tokens.weight.device
    if device.type == "cpu":
        return [(f.to(torch.bfloat16), n.to(torch.int32)) for f, n in (target_features(target, s, layers)
                                                                        for s in seqs)]  # fmt: skip
    out: list = [None] * len(seqs)
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    i = 0
    while i < len(order):
        j = i + 1
        while j < len(order) and len(seqs[order[j]]) * (j - i + 1) <= max_tokens:
            j += 1
        group = order[i:j]
        S = len(seqs[group[-1]])
        ids = torch.zeros(len(group), S, dtype=torch.int64)
        for b, k in enumerate(group):
            ids[b, : len(seqs[k])] = torch.tensor(seqs[k])
        feats, nxt = torch_features(target, ids.to(device), layers)
        feats, nxt = feats.to(torch.bfloat16).cpu(), nxt.to(torch.int32).cpu()
        for b, k in enumerate(group):
            out[k] = (feats[b, : len(seqs[k])], nxt[b, : len(seqs[k])])
        i = j
    return out


def done_ids(out: Path) -> set[int]:
    done = set()
    for shard in sorted(out.glob("shard_*.pt")):
        done.update(torch.load(shard)["ids"].tolist())
    return done


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--target", type=Path, required=True, help="the target's HF directory")
    ap.add_argument("--prompts", type=Path, default=Path(__file__).parent / "data" / "eagle_prompts.jsonl")
    ap.add_argument("--out", type=Path, required=True, help="the shards' directory")
    ap.add_argument("--batch", type=int, default=32, help="prompts per generate call and per shard")
    ap.add_argument("--max-num-seqs", type=int, default=16, help="requests decoded together (the engine refills)")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--limit", type=int, default=None, help="stop after this many prompts")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cpu", help="where the target runs (cpu, cuda)")
    ap.add_argument("--kv-cache-gib", type=float, default=None, help="the engine's KV cache (default: its own)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy answers; > 0: sampled answers")
    ap.add_argument("--seed", type=int, default=0, help="sampled answers: prompt i's seed is seed * 1000003 + i")
    ap.add_argument("--max-seconds", type=float, default=None, help="start no new batch after this many seconds")
    args = ap.parse_args(argv)
    if args.temperature < 0:
        ap.error(f"--temperature must be >= 0, got {args.temperature}")
    if args.max_seconds is not None and args.max_seconds < 0:
        ap.error(f"--max-seconds must be >= 0, got {args.max_seconds}")
    if args.kv_cache_gib is not None and args.kv_cache_gib <= 0:
        ap.error(f"--kv-cache-gib must be > 0, got {args.kv_cache_gib}")
    torch.set_num_threads(args.threads)
    from spec_engine.llm import LLM, SamplingParams

    prompts = [json.loads(line) for line in args.prompts.read_text().splitlines()]
    prompts = prompts[: args.limit] if args.limit else prompts
    args.out.mkdir(parents=True, exist_ok=True)
    done = done_ids(args.out)
    todo = [p for p in prompts if p["id"] not in done]
    print(f"{len(done)} prompts done, {len(todo)} to go", flush=True)
    kv = None if args.kv_cache_gib is None else int(args.kv_cache_gib * (1 << 30))
    llm = LLM(
        model=str(args.target), dtype=args.dtype, max_num_seqs=args.max_num_seqs, device=args.device, kv_cache_memory=kv
    )
    layers = eagle3_target_layers(llm.target.config.num_hidden_layers)
    shard_no = len(list(args.out.glob("shard_*.pt")))
    total_new = 0
    start = time.perf_counter()
    for i in range(0, len(todo), args.batch):
        if args.max_seconds is not None and time.perf_counter() - start > args.max_seconds:
            print(f"--max-seconds {args.max_seconds:g} reached: {len(todo) - i} prompts to go", flush=True)
            break
        batch = todo[i : i + args.batch]
        params = [SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                 seed=None if args.temperature == 0 else args.seed * 1_000_003 + p["id"])
                  for p in batch]  # fmt: skip
        outs = llm.generate([chatml(p["prompt"]) for p in batch], params, use_tqdm=False)
        seqs = [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outs]
        feats = answer_features(llm.target, seqs, layers)
        lens = torch.tensor([len(s) for s in seqs])
        shard = {
            "ids": torch.tensor([p["id"] for p in batch]),
            "offsets": torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)]),
            "prompt_lens": torch.tensor([len(o.prompt_token_ids) for o in outs]),
            "tokens": torch.tensor([t for s in seqs for t in s], dtype=torch.int32),
            "features": torch.cat([f for f, _ in feats]),
            "next": torch.cat([n for _, n in feats]),
            "temperature": args.temperature,
            "target_layers": torch.tensor(layers),
        }
        tmp = args.out / f"shard_{shard_no:05d}.pt.tmp"
        torch.save(shard, tmp)
        tmp.rename(args.out / f"shard_{shard_no:05d}.pt")
        shard_no += 1
        total_new += sum(len(o.outputs[0].token_ids) for o in outs)
        elapsed = time.perf_counter() - start
        print(f"shard {shard_no}: {len(done) + i + len(batch)} prompts, {total_new} answer tokens this run, "
              f"{total_new / elapsed:.1f} answer tok/s (generation + features)", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
