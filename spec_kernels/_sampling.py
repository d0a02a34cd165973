"""Argument checks and the HF-order sampling transform shared by verify_tree's backends.

Glossary:
    transform   logits -> target distribution: logits / temperature, then top-k, top-p, min-p (HF's order),
                renormalising after each. Every filter keeps the tokens whose scaled logit is >= a per-row
                threshold, so the whole transform is one threshold plus one softmax.
    top-k       keep the k largest logits; ties at the k-th value are all kept.
    top-p       keep token i iff the mass of the tokens strictly more probable than i is < top_p. That is HF's
                TopPLogitsWarper ("smallest set whose mass >= top_p") except that a tie at the boundary keeps the
                whole tie group instead of an arbitrary sort-order subset of it, as top-k does.
    min-p       keep p >= min_p * max p, i.e. z >= z_max + log(min_p) on the scaled logits z.
    sanitise    NaN -> -inf and +inf -> float32 max; a row that is all -inf becomes all zeros (uniform; its
                greedy token is id 0). So non-finite logits can never yield an id outside [0, V).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from spec_kernels._backend import host_value_checks

DRAFT_SAMPLINGS = ("iid", "without_replacement")
# A residual (or without-replacement draft) whose mass falls to <= RESIDUAL_EPS is rounding noise: the rejection
# that produced it had probability ~0. We then fall back to the node's own distribution; the total-variation
# error this admits is <= RESIDUAL_EPS per step.
RESIDUAL_EPS = 1e-6
# Above this many candidates the top-p threshold search gives up on torch.topk and sorts the row.
TOPP_CANDIDATES = 1024


class RowParams(NamedTuple):
    temperature: torch.Tensor  # [B] float32, 0 = greedy
    top_k: torch.Tensor  # [B] int64, 0 = off
    top_p: torch.Tensor  # [B] float32, 1 = off
    min_p: torch.Tensor  # [B] float32, 0 = off

    @property
    def greedy(self) -> torch.Tensor:  # [B] bool
        return self.temperature == 0

    def has_filters(self) -> bool:
        return bool(((self.top_k > 0) | (self.top_p < 1) | (self.min_p > 0)).any())

    def rows(self, idx: torch.Tensor) -> RowParams:
        return RowParams(*(x[idx] for x in self))


def _row_param(x, name: str, B: int, default: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A scalar or [B] parameter as a [B] tensor on ``device``. Python numbers become a fill on the device (no
    host-to-device copy); tensors must already be on ``device`` (a 0-d CPU tensor is a Python number here)."""
    if x is None:
        return torch.full((B,), default, dtype=dtype, device=device)
    if isinstance(x, (list, tuple)):
        x = torch.tensor(x, device=device)
    if isinstance(x, torch.Tensor) and x.dim() == 0 and x.device.type == "cpu" and device.type != "cpu":
        x = x.item()  # a host value already: no device read
    if not isinstance(x, torch.Tensor):
        if dtype == torch.int64 and float(x) != round(float(x)):
            raise ValueError(f"verify_tree: {name} must hold integers")
        return torch.full((B,), x, dtype=dtype, device=device)
    if x.device != device:
        raise ValueError(
            f"verify_tree: {name} is on {x.device} but target_logits is on {device}; put all inputs on one device"
        )
    if x.dim() > 1 or (x.dim() == 1 and x.shape[0] != B):
        raise ValueError(f"verify_tree: {name} must be a scalar or have shape [B]=[{B}], got {tuple(x.shape)}")
    if dtype == torch.int64 and x.is_floating_point() and host_value_checks(device):
        if not bool((x == x.round()).all()):
            raise ValueError(f"verify_tree: {name} must hold integers")
    return x.to(dtype).expand(B).contiguous()


def filters_given(top_k, top_p, min_p) -> bool:
    """Whether any row may filter, decided without reading device data: a filter is off when it is None or a Python
    number at its off value (top_k 0, top_p 1, min_p 0); a tensor counts as on (its rows branch at run time)."""
    off = {0: top_k, 1: top_p, 2: min_p}
    for i, x in off.items():
        if x is None:
            continue
        if isinstance(x, (torch.Tensor, list, tuple)):
            return True
        if float(x) != (1.0 if i == 1 else 0.0):
            return True
    return False


def check_verify_tree_args(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    parents: torch.Tensor,
    draft_probs: torch.Tensor | None,
    draft_sampling: str,
    temperature,
    top_k,
    top_p,
    min_p,
) -> tuple[torch.Tensor, RowParams]:
    """Validate verify_tree's inputs; return parents as int64 and the per-row sampling parameters.

    Raises ValueError with the offending argument named. Shapes, dtypes and devices are checked everywhere (free).
    Value checks read data, so on CPU tensors they all run, and on the device path (CUDA, meta; no host sync):
    - parents topological and drafted tokens in [0, V): queued with ``torch._assert_async`` (a bad token would make
      the kernel read outside the logits row, so this is always checked);
    - sampling-parameter ranges (temperature, top_k, top_p, min_p): only with ``SPECDEC_DEBUG_CHECKS=1``; their
      source (the engine's ``SamplingParams``) validates them on the host when a request arrives.
    """
    if not isinstance(target_logits, torch.Tensor) or target_logits.dim() != 3:
        raise ValueError("verify_tree: target_logits must be a [B, T, V] tensor")
    if not target_logits.is_floating_point():
        raise ValueError(f"verify_tree: target_logits must be floating point, got {target_logits.dtype}")
    B, T, V = target_logits.shape
    if B == 0 or T == 0 or V == 0:
        raise ValueError(f"verify_tree: target_logits has an empty dimension: {tuple(target_logits.shape)}")
    if draft_tokens.shape != (B, T) or draft_tokens.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"verify_tree: draft_tokens must be int [B, T]=[{B}, {T}], got {draft_tokens.dtype} "
            f"{tuple(draft_tokens.shape)}"
        )
    if parents.shape != (B, T) or parents.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"verify_tree: parents must be int32/int64 [B, T]=[{B}, {T}], got {parents.dtype} {tuple(parents.shape)}"
        )
    if draft_sampling not in DRAFT_SAMPLINGS:
        raise ValueError(f"verify_tree: unknown draft_sampling {draft_sampling!r}; expected one of {DRAFT_SAMPLINGS}")
    if draft_probs is not None:
        if draft_probs.dim() != 3 or draft_probs.shape[:2] != (B, T) or not draft_probs.is_floating_point():
            raise ValueError(
                f"verify_tree: draft_probs must be floating [B, T, V]=[{B}, {T}, {V}], got {tuple(draft_probs.shape)}"
            )
        if draft_probs.shape[2] != V:
            raise ValueError(
                f"verify_tree: vocabulary mismatch: target_logits V={V}, draft_probs V={draft_probs.shape[2]}"
            )
    dev = target_logits.device
    for name, t in (("draft_tokens", draft_tokens), ("parents", parents), ("draft_probs", draft_probs)):
        if t is not None and t.device != dev:
            raise ValueError(
                f"verify_tree: {name} is on {t.device} but target_logits is on {dev}; put all inputs on one device"
            )
    parents = parents.to(torch.int64)
    node = torch.arange(T, device=dev)
    bad_parents = ((parents >= node) | (parents < -1)).any()
    real = parents >= 0  # drafted nodes; their tokens index the vocabulary
    bad_tokens = (real & ((draft_tokens < 0) | (draft_tokens >= V))).any()
    host = host_value_checks(dev)
    if not host:
        torch._assert_async(
            ~(bad_parents | bad_tokens),
            f"verify_tree: parents must be topological (-1 or parents[:, i] < i) and the draft_tokens of drafted "
            f"nodes in [0, V={V})",
        )
    elif bool(bad_parents):
        raise ValueError("verify_tree: parents must be topological: -1 (root/padding) or parents[:, i] < i")
    elif bool(bad_tokens):
        raise ValueError(f"verify_tree: draft_tokens of drafted nodes must be in [0, V={V})")

    params = RowParams(
        _row_param(temperature, "temperature", B, 1.0, torch.float32, dev),
        _row_param(top_k, "top_k", B, 0, torch.int64, dev),
        _row_param(top_p, "top_p", B, 1.0, torch.float32, dev),
        _row_param(min_p, "min_p", B, 0.0, torch.float32, dev),
    )
    if not host:
        return parents, params
    t, k, p, m = params
    if not bool((torch.isfinite(t) & (t >= 0)).all()):
        raise ValueError("verify_tree: temperature must be finite and >= 0 (0 = greedy)")
    if bool((k < 0).any()):
        raise ValueError("verify_tree: top_k must be >= 0 (0 = off)")
    if not bool(((p > 0) & (p <= 1)).all()):
        raise ValueError("verify_tree: top_p must be in (0, 1] (1 = off)")
    if not bool(((m >= 0) & (m <= 1)).all()):
        raise ValueError("verify_tree: min_p must be in [0, 1] (0 = off)")
    return parents, params


def sanitise_(z: torch.Tensor) -> torch.Tensor:
    """In place on float32 rows [N, V]: NaN -> -inf, +inf -> float32 max, all -inf rows -> zeros. Cheap when clean:
    one max pass finds the rows that need it."""
    bad = ~torch.isfinite(z.amax(-1))  # NaN, +inf and all -inf rows all make the max non-finite
    if bool(bad.any()):
        zb = torch.nan_to_num(z[bad], nan=-math.inf, posinf=torch.finfo(torch.float32).max)
        empty = zb.amax(-1) == -math.inf
        zb[empty] = 0.0
        z[bad] = zb
    return z


def scaled_logits(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """logits [N, V] -> sanitised float32 logits / temperature (greedy rows: temperature 1). Always a fresh tensor."""
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    z = logits.float() / t[:, None]  # [N, V]
    return sanitise_(z)


def keep_threshold(z: torch.Tensor, params: RowParams) -> torch.Tensor:
    """Per-row threshold thr [N] such that the transform keeps exactly z >= thr (-inf: keep all); z [N, V] float32.

    On the CPU one C++ call (``keep_threshold``, csrc/keep_threshold_cpu.h): the function the native steps' coupled
    rows call, so a seeded request's tokens do not depend on which path sampled them; elsewhere
    :func:`keep_threshold_ref`.
    """
    if z.device.type == "cpu":
        from spec_kernels._ext import load_ext

        load_ext()
        _, top_k, top_p, min_p = params
        return torch.ops.spec_kernels.keep_threshold(z, top_k, top_p, min_p)
    return keep_threshold_ref(z, params)


def keep_threshold_ref(z: torch.Tensor, params: RowParams) -> torch.Tensor:
    """:func:`keep_threshold` in torch ops, any device.

    Cost: rows with top-k/top-p pay one torch.topk of TOPP_CANDIDATES (about one pass over V); a top-p row whose
    candidates hold less than top_p of the mass falls back to a full sort. Rows without filters pay nothing.
    """
    N, V = z.shape
    thr = torch.full((N,), -math.inf, device=z.device)
    _, top_k, top_p, min_p = params
    need = (top_k > 0) | (top_p < 1)
    if bool(need.any()):
        rows = need.nonzero().squeeze(1)
        zr, kr, pr = z[rows], top_k[rows], top_p[rows]
        num_cand = min(V, max(TOPP_CANDIDATES, int(kr.max())))
        thr[rows] = _topk_topp_threshold(zr, kr, pr, num_cand)
    if bool((min_p > 0).any()):
        # HF compares probabilities: p >= min_p * p_max  <=>  z >= z_max + log(min_p)
        thr_m = z.amax(-1) + torch.log(min_p)  # log(0) = -inf: off
        thr = torch.maximum(thr, thr_m)
    return thr


def _topk_topp_threshold(z: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, num_cand: int) -> torch.Tensor:
    N, V = z.shape
    s = torch.topk(z, num_cand, dim=-1, sorted=True).values  # [N, C] descending
    k = torch.where((top_k > 0) & (top_k <= num_cand), top_k, torch.zeros_like(top_k))
    thr_k = torch.where(k > 0, s.gather(1, (k - 1).clamp(min=0)[:, None]).squeeze(1), torch.tensor(-math.inf))
    # top-p runs on the top-k-renormalised distribution; its normaliser covers the whole kept row (ties included)
    zk = torch.where(z >= thr_k[:, None], z, torch.tensor(-math.inf))
    lse_k = torch.logsumexp(zk, -1)  # [N]
    ps = torch.exp(s - lse_k[:, None]) * (s >= thr_k[:, None])  # [N, C]
    cum = torch.cumsum(ps, -1)
    excl = cum - ps  # mass strictly before each candidate in sorted order
    num_keep = (excl < top_p[:, None]).sum(-1)  # >= 1; a prefix since excl is nondecreasing
    thr_p = s.gather(1, (num_keep - 1)[:, None]).squeeze(1)
    # the search is complete when the candidates hold >= top_p, or are the whole row
    complete = (cum[:, -1] >= top_p) | (num_cand == V)
    thr_p = torch.where(top_p < 1, thr_p, torch.tensor(-math.inf))
    thr = torch.maximum(thr_k, thr_p)
    if not bool(complete[top_p < 1].all()):
        redo = ((top_p < 1) & ~complete).nonzero().squeeze(1)
        thr[redo] = _topk_topp_threshold(z[redo], top_k[redo], top_p[redo], V)
    return thr


def transform_probs(logits: torch.Tensor, params: RowParams) -> torch.Tensor:
    """logits [N, V] -> the transformed target distribution [N, V] float32 (greedy rows: one-hot argmax)."""
    z = scaled_logits(logits, params.temperature)
    if params.has_filters():
        thr = keep_threshold(z, params)
        z = torch.where(z >= thr[:, None], z, torch.tensor(-math.inf))
    p = torch.softmax(z, -1)
    greedy = params.greedy
    if bool(greedy.any()):
        onehot = torch.zeros_like(p).scatter_(1, z.argmax(-1, keepdim=True), 1.0)
        p = torch.where(greedy[:, None], onehot, p)
    return p


def sample_from_weights(w: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sample: w [N, V] >= 0 unnormalised with positive row mass, u [N] uniform in [0, 1) -> ids [N].

    One uniform per row instead of V exponentials (an exponential race costs more in random numbers than in
    logits on CPU). Never returns a zero-weight id: rounding past the end clamps to the last positive weight; nor
    an id past the vocabulary where the weights hold a NaN (a garbage draw, but an id).
    """
    cdf = torch.cumsum(w, -1)  # [N, V]
    total = cdf[:, -1:].contiguous()
    idx = torch.searchsorted(cdf, u[:, None].to(cdf.dtype) * total, right=True)
    last = torch.searchsorted(cdf, total, right=False)  # first index reaching the total: the last positive weight
    return torch.minimum(idx, last).squeeze(1).clamp_(max=w.shape[-1] - 1)


def check_seed(seed, B: int):
    """``seed`` is None, an int, or a [B] integer tensor of per-row seeds (a row's stream then depends only on its
    own seed, so a request samples the same alone or inside any batch)."""
    if seed is None or (isinstance(seed, int) and not isinstance(seed, bool)):
        return seed
    if isinstance(seed, torch.Tensor):
        if seed.shape != (B,) or seed.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"seed tensor must be [B] = [{B}] int32/int64, got {tuple(seed.shape)} {seed.dtype}")
        return seed
    raise ValueError(f"seed must be None, an int or a [B] int tensor, got {type(seed).__name__}")


class Coupling(NamedTuple):
    """The position-keyed Gumbel coupling's per-row inputs (spec_kernels/rng.py, spec_engine/coupling.py)."""

    noise_seeds: torch.Tensor  # [B] int64: request seeds s
    positions: torch.Tensor  # [B, T] int64: absolute position t of each node
    coupled: torch.Tensor  # [B] bool: rows verified greedily on filtered logits + g_t (sampled rows only)


def check_coupling_args(
    target_logits: torch.Tensor, noise_seeds, positions, coupled, temperature: torch.Tensor
) -> Coupling | None:
    """Validate verify_tree's coupling arguments (shapes, dtypes, devices: no data read). None when there is no
    coupling. ``coupled`` None means every row; a greedy row (temperature 0) is never perturbed."""
    if noise_seeds is None and positions is None and coupled is None:
        return None
    if noise_seeds is None or positions is None:
        raise ValueError("verify_tree: noise_seeds and positions go together (the coupling needs both)")
    B, T, _ = target_logits.shape
    dev = target_logits.device
    if noise_seeds.shape != (B,) or noise_seeds.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"verify_tree: noise_seeds must be int [B]=[{B}], got {noise_seeds.dtype} "
                         f"{tuple(noise_seeds.shape)}")  # fmt: skip
    if positions.shape != (B, T) or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"verify_tree: positions must be int [B, T]=[{B}, {T}], got {positions.dtype} "
                         f"{tuple(positions.shape)}")  # fmt: skip
    if coupled is not None and (coupled.shape != (B,) or coupled.dtype != torch.bool):
        raise ValueError(f"verify_tree: coupled must be bool [B]=[{B}], got {coupled.dtype} {tuple(coupled.shape)}")
    for name, t in (("noise_seeds", noise_seeds), ("positions", positions), ("coupled", coupled)):
        if t is not None and t.device != dev:
            raise ValueError(
                f"verify_tree: {name} is on {t.device} but target_logits is on {dev}; put all inputs on one device"
            )
    sampled = temperature > 0
    coupled = sampled if coupled is None else coupled & sampled
    return Coupling(noise_seeds.to(torch.int64), positions.to(torch.int64), coupled)
