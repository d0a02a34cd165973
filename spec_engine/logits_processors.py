"""Logits processors: ``allowed_token_ids``, ``min_tokens``, a logit bias and penalties on a step's logits, each tree
node's under its own context (the tree read to the host once a step, besides the step's own read).

A node's logits predict the token after its path, so what they depend on counts the request's tokens (the prompt and
the output, the root among them) plus the drafted tokens on its path below the root. Verification then judges every
node by the distribution one-token-a-step decoding would sample from: with these too, speculation is lossless (greedy
rows emit the processed argmax, sampled rows the processed distribution).

vLLM's semantics, in its sampler's order (a guided choice's mask first, as vLLM applies structured output's), on the
raw logits before temperature and the top-k / top-p / min-p transform:
- ``guided_choice`` (as ``guided_choice_token_ids``): only the tokens that continue one of the choices from the
  output so far, and the request's stop tokens where the output is one whole;
- ``guided_json`` / ``guided_regex`` / ``guided_grammar`` (``spec_engine.structured``): only the tokens that keep the
  output a prefix of the grammar's language, and the stop tokens where it is one whole sentence;
- ``allowed_token_ids``: every other token at -inf;
- ``bad_words`` (as ``bad_words_token_ids``): a sequence's last token at -inf where the output so far (the prompt not
  counted, as vLLM's) ends with the rest of it; a one-token sequence everywhere;
- ``min_tokens``: the request's stop tokens (its EOS ids unless it ignores EOS, and its ``stop_token_ids``) at -inf
  while fewer output tokens than that precede;
- ``logit_bias``: {token: bias} added (OpenAI's);
- ``repetition_penalty`` r (1: off): each token in the prompt or the output, logit > 0 -> logit / r, else logit * r;
- ``frequency_penalty`` f and ``presence_penalty`` p (0: off): logit -= f * count + p * (count > 0), counting the
  output's tokens only.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import torch

from spec_engine.request import Request
from spec_engine.transfer import to_device


def node_paths(parents: list[int]) -> list[list[int]]:
    """Per node of one row's tree (``parents``: each node's parent, -1 for the root and for padding): the nodes on
    its path below the root, itself last (the root's and padding's: empty)."""
    paths: list[list[int] | None] = [None] * len(parents)

    def path(t: int) -> list[int]:
        if paths[t] is None:
            p = parents[t]
            paths[t] = [] if p < 0 else path(p) + [t]
        return paths[t]

    return [path(t) for t in range(len(parents))]


def process_logits_(logits: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor,
                    reqs: list[Request]) -> torch.Tensor:  # fmt: skip
    """In place on float32 ``logits`` [B, T, V] of a step's tree (``tokens``, ``parents`` [B, T]: the draft's nodes;
    node 0 the root): each row's processors (``reqs[b].params``; ``reqs[b].stop_ids`` the tokens ``min_tokens`` holds
    back) under each node's context (the module docstring). Each processor but ``allowed_token_ids`` (a mask of the row)
    touches only the columns it concerns (the tokens held back, biased, seen, counted), in a few index copies a row,
    never a loop of per-node device ops."""
    B, T, V = logits.shape
    dev = logits.device
    both = torch.cat((tokens, parents), dim=1).tolist()  # [B, 2T]: the tree, read once
    for b, req in enumerate(reqs):
        p = req.params
        if not p.processes_logits:
            continue
        z = logits[b]  # [T, V], a view
        history = req.history[: req.num_tokens]  # the prompt, then the output (the root last)
        output = history[len(req.prompt_token_ids) :]
        paths = [[both[b][n] for n in path] for path in node_paths([-1] + both[b][T + 1 :])]
        stops = sorted(t for t in req.stop_ids if 0 <= t < V)  # (an id past the vocabulary is never emitted)
        if p.guided_choice_token_ids:
            _guide_choice(z, output, paths, p.guided_choice_token_ids, stops)
        if req.grammar is not None:
            nodes, allowed = req.grammar.masks(output, paths, stops, V)  # [N], [N, V]
            if nodes:
                on = _ids(dev, nodes)
                z[on] = z[on].masked_fill(~to_device(dev, torch.from_numpy(allowed))[0], float("-inf"))
        if p.allowed_token_ids:
            allowed = np.zeros(V, dtype=bool)
            allowed[p.allowed_token_ids] = True
            z.masked_fill_(~to_device(dev, torch.from_numpy(allowed))[0], float("-inf"))
        if p.bad_words_token_ids:
            _ban_bad_words(z, output, paths, p.bad_words_token_ids)
        if p.min_tokens > len(output):
            held = [t for t in range(T) if len(output) + len(paths[t]) < p.min_tokens]  # nodes before the minimum
            if held and stops:
                rows_, cols = _ids(dev, held, stops)
                z[rows_[:, None], cols[None, :]] = float("-inf")
        if p.logit_bias:
            ids = sorted(p.logit_bias)
            z[:, _ids(dev, ids)] += _values(dev, [p.logit_bias[i] for i in ids])
        if p.repetition_penalty != 1.0:
            seen = np.unique(history)  # [S]
            cols = _ids(dev, seen)
            z[:, cols] = _repeated(z[:, cols], p.repetition_penalty)
            known = set(seen.tolist())  # a drafted token not seen before: penalised below its node
            fresh = sorted({(t, x) for t, path in enumerate(paths) for x in path if x not in known})
            if fresh:
                at = _ids(dev, *zip(*fresh))
                z[at] = _repeated(z[at], p.repetition_penalty)
        if p.frequency_penalty or p.presence_penalty:
            f, pres = p.frequency_penalty, p.presence_penalty
            counts = np.bincount(output, minlength=V)  # [V]
            counted = np.flatnonzero(counts)
            if len(counted):
                z[:, _ids(dev, counted)] -= _values(dev, f * counts[counted] + pres)
            extra = [(t, x, f * c + pres * (counts[x] == 0)) for t, path in enumerate(paths)
                     for x, c in Counter(path).items()]  # fmt: skip
            if extra:
                t_idx, x_idx, amounts = zip(*extra)
                z.index_put_(_ids(dev, t_idx, x_idx), -_values(dev, amounts), accumulate=True)
    return logits


def _guide_choice(z: torch.Tensor, output, paths: list[list[int]], choices: list[list[int]],
                  stops: list[int]) -> None:  # fmt: skip
    """``z`` [T, V] (one row's nodes): at each node whose context (``output``, then its path) begins some choice,
    every token at -inf but the choices' next tokens and, where the context is one whole, the ``stops`` (the row's
    stop tokens in the vocabulary). A node off every choice is left as it is: its own token was masked at its
    parent, so verification never reaches it."""
    output = list(output)
    rows, cols = [], []
    for t, path in enumerate(paths):
        context = output + path
        n = len(context)
        keep = {c[n] for c in choices if len(c) > n and c[:n] == context}
        if any(c == context for c in choices):
            keep.update(stops)
        rows += [t] * len(keep)
        cols += sorted(keep)
    if rows:
        on = sorted(set(rows))
        at = _ids(z.device, rows, cols)
        kept = z[at]
        z[_ids(z.device, on)] = float("-inf")
        z[at] = kept


def _ban_bad_words(z: torch.Tensor, output: list[int], paths: list[list[int]], seqs: list[list[int]]) -> None:
    """``z`` [T, V] (one row's nodes; ``paths[t]``: node t's drafted tokens below the root): each sequence's last
    token at -inf at the nodes whose context (``output``, then the path) ends with the rest of it, in one index
    copy."""
    T, V = z.shape
    longest = max(map(len, seqs))
    recent = list(output[max(0, len(output) - longest + 1) :]) if longest > 1 else []  # all a match can reach back to
    banned = set()
    for t, path in enumerate(paths):
        context = recent + path
        for seq in seqs:
            n = len(seq)
            if seq[-1] < V and (n == 1 or len(context) >= n - 1 and context[len(context) - n + 1 :] == seq[:-1]):
                banned.add((t, seq[-1]))
    if banned:
        z[_ids(z.device, *zip(*sorted(banned)))] = float("-inf")


def _ids(device: torch.device, *lists) -> tuple[torch.Tensor, ...] | torch.Tensor:
    """Host index lists as int64 tensors on ``device``, in one copy (one tensor for one list)."""
    out = to_device(device, *(torch.as_tensor(np.asarray(x, dtype=np.int64)) for x in lists))
    return out[0] if len(lists) == 1 else tuple(out)


def _values(device: torch.device, values) -> torch.Tensor:
    """Host numbers as a float32 tensor on ``device``."""
    return to_device(device, torch.as_tensor(np.asarray(values, dtype=np.float32)))[0]


def _repeated(z: torch.Tensor, r: float) -> torch.Tensor:
    """The repetition penalty r on logits z: z > 0 -> z / r, else z * r."""
    return torch.where(z > 0, z / r, z * r)
