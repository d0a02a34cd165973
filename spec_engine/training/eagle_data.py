"""The training data of an EAGLE-3 head: the target's own answers to a prompt set, with its features.

    python -m spec_engine.training.eagle_data --target /tmp/smol/hf --out runs/eagle3/data
    python -m spec_engine.training.eagle_data --target smollm2 --out DIR --temperature 0.8 --seed 1 --device cuda

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

Answers made on one machine can be featured on another (a GPU's, where the features come fast but the machine is
lent briefly): ``--save-answers FILE`` writes the shards of ``--out`` without features or labels (xz-compressed,
~0.5 bytes a token), and ``--answers FILE`` takes those answers instead of generating them (one shard per shard of
the file, their temperatures kept) and runs only the feature pass:

    python -m spec_engine.training.eagle_data --out runs/eagle3/data --save-answers greedy.answers.xz
    python -m spec_engine.training.eagle_data --target smollm2 --device cuda --answers greedy.answers.xz --out DIR

The trainer (``spec_engine.training.train_eagle --layout eagle3``) reads the shards back through this module too
(``ShardSet``: the splits by prompt id, ``collate``: a padded batch, ``token_frequencies``: the ranking the draft
vocabulary is cut from), so the shard format is written and read in one place.
"""

from __future__ import annotations

import argparse
import json
import lzma
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from spec_engine.drafters.eagle import eagle3_target_layers
from spec_engine.training.train import refuse_counts_below_one

SAMPLE_KEYS = ("ids", "offsets", "prompt_lens", "tokens")  # a shard's samples, less their features and labels
SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
PROMPTS = Path(__file__).parent / "data" / "eagle_prompts.jsonl"  # the shipped prompt set
HELD_OUT_EVERY = 33  # prompt ids divisible by this are the validation split (about 3%)


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
        done.update(torch.load(shard, mmap=True)["ids"].tolist())
    return done


def save_answers(data: Path, path: Path) -> int:
    """Write the samples of ``data``'s shards less their features and labels (a list of per-shard dicts: the
    ``SAMPLE_KEYS`` and the temperature), xz-compressed, to ``path``. Returns how many samples it wrote."""
    shards = []
    for f in sorted(data.glob("shard_*.pt")):
        d = torch.load(f, mmap=True)
        shards.append({**{k: d[k] for k in SAMPLE_KEYS}, "temperature": float(d.get("temperature", 0.0))})
    if not shards:
        raise ValueError(f"{data}: no shard_*.pt to take answers from")
    tmp = path.with_name(path.name + ".tmp")
    with lzma.open(tmp, "wb") as fh:
        torch.save(shards, fh)
    tmp.rename(path)
    return sum(len(d["ids"]) for d in shards)


def load_answers(path: Path) -> list[dict]:
    """The per-shard samples ``save_answers`` wrote to ``path``."""
    with lzma.open(path) as fh:
        return torch.load(fh)


Batch = tuple[list[int], list[list[int]], list[int], float]  # prompt ids, prompt + answer tokens, prompt lengths, T


def generated(llm, todo: list[dict], args) -> Iterator[Batch]:
    """The engine's answers to ``todo``'s prompts, ``--batch`` at a time."""
    from spec_engine.llm import SamplingParams

    for i in range(0, len(todo), args.batch):
        batch = todo[i : i + args.batch]
        params = [SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                 seed=None if args.temperature == 0 else args.seed * 1_000_003 + p["id"])
                  for p in batch]  # fmt: skip
        outs = llm.generate([chatml(p["prompt"]) for p in batch], params, use_tqdm=False)
        seqs = [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outs]
        yield [p["id"] for p in batch], seqs, [len(o.prompt_token_ids) for o in outs], args.temperature


def given(shards: list[dict], done: set[int], vocab_size: int) -> Iterator[Batch]:
    """The answers of ``--answers``' shards not yet in ``done``, a shard at a time."""
    for d in shards:
        off = d["offsets"].tolist()
        keep = [i for i, pid in enumerate(d["ids"].tolist()) if pid not in done]
        if not keep:
            continue
        seqs = [d["tokens"][off[i] : off[i + 1]].tolist() for i in keep]
        if max(max(s) for s in seqs) >= vocab_size:
            raise ValueError(
                f"--answers holds token ids past this target's vocabulary ({vocab_size}): another target's?"
            )
        yield [int(d["ids"][i]) for i in keep], seqs, [int(d["prompt_lens"][i]) for i in keep], float(d["temperature"])


# --- reading the shards: the trainer's data ----------------------------------------------------------------------


class ShardSet:
    """The generator's shards in memory (of one or more directories: greedy answers, sampled ones), split by prompt
    id: ``reload`` picks up shards written since the last call. The held-out split keeps greedy answers only (the
    answers the head meets at inference); sampled answers to held-out prompts are left out of both splits.

    Each sample: tokens [T] int64, streams [T, n H] bf16, the prompt length, the target's greedy token after each
    position but the last [T - 1] int64 (a greedy answer's own next tokens in shards that do not store them)."""

    def __init__(self, data_dirs: Path | list[Path]):
        self.dirs = [data_dirs] if isinstance(data_dirs, Path) else list(data_dirs)
        self.seen: set[Path] = set()
        self.train: list[tuple] = []
        self.held: list[tuple] = []
        self.width: int | None = None  # the streams' width, n H (every shard's must agree)

    def reload(self) -> int:
        new = 0
        for shard in sorted(f for d in self.dirs for f in d.glob("shard_*.pt")):
            if shard in self.seen:
                continue
            self.seen.add(shard)
            d = torch.load(shard)
            width = d["features"].shape[1]
            if self.width not in (None, width):
                raise ValueError(f"{shard}: streams of width {width}, the shards before it {self.width} "
                                 "(another target's data in the same directories?)")  # fmt: skip
            self.width = width
            off = d["offsets"].tolist()
            greedy = float(d.get("temperature", 0.0)) == 0.0
            nxt = d["next"].long() if "next" in d else None
            for i, pid in enumerate(d["ids"].tolist()):
                tokens = d["tokens"][off[i] : off[i + 1]].long()
                labels = tokens[1:] if nxt is None else nxt[off[i] : off[i + 1] - 1]
                sample = (tokens, d["features"][off[i] : off[i + 1]], int(d["prompt_lens"][i]), labels)
                if pid % HELD_OUT_EVERY:
                    self.train.append(sample)
                elif greedy:
                    self.held.append(sample)
                else:
                    continue
                new += 1
        return new

    def answer_counts(self, vocab_size: int) -> torch.Tensor:
        """[V] how often the target emitted each token in the training split's answers."""
        counts = torch.zeros(vocab_size, dtype=torch.int64)
        for tokens, _, plen, _ in self.train:
            counts += torch.bincount(tokens[plen:], minlength=vocab_size)
        return counts

    def tokens(self, split: str) -> int:
        return sum(len(s[0]) - s[2] for s in getattr(self, split))


def collate(samples: list[tuple], t2d: torch.Tensor, device="cpu"):
    """A padded batch on ``device``: tokens [B, S], streams [B, S, F], labels [B, S] (draft-vocab index of the
    target's greedy token after p, -1 outside it or past the end), mask [B, S] (p + 1 is an answer token)."""
    S = max(len(s[0]) for s in samples)
    F_ = samples[0][1].shape[1]
    B = len(samples)
    tokens = torch.zeros(B, S, dtype=torch.int64)
    streams = torch.zeros(B, S, F_, dtype=torch.bfloat16)
    labels = torch.full((B, S), -1, dtype=torch.int64)
    mask = torch.zeros(B, S, dtype=torch.bool)
    for b, (t, f, plen, nxt) in enumerate(samples):
        T = len(t)
        tokens[b, :T], streams[b, :T] = t, f
        labels[b, : T - 1] = t2d[nxt]
        mask[b, plen - 1 : T - 1] = True
    return tuple(x.to(device) for x in (tokens, streams, labels, mask))


def stream_samples(target, stream: torch.Tensor, seq_len: int, layers, n: int, seed: int) -> list[tuple]:
    """``n`` corpus windows as samples (tokens, streams, prompt length 1, the target's greedy next tokens): the smoke
    path's stand-in for the generator's shards, the streams computed on the fly (``torch_features``)."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(stream) - seq_len - 1, (n,), generator=g)
    windows = stream[starts[:, None] + torch.arange(seq_len)].long()  # [n, S]
    device = target.model.embed_tokens.weight.device
    feats, nxt = torch_features(target, windows.to(device), layers)
    return [(w, f.to(torch.bfloat16).cpu(), 1, x[:-1].cpu()) for w, f, x in zip(windows, feats, nxt)]


def token_frequencies(data: ShardSet, target_dir: Path, vocab_size: int, smoke: bool = False) -> torch.Tensor:
    """[V] float64: the ranking a draft vocabulary is cut from. The target's answers (their relative frequencies)
    plus half the prompt set's and a sample of the standard library's (about 4M characters, seeded): the answers
    generated so far are too few to rank the tail, and the prompts and the stdlib are the same domain."""
    import random

    from spec_engine.llm import load_tokenizer
    from spec_engine.training.train import corpus_files

    def norm(c):
        return c.double() / max(1, int(c.sum()))

    tok = load_tokenizer(target_dir)
    texts = [json.loads(line)["prompt"] for line in PROMPTS.read_text().splitlines()]
    files, _ = corpus_files()
    random.Random(0).shuffle(files)
    budget = 4_000 if smoke else 4_000_000
    for f in files:
        texts.append(f.read_text(errors="replace"))
        budget -= len(texts[-1])
        if budget <= 0:
            break
    ref = torch.zeros(vocab_size, dtype=torch.int64)
    for enc in tok.encode_batch(texts):
        ref += torch.bincount(torch.tensor(enc.ids, dtype=torch.int64), minlength=vocab_size)[:vocab_size]
    return norm(data.answer_counts(vocab_size)) + 0.5 * norm(ref)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--target", type=Path, help="the target's HF directory, GGUF file or pulled name")
    ap.add_argument("--prompts", type=Path, default=PROMPTS)
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
    ap.add_argument(
        "--answers", type=Path, default=None, help="features only, for this file's answers (--prompts etc. unused)"
    )
    ap.add_argument("--save-answers", type=Path, default=None, help="write --out's answers to this file and stop")
    args = ap.parse_args(argv)
    if args.save_answers is not None:
        try:
            n = save_answers(args.out, args.save_answers)
        except ValueError as e:
            ap.error(str(e))
        print(f"{n} answers of {args.out} -> {args.save_answers} ({args.save_answers.stat().st_size / 1e6:.1f} MB)")
        return
    if args.target is None:
        ap.error("--target is required (except with --save-answers)")
    if args.temperature < 0:
        ap.error(f"--temperature must be >= 0, got {args.temperature}")
    if args.max_seconds is not None and args.max_seconds < 0:
        ap.error(f"--max-seconds must be >= 0, got {args.max_seconds}")
    if args.kv_cache_gib is not None and args.kv_cache_gib <= 0:
        ap.error(f"--kv-cache-gib must be > 0, got {args.kv_cache_gib}")
    if args.answers is not None and not args.answers.is_file():
        ap.error(f"--answers {args.answers}: no such file")
    if args.answers is None and not args.prompts.is_file():
        ap.error(f"--prompts {args.prompts}: no such file")
    refuse_counts_below_one(ap, args, ("batch", "max_num_seqs", "max_tokens", "limit", "threads"))
    torch.set_num_threads(args.threads)
    from spec_engine.llm import LLM

    args.out.mkdir(parents=True, exist_ok=True)
    done = done_ids(args.out)
    if args.answers is None:
        prompts = [json.loads(line) for line in args.prompts.read_text().splitlines()]
        prompts = prompts[: args.limit] if args.limit else prompts
        todo = [p for p in prompts if p["id"] not in done]
        n_todo = len(todo)
    else:
        shards = load_answers(args.answers)
        n_todo = sum(int(pid not in done) for d in shards for pid in d["ids"].tolist())
    print(f"{len(done)} prompts done, {n_todo} to go", flush=True)
    kv = None if args.kv_cache_gib is None else int(args.kv_cache_gib * (1 << 30))
    llm = LLM(
        model=str(args.target), dtype=args.dtype, max_num_seqs=args.max_num_seqs, device=args.device, kv_cache_memory=kv
    )
    layers = eagle3_target_layers(llm.target.config.num_hidden_layers)
    batches = generated(llm, todo, args) if args.answers is None else given(shards, done, llm.target.config.vocab_size)
    shard_no = len(list(args.out.glob("shard_*.pt")))
    n_done = total_new = 0
    start = time.perf_counter()
    for ids, seqs, prompt_lens, temperature in batches:
        feats = answer_features(llm.target, seqs, layers)
        lens = torch.tensor([len(s) for s in seqs])
        shard = {
            "ids": torch.tensor(ids),
            "offsets": torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)]),
            "prompt_lens": torch.tensor(prompt_lens),
            "tokens": torch.tensor([t for s in seqs for t in s], dtype=torch.int32),
            "features": torch.cat([f for f, _ in feats]),
            "next": torch.cat([n for _, n in feats]),
            "temperature": temperature,
            "target_layers": torch.tensor(layers),
        }
        tmp = args.out / f"shard_{shard_no:05d}.pt.tmp"
        torch.save(shard, tmp)
        tmp.rename(args.out / f"shard_{shard_no:05d}.pt")
        shard_no += 1
        n_done += len(ids)
        total_new += sum(len(s) - p for s, p in zip(seqs, prompt_lens))
        elapsed = time.perf_counter() - start
        print(f"shard {shard_no}: {len(done) + n_done} prompts, {total_new} answer tokens this run, "
              f"{total_new / elapsed:.1f} answer tok/s ({'generation + ' * (args.answers is None)}features)",
              flush=True)  # fmt: skip
        if args.max_seconds is not None and elapsed > args.max_seconds and n_done < n_todo:
            print(f"--max-seconds {args.max_seconds:g} reached: {n_todo - n_done} prompts to go", flush=True)
            break


if __name__ == "__main__":
    main()
