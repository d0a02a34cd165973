"""Train an EAGLE head (EAGLE-1/2 layout: ``fc`` + one decoder layer; or EAGLE-3) for any target we load.

    python -m spec_engine.training.train_eagle --target spec_engine/zoo/models/target --out spec_engine/zoo/models/eagle
    python -m spec_engine.training.train_eagle --target DIR --out DIR --smoke       # a few steps, for tests
    python -m spec_engine.training.train_eagle --layout eagle3 --target /tmp/smol/hf --data runs/eagle3/data \
        --work-dir runs/eagle3/train --out spec_engine/zoo/models/smollm2-eagle3   # the shipped SmolLM2 head
    python -m spec_engine.training.train_eagle --layout eagle3 --target DIR --out DIR --smoke

The EAGLE-3 recipe (``--layout eagle3``, see its section below) trains on the target's own greedy
answers with their features dumped by ``spec_engine.training.eagle_data``; what follows describes the EAGLE-1/2 recipe,
whose TTT the EAGLE-3 one shares.

Features come from the target itself, computed on the fly (no feature dump): its final hidden states (RMS-normed, the
input of its lm_head, the same tensor the engine hands the head) over the corpus of ``spec_engine.training.train`` (the
standard library's ``*.py`` files, site-packages excluded, the held-out bucket excluded).

Loss, per entry p (token x_p with the feature f_{p-1}; see ``spec_engine.drafters.eagle``):
    soft cross-entropy of the head's next-token distribution against the target's own at p (so the head learns what
    the target would sample, for greedy and sampled decoding alike), plus ``reg`` x smooth-L1 of the head's output
    against f_p (EAGLE-1's feature regression: the output is read back as the next feature).

Training-time test (EAGLE-3, HASS): step k = 1 .. ``ttt-1`` re-runs the head with every feature replaced by its own
output of step k - 1, one position earlier, exactly as drafting reads its guesses back. The entry of step k at p
attends to the true entries up to p - k and to its own chain of guesses, one per earlier step (the keys of a drafted
branch); step k's loss weighs 0.8^k.

Seeded, resumable (a checkpoint every 100 steps under ``--work-dir``), with a tqdm bar. The head is written as fp16
safetensors with its config.json (``--out``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

import torch
from tqdm import tqdm

from spec_engine.drafters.eagle import EagleHead, eagle3_target_layers
from spec_engine.drafters.eagle_checkpoint import save_eagle_head
from spec_engine.models import ModelConfig, load_model
from spec_engine.training.eagle_data import ShardSet, collate, stream_samples, token_frequencies
from spec_engine.training.eagle_loss import agreement, eagle3_agreement, eagle3_ttt_loss, ttt_loss
from spec_engine.training.train import (
    Recipe,
    _run_stage,
    claim_work_dir,
    corpus_files,
    encode_splits,
    hf_config,
    lr_at,
    refuse_counts_below_one,
)


def head_config(target_cfg: ModelConfig, max_len: int, eos_id) -> dict:
    """The head's HF config: one decoder layer with the target's dimensions."""
    arch = dict(hidden_size=target_cfg.hidden_size, intermediate_size=target_cfg.intermediate_size,
                num_hidden_layers=1, num_attention_heads=target_cfg.num_attention_heads,
                num_key_value_heads=target_cfg.num_key_value_heads)  # fmt: skip
    exact = {
        "head_dim": target_cfg.head_dim,
        "rms_norm_eps": target_cfg.rms_norm_eps,
        "rope_theta": target_cfg.rope.get("rope_theta", 10000.0),
        "architectures": ["EagleLlamaForCausalLM"],
    }
    return hf_config(arch, target_cfg.vocab_size, eos_id, max_len) | exact


def init_head(head: EagleHead, seed: int) -> None:
    """Small random weights; ``fc`` starts as the identity on the feature half, so step 0 begins from f_{p-1}."""
    torch.manual_seed(seed)
    H = head.config.hidden_size
    for name, p in head.named_parameters():
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=0.02)
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.data /= math.sqrt(2)
    with torch.no_grad():
        head.fc.weight[:, H:] += torch.eye(H)


# --- EAGLE-3 ----------------------------------------------------------------------------------------------------
#
# The head reads fc(cat of the residual streams entering its target layers) and drafts over a reduced vocabulary of
# the K tokens the target emits most (FR-Spec's ranking over its own answers; EAGLE-3's d2t). Data: the shards of
# ``spec_engine.training.eagle_data`` (prompt + the target's greedy answer, the target layers' streams dumped at
# generation), or, without ``--data`` (the smoke path), the corpus stream with the streams computed on the fly.
# The loss is the cross-entropy of the head's draft-vocabulary logits against the target's greedy next token, on
# the answer tokens whose target token is in the draft vocabulary; lm_head and the final norm start as the target's
# own rows and stay frozen (the head learns to produce target-like final states, the target's map to tokens is
# kept).

TIMED_STEPS = 20  # a time-boxed run (--max-seconds) measures its step rate over its first steps


def eagle3_head_config(target_cfg: ModelConfig, eos_id, draft_vocab_size: int, target_layers) -> dict:
    """The EAGLE-3 head's config: one decoder layer of the target's width, its draft vocabulary and target layers."""
    cfg = head_config(target_cfg, target_cfg.max_position_embeddings, eos_id)
    cfg["architectures"] = ["Eagle3LlamaForCausalLM"]
    return cfg | {"draft_vocab_size": draft_vocab_size, "target_hidden_size": target_cfg.hidden_size,
                  "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(target_layers)}}  # fmt: skip


def draft_vocab(counts: torch.Tensor, k: int) -> torch.Tensor:
    """The K most frequent token ids of ``counts`` [V] (ties: the lower id), sorted ascending: [K] int64."""
    order = torch.argsort(-counts.double() + torch.arange(len(counts)) * 1e-9)
    return order[:k].sort().values


def init_eagle3(head: EagleHead, target, vocab_ids: torch.Tensor, seed: int) -> None:
    """Small random weights for fc and the layer; lm_head = the target's rows of the draft vocabulary, the final norm
    the target's, both frozen; d2t from ``vocab_ids`` [K]; ``fc`` starts as the identity on the highest layer's
    stream (the one closest to the target's output)."""
    torch.manual_seed(seed)
    H = head.config.hidden_size
    for name, p in head.named_parameters():
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=0.02)
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.data /= math.sqrt(2)
    with torch.no_grad():
        n = len(head.target_layers)
        head.fc.weight[:, (n - 1) * H :] += torch.eye(H)
        head.lm_head.weight.copy_(target.lm_head.weight.float()[vocab_ids])
        head.norm.weight.copy_(target.model.norm.weight.float())
        head.d2t.copy_(vocab_ids - torch.arange(len(vocab_ids)))
    head.lm_head.requires_grad_(False)
    head.norm.requires_grad_(False)


def build_eagle3(target, tcfg, eos, layers, vocab_ids: torch.Tensor, trained: dict | None, seed: int):
    """(head, config, t2d [V]) over the draft vocabulary ``vocab_ids``: freshly initialised, then the trained
    weights of a checkpoint's ``trained`` state (fc and the layer; lm_head and norm are the target's rows, so a head
    trained over one vocabulary exports over any other)."""
    K = len(vocab_ids)
    cfg = eagle3_head_config(tcfg, eos, K, layers)
    head = EagleHead(ModelConfig.from_dict(cfg), "eagle3", target, draft_vocab_size=K, target_layers=layers)
    init_eagle3(head, target, vocab_ids, seed)
    if trained is not None:
        keep = {k: v for k, v in trained.items() if not k.startswith(("lm_head", "norm", "d2t"))}
        unexpected = head.load_state_dict(keep, strict=False).unexpected_keys
        if unexpected:
            raise ValueError(f"the trained weights hold tensors this head does not have: {unexpected[:4]}")
    t2d = torch.full((tcfg.vocab_size,), -1, dtype=torch.int64)
    t2d[vocab_ids] = torch.arange(K)
    return head, cfg, t2d


def init_weights(head_dir: Path, layers) -> dict:
    """The trained weights (fc and the layer) of a published EAGLE-3 head, to start a run from (``--init``): a head
    trained on other data or another draft vocabulary (lm_head and norm are the target's rows, rebuilt anyway)."""
    from safetensors.torch import load_file

    config = json.loads((head_dir / "config.json").read_text())
    theirs = config.get("eagle_config", {}).get("eagle_aux_hidden_state_layer_ids")
    if theirs is not None and list(theirs) != list(layers):
        raise ValueError(f"--init {head_dir}: that head reads target layers {theirs}, this run {list(layers)}")
    return {k: v.float() for k, v in load_file(str(head_dir / "model.safetensors")).items()}


def init_vocab(weights: dict | None, k: int) -> torch.Tensor | None:
    """The draft vocabulary [K] int64 (ascending ids) of an ``--init`` head's weights when it has ``k`` tokens, else
    None (no such head, or another K: the run cuts its own from the data)."""
    d2t = None if weights is None else weights.get("d2t")
    if d2t is None or len(d2t) != k:
        return None
    return (d2t.long() + torch.arange(k)).sort().values


def export_eagle3(args, target, tcfg, eos) -> dict:
    """The checkpoint's head over draft vocabularies cut from every answer generated so far (at the run's own K, the
    vocabulary it was trained on): held-out agreement for each K of ``--eval-k``, and the head over ``--draft-vocab``
    written to ``--out`` (bf16)."""
    layers = eagle3_target_layers(tcfg.num_hidden_layers)
    data = ShardSet(args.data)
    data.reload()
    state = torch.load(args.work_dir / "eagle3.ckpt", weights_only=True, map_location="cpu")
    freqs = token_frequencies(data, args.target, tcfg.vocab_size)
    trained_on = torch.load(args.work_dir / "draft_vocab.pt")
    by_k = {}
    for k in sorted({int(x) for x in (args.eval_k or "").split(",") if x} | {args.draft_vocab}):
        vocab_ids = trained_on if len(trained_on) == k else draft_vocab(freqs, k)  # the run's own at its K
        head, cfg, t2d = build_eagle3(target, tcfg, eos, layers, vocab_ids, state["model"], args.seed)
        head.to(args.device)
        held = [s[0][s[2] :] for s in data.held]
        coverage = round(float((t2d[torch.cat(held)] >= 0).float().mean()), 4) if held else None
        by_k[k] = {"held_out_top1_agreement_per_depth": eagle3_agreement(head, data.held, t2d, args.ttt),
                   "held_out_coverage": coverage}  # fmt: skip
        print(json.dumps({"K": k} | by_k[k]), flush=True)
        if k == args.draft_vocab:
            save_eagle_head(head, cfg, args.out, dtype=torch.bfloat16)
    report = {"step": state["step"], "history": json.loads(state["history"]), "by_draft_vocab": by_k,
              "train_samples": len(data.train), "train_answer_tokens": data.tokens("train"),
              "held_samples": len(data.held), "held_answer_tokens": data.tokens("held"),
              "exported_draft_vocab": args.draft_vocab}  # fmt: skip
    (args.work_dir / "export.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def main_eagle3(args, target, tcfg, eos, deadline: float | None = None) -> dict:
    """The EAGLE-3 recipe: a reduced vocabulary, frozen target lm_head rows, TTT over ``--ttt`` steps; training stops
    (saved) at ``deadline`` (``time.perf_counter()``'s clock), if given."""
    work = args.work_dir
    work.mkdir(parents=True, exist_ok=True)
    layers = eagle3_target_layers(tcfg.num_hidden_layers)
    data = ShardSet(args.data) if args.data else None
    if data is not None:
        data.reload()
        print(f"data: {len(data.train)} train samples ({data.tokens('train')} answer tokens), {len(data.held)} held")
        if not data.train:  # (before the vocabulary is cut from them and kept)
            raise ValueError(f"--data {' '.join(map(str, args.data))}: no answers there "
                             "(spec_engine.training.eagle_data writes them)")  # fmt: skip
        if not data.held:
            print("no held-out answers (the split keeps greedy answers only): agreement is not measured")
        if data.width not in (None, len(layers) * tcfg.hidden_size):
            raise ValueError(
                f"--data holds streams of width {data.width}; this target's layers {layers} give "
                f"{len(layers) * tcfg.hidden_size} (data of another target?)"
            )
    else:  # the smoke path: corpus windows, the target's streams on the fly
        from spec_engine.llm import load_tokenizer

        tok = load_tokenizer(args.target)
        train_files, held_files = corpus_files()
        train_files, held_files = train_files[: args.max_files or 8], held_files[:2]
        streams = encode_splits(tok, {"train": train_files, "held": held_files}, work, eos)
        seq = args.seq_len or 32
        data = ShardSet(work / "none")
        data.train = stream_samples(target, streams["train"], seq, layers, 4 * args.batch_size, args.seed)
        data.held = stream_samples(target, streams["held"], seq, layers, 2, args.seed + 1)
    vocab_path = work / "draft_vocab.pt"
    ckpt = work / "eagle3.ckpt"
    start = None if args.init is None or ckpt.is_file() else init_weights(args.init, layers)
    k = min(args.draft_vocab or tcfg.vocab_size, tcfg.vocab_size)
    if vocab_path.is_file():  # a resumed run keeps the vocabulary its head was built on
        vocab_ids = torch.load(vocab_path)
    else:
        vocab_ids = init_vocab(start, k)  # a fine-tune keeps its head's vocabulary (its data may be one kind's)
        if vocab_ids is not None and not (0 <= int(vocab_ids[0]) and int(vocab_ids[-1]) < tcfg.vocab_size):
            raise ValueError(f"--init {args.init}: its draft vocabulary holds ids outside this target's "
                             f"{tcfg.vocab_size} (another target's head?)")  # fmt: skip
        if vocab_ids is None:
            vocab_ids = draft_vocab(token_frequencies(data, args.target, tcfg.vocab_size, args.smoke), k)
        torch.save(vocab_ids, vocab_path)
    K = len(vocab_ids)
    head, cfg, t2d = build_eagle3(target, tcfg, eos, layers, vocab_ids, start, args.seed)
    head.to(args.device)
    trainable = [p for p in head.parameters() if p.requires_grad]
    n_all, n_trained = sum(p.numel() for p in head.parameters()), sum(p.numel() for p in trainable)
    print(
        f"head: {n_all / 1e6:.2f}M parameters ({n_trained / 1e6:.2f}M trained), K={K}, layers {layers}, "
        f"{args.ttt} TTT steps"
    )
    opt = torch.optim.AdamW(trainable, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    step, history = 0, []
    if ckpt.is_file():
        state = torch.load(ckpt, weights_only=True, map_location="cpu")
        head.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step, history = state["step"], json.loads(state["history"])
        trained_tokens = state.get("trained_tokens", history[-1]["trained_tokens"] if history else 0)
    else:
        trained_tokens = 0
    head.train()
    bar = tqdm(range(step, args.steps), desc="train eagle3", initial=step, total=args.steps, dynamic_ncols=True)
    t0, seen = time.perf_counter(), 0
    last_step, first = args.steps, step
    for step in bar:
        if deadline is not None and step == first + TIMED_STEPS:
            # a time box: the run's length in steps, from the rate so far, so the learning rate's schedule ends
            # when the time does (a resumed run keeps the steps it was given)
            rate = (time.perf_counter() - t0) / TIMED_STEPS
            last_step = min(args.steps, step + max(1, int((deadline - time.perf_counter()) / rate)))
            bar.total = last_step
        for group in opt.param_groups:
            group["lr"] = lr_at(step, last_step, args.lr)
        g = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
        idx = torch.randint(0, len(data.train), (args.batch_size,), generator=g).tolist()
        tokens, streams, labels, mask = collate([data.train[i] for i in idx], t2d, args.device)
        loss = eagle3_ttt_loss(head, tokens, streams, labels, mask, args.ttt)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        opt.step()
        seen += int(mask.sum())
        trained_tokens += int(mask.sum())
        bar.set_postfix(loss=f"{loss.item():.3f}", tok_s=f"{seen / (time.perf_counter() - t0):.0f}", n=len(data.train))
        if deadline is not None and time.perf_counter() > deadline:
            last_step = step + 1  # past the time box (evaluations are not in the rate): stop here, saved
        last = step + 1 == last_step
        if (step + 1) % args.eval_every == 0 or last:
            agree = eagle3_agreement(head, data.held, t2d, args.ttt)
            history.append({"step": step + 1, "trained_tokens": trained_tokens, "train_samples": len(data.train),
                            "held_out_top1_agreement_per_depth": agree})  # fmt: skip
            bar.write(json.dumps(history[-1]))
        if (step + 1) % args.ckpt_every == 0 or last:
            tmp = ckpt.with_suffix(".tmp")
            torch.save({"model": head.state_dict(), "opt": opt.state_dict(), "step": step + 1,
                        "history": json.dumps(history), "trained_tokens": trained_tokens}, tmp)  # fmt: skip
            os.replace(tmp, ckpt)
            if args.data and data.reload():
                bar.write(f"data: {len(data.train)} train samples ({data.tokens('train')} answer tokens)")
        if last:
            break
    report = {"params": sum(p.numel() for p in head.parameters()), "draft_vocab_size": K, "target_layers": layers,
              "steps": last_step, "ttt": args.ttt, "history": history}  # fmt: skip
    save_eagle_head(head, cfg, args.out, dtype=torch.bfloat16)
    (work / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--target", type=Path, required=True, help="the target's HF directory")
    ap.add_argument("--out", type=Path, required=True, help="where the head is written")
    ap.add_argument("--work-dir", type=Path, default=Path("runs/eagle"), help="checkpoints and caches (resumable)")
    ap.add_argument("--steps", type=int, default=1200)
    ap.add_argument("--ttt", type=int, default=3, help="training-time-test steps (1 = plain EAGLE-1 training)")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=None, help="default: the target's context, at most 256")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--reg", type=float, default=0.5, help="weight of the feature regression")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1: shared machines)")
    ap.add_argument("--max-files", type=int, default=None, help="use only the first N corpus files")
    ap.add_argument("--smoke", action="store_true", help="a few steps on a few files: checks the recipe end to end")
    ap.add_argument("--layout", choices=("eagle", "eagle3"), default="eagle")
    ap.add_argument(
        "--data",
        type=Path,
        nargs="+",
        default=None,
        help="eagle3: the shards' directories of spec_engine.training.eagle_data (greedy, sampled)",
    )
    ap.add_argument("--draft-vocab", type=int, default=8192, help="eagle3: K, the draft vocabulary's size")
    ap.add_argument("--eval-every", type=int, default=200, help="eagle3: held-out agreement every N steps")
    ap.add_argument("--ckpt-every", type=int, default=50, help="eagle3: checkpoint (and new shards) every N steps")
    ap.add_argument("--export", action="store_true", help="eagle3: export the checkpoint (no training)")
    ap.add_argument(
        "--init",
        type=Path,
        default=None,
        help="eagle3: start from this published head's weights (a new run only; a checkpoint wins)",
    )
    ap.add_argument("--device", default="cpu", help="eagle3: where the target and the head run (cpu, cuda)")
    ap.add_argument(
        "--max-seconds", type=float, default=None, help="eagle3: stop training this long after the start (saved)"
    )
    ap.add_argument("--eval-k", default=None, help="eagle3 --export: also held-out agreement at these K (comma list)")
    args = ap.parse_args(argv)
    if args.max_seconds is not None and args.max_seconds < 0:
        ap.error(f"--max-seconds must be >= 0, got {args.max_seconds}")
    refuse_counts_below_one(ap, args, ("steps", "ttt", "batch_size", "eval_every", "ckpt_every", "draft_vocab",
                                       "seq_len", "max_files"))  # fmt: skip
    for flag in ("target", "init", *(() if args.smoke else ("data",))):
        paths = getattr(args, flag)
        missing = [str(p) for p in (paths if isinstance(paths, list) else [paths]) if p is not None and not p.exists()]
        if missing:
            ap.error(f"--{flag}: {', '.join(missing)} not found")
    if args.export and not (args.work_dir / "eagle3.ckpt").is_file():
        ap.error(f"--export: no checkpoint in --work-dir {args.work_dir} (train there first)")
    if args.export and not args.data:
        ap.error("--export needs --data (the answers its draft vocabulary and agreement are measured on)")
    deadline = None if args.max_seconds is None else time.perf_counter() + args.max_seconds  # loading included
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        ap.error(f"--device {args.device}: no CUDA device is available")
    if args.smoke:
        args.steps, args.max_files, args.batch_size = min(args.steps, 3), args.max_files or 8, 2
        args.eval_every = args.ckpt_every = args.steps
        args.data = None
    torch.set_num_threads(args.threads)
    from spec_engine.llm import load_tokenizer

    claim_work_dir(args.work_dir, layout=args.layout, target=args.target.resolve(), smoke=args.smoke,
                   max_files=args.max_files)  # fmt: skip
    target = load_model(args.target, device=args.device)
    target.requires_grad_(False)
    if args.layout == "eagle3":
        tcfg = target.config
        eos = tcfg.eos_token_id[0] if tcfg.eos_token_id else None
        if args.export:
            return export_eagle3(args, target, tcfg, eos)
        report = main_eagle3(args, target, tcfg, eos, deadline)
        print(json.dumps(report["history"][-1]))
        return report
    tok = load_tokenizer(args.target)
    if tok is None:
        raise ValueError(f"{args.target} has no tokenizer.json: the corpus cannot be encoded")
    tcfg = target.config
    seq_len = args.seq_len or min(tcfg.max_position_embeddings, 256)
    if args.smoke:
        seq_len = min(seq_len, 32)
    work = args.work_dir
    work.mkdir(parents=True, exist_ok=True)
    train_files, held_files = corpus_files()
    if args.max_files:
        train_files, held_files = train_files[: args.max_files], held_files[: max(1, args.max_files // 4)]
    eos = tcfg.eos_token_id[0] if tcfg.eos_token_id else None  # the target's own separator between files
    streams = encode_splits(tok, {"train": train_files, "held": held_files}, work, eos)
    print(f"corpus: {len(streams['train'])} train tokens, {len(streams['held'])} held-out tokens")

    cfg = head_config(tcfg, tcfg.max_position_embeddings, eos)
    head = EagleHead(ModelConfig.from_dict(cfg), "eagle", target, normed=True)
    init_head(head, args.seed)
    print(f"head: {sum(p.numel() for p in head.parameters()) / 1e6:.2f}M parameters, {args.ttt} TTT steps")
    recipe = Recipe(seq_len=seq_len, batch_size=args.batch_size, seed=args.seed, compile=False)

    def loss_fn(x, y):
        return ttt_loss(head, target, x, args.ttt, args.reg)

    _run_stage("eagle", head, loss_fn, streams["train"], recipe, args.steps, args.lr, work / "eagle.ckpt")
    agree = agreement(head, target, streams["held"], seq_len, args.ttt)
    report = {"params": sum(p.numel() for p in head.parameters()), "steps": args.steps, "ttt": args.ttt,
              "held_out_top1_agreement_per_depth": agree}  # fmt: skip
    print(json.dumps(report, indent=2))
    save_eagle_head(head, cfg, args.out)
    (work / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
