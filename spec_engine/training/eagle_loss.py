"""The training-time-test losses of an EAGLE head and its held-out agreement with the target, for both layouts:
EAGLE-1/2 (``ttt_loss``: soft cross-entropy against the target's distribution plus the feature regression) and
EAGLE-3 (``eagle3_ttt_loss``: cross-entropy against the target's greedy next token over the draft vocabulary). The
recipes that train with them, and what TTT is, are in ``spec_engine.training.train_eagle``."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from spec_engine.drafters.eagle import EagleHead
from spec_engine.training.eagle_data import collate

TTT_DECAY = 0.8  # weight of step k's loss: TTT_DECAY ** k


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


def eagle3_ttt_loss(head: EagleHead, tokens, streams, labels, mask, steps: int, stats: dict | None = None):
    """The EAGLE-3 training loss over ``steps`` training-time-test steps.

    Shapes: tokens [B, S] (x_p); streams [B, S, n H] (the target layers' streams at p); labels [B, S] the draft-vocab
    index of the target's next token after p (-1 outside the draft vocabulary); mask [B, S] bool, the positions the
    loss is on. ``stats[k]`` gets (hits, count) of step k's top-1 against the target's next token at mask positions
    (a label outside the vocabulary is a miss)."""
    B, S = tokens.shape
    attn = head.layer.self_attn
    cos, sin = head.rope(torch.arange(S, device=tokens.device).expand(B, S), torch.float32).unsqueeze(3)
    feats = shift_right(head.features(streams.float()))  # [B, S, H]: entry p reads f_{p-1}
    keys, values, loss = [], [], 0.0
    in_vocab = labels >= 0
    for k in range(steps):
        x, attn_in = head.inputs(tokens, feats)
        q, key, value = attn._qkv(attn_in, cos, sin)  # [B, S, H*, D]
        keys.append(key)
        values.append(value)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), torch.cat(keys, 1).transpose(1, 2),
                                             torch.cat(values, 1).transpose(1, 2), attn_mask=ttt_mask(S, k, q.device),
                                             enable_gqa=True)  # fmt: skip
        h = head.finish(x, attn.o_proj(out.transpose(1, 2).reshape(B, S, -1)))  # [B, S, H]
        m = mask.clone()
        m[:, :k] = False  # step k's entry at p needs the true entries up to p - k
        train = m & in_vocab
        logits = head.lm_head(head.norm(h[train]))  # [N, K]
        if train.any():
            loss = loss + TTT_DECAY**k * F.cross_entropy(logits.float(), labels[train])
        if stats is not None:
            hits = (logits.argmax(-1) == labels[train]).sum().item()
            prev = stats.get(k, (0, 0))
            stats[k] = (prev[0] + hits, prev[1] + int(m.sum()))
        feats = shift_right(h)
    return loss


@torch.no_grad()
def eagle3_agreement(head: EagleHead, samples: list[tuple], t2d: torch.Tensor, steps: int, batch: int = 8) -> list:
    """Top-1 agreement with the target's greedy next token on answer positions, per TTT step (step k ~ depth k + 1);
    [] without samples (data of sampled answers only: the held-out split keeps greedy ones)."""
    if not samples:
        return []
    head.eval()
    stats: dict = {}
    device = head.fc.weight.device
    for i in range(0, len(samples), batch):
        eagle3_ttt_loss(head, *collate(samples[i : i + batch], t2d, device), steps, stats)
    head.train()
    return [round(stats[k][0] / max(1, stats[k][1]), 4) for k in range(steps)]
