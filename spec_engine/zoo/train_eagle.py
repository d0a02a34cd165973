"""Train an EAGLE head (EAGLE-1/2 layout: ``fc`` + one decoder layer) for any target we load.

    python -m spec_engine.zoo.train_eagle --target spec_engine/zoo/models/target --out spec_engine/zoo/models/eagle
    python -m spec_engine.zoo.train_eagle --target DIR --out DIR --smoke       # a few steps, for tests

Features come from the target itself, computed on the fly (no feature dump): its final hidden states (RMS-normed, the
input of its lm_head, the same tensor the engine hands the head) over the corpus of ``spec_engine.zoo.train`` (the
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
from pathlib import Path

import torch
import torch.nn.functional as F

from spec_engine.drafters.eagle import EagleHead, save_eagle_head
from spec_engine.models import ModelConfig, load_model
from spec_engine.zoo.train import Recipe, _run_stage, corpus_files, encode_splits, hf_config

TTT_DECAY = 0.8  # weight of step k's loss: TTT_DECAY ** k


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


def shift_right(x: torch.Tensor) -> torch.Tensor:
    """[B, S, H] -> the row one position earlier at each p (zeros at p = 0)."""
    return F.pad(x, (0, 0, 1, 0))[:, :-1]


def ttt_mask(S: int, k: int, device) -> torch.Tensor:
    """[S, S * (k + 1)] bool: the keys of step k's entry at p: step 0's keys up to p - k (true features), then one key
    of each step i = 1..k, at p - k + i (its chain of guesses, itself last)."""
    p = torch.arange(S, device=device)
    blocks = [p[None, :] <= p[:, None] - k]
    blocks += [p[None, :] == p[:, None] - k + i for i in range(1, k + 1)]
    return torch.cat(blocks, dim=1)


def ttt_loss(head: EagleHead, target, tokens: torch.Tensor, steps: int, reg: float, stats: dict | None = None):
    """The training loss over ``steps`` training-time-test steps for a batch of token windows [B, S]."""
    B, S = tokens.shape
    captured = {}
    hook = target.model.norm.register_forward_hook(lambda m, i, out: captured.__setitem__("f", out))
    with torch.no_grad():
        p_target = torch.softmax(target.forward_train(tokens).float(), -1)  # [B, S, V]
    hook.remove()
    f = captured["f"].detach()  # [B, S, H]: the features the engine hands the head
    attn = head.layer.self_attn
    cos, sin = head.rope(torch.arange(S, device=tokens.device).expand(B, S), f.dtype).unsqueeze(3)  # [B, S, 1, D]
    keys, values, feats, loss = [], [], shift_right(f), 0.0
    for k in range(steps):
        x, attn_in = head.inputs(tokens, feats)
        q, key, value = attn._qkv(attn_in, cos, sin)  # [B, S, H*, D]
        keys.append(key)
        values.append(value)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), torch.cat(keys, 1).transpose(1, 2),
                                             torch.cat(values, 1).transpose(1, 2), attn_mask=ttt_mask(S, k, q.device),
                                             enable_gqa=True)  # fmt: skip
        h = head.finish(x, attn.o_proj(out.transpose(1, 2).reshape(B, S, -1)))  # [B, S, H]
        logits = head.logits(h)
        ce = -(p_target * torch.log_softmax(logits, -1)).sum(-1)[:, k:].mean()
        loss = loss + TTT_DECAY**k * (ce + reg * F.smooth_l1_loss(h.float()[:, k:], f.float()[:, k:]))
        if stats is not None:
            stats[k] = (logits.argmax(-1) == p_target.argmax(-1))[:, k:].float().mean().item()
        feats = shift_right(h)
    return loss


@torch.no_grad()
def agreement(head: EagleHead, target, stream: torch.Tensor, seq_len: int, steps: int, windows: int = 16) -> list:
    """Top-1 agreement with the target per training-time-test step on held-out windows (step k ~ depth k + 1)."""
    head.eval()
    totals = [0.0] * steps
    n = min(windows, (len(stream) - 1) // seq_len)
    for i in range(n):
        stats = {}
        ttt_loss(head, target, stream[i * seq_len : (i + 1) * seq_len].long()[None], steps, 0.0, stats)
        totals = [t + stats[k] / n for k, t in enumerate(totals)]
    return [round(t, 4) for t in totals]


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
    args = ap.parse_args(argv)
    if args.smoke:
        args.steps, args.max_files, args.batch_size = min(args.steps, 3), args.max_files or 8, 2
    torch.set_num_threads(args.threads)
    from spec_engine.llm import load_tokenizer

    target = load_model(args.target)
    target.requires_grad_(False)
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
