"""The training data of an EAGLE-3 head: the target's own greedy answers to a prompt set, with its features.

    python -m spec_engine.zoo.eagle_data --target /tmp/smol/hf --out runs/eagle3/data

Each batch of ``--batch`` prompts (ChatML-rendered with the target's default system prompt) is answered by our engine
(``LLM.generate``, greedy, ``--max-tokens``), then the target runs once more over every prompt + answer with
``forward_features`` (the engine's own kernel and precision, the features the head is handed at inference) and the
residual streams entering the head's target layers are kept. One shard per batch (``shard_NNNNN.pt``):

    ids [N] int64          the prompts' ids in the prompt set
    offsets [N + 1] int64  sample i's tokens are tokens[offsets[i]:offsets[i + 1]]
    prompt_lens [N] int64  how many of them are the prompt (the loss is on the answer)
    tokens [M] int32       prompt + answer, every sample back to back
    features [M, 3 H] bf16 the target layers' input streams at every token, concatenated

Resumable and stoppable at any time: a shard is written whole (temporary name, then renamed), and a restart skips
the prompts already in a shard.
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
def target_features(target, tokens: list[int], layers: tuple[int, ...]) -> torch.Tensor:
    """The residual streams entering ``layers`` at every token of one sequence: [T, len(layers) * H].

    The engine's prefill over the whole sequence in one causal pass, on a throwaway contiguous KV cache."""
    cfg = target.config
    T = len(tokens)
    dtype = target.model.embed_tokens.weight.dtype
    kv = torch.zeros(cfg.num_hidden_layers, 2, 1, T, cfg.num_key_value_heads, cfg.head_dim, dtype=dtype)
    ids = torch.tensor(tokens, dtype=torch.int64)[None]  # [1, T]
    mask = torch.ones(T, T, dtype=torch.bool).tril()[None]  # [1, T, T]
    _, feats = target.forward_features(ids, torch.arange(T)[None], kv, torch.zeros(1, dtype=torch.int32), mask,
                                       layers=layers)  # fmt: skip
    return feats[0]


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
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from spec_engine.llm import LLM, SamplingParams

    prompts = [json.loads(line) for line in args.prompts.read_text().splitlines()]
    prompts = prompts[: args.limit] if args.limit else prompts
    args.out.mkdir(parents=True, exist_ok=True)
    done = done_ids(args.out)
    todo = [p for p in prompts if p["id"] not in done]
    print(f"{len(done)} prompts done, {len(todo)} to go", flush=True)
    llm = LLM(model=str(args.target), dtype=args.dtype, max_num_seqs=args.max_num_seqs)
    layers = eagle3_target_layers(llm.target.config.num_hidden_layers)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    shard_no = len(list(args.out.glob("shard_*.pt")))
    total_new = 0
    start = time.perf_counter()
    for i in range(0, len(todo), args.batch):
        batch = todo[i : i + args.batch]
        outs = llm.generate([chatml(p["prompt"]) for p in batch], params, use_tqdm=False)
        seqs = [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outs]
        feats = [target_features(llm.target, s, layers) for s in seqs]
        lens = torch.tensor([len(s) for s in seqs])
        shard = {
            "ids": torch.tensor([p["id"] for p in batch]),
            "offsets": torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)]),
            "prompt_lens": torch.tensor([len(o.prompt_token_ids) for o in outs]),
            "tokens": torch.tensor([t for s in seqs for t in s], dtype=torch.int32),
            "features": torch.cat(feats).to(torch.bfloat16),
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
