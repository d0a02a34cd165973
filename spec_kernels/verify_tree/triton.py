"""verify_tree's Triton path: one program per sequence walks its whole tree, tiled over V, registered as the custom
op ``spec_kernels::verify_tree_triton``; Philox keys per row (``_philox_keys``)."""

from __future__ import annotations

import torch

from spec_kernels._backend import triton_available
from spec_kernels._sampling import RESIDUAL_EPS
from spec_kernels.rng import GOLDEN
from spec_kernels.types import PAD_NODE

PHILOX_KEY_MOD = 2**31 - 1  # a prime: keys s + b*c (c != 0 mod it) are distinct for every row b of a batch


def _philox_keys(seed: int | torch.Tensor, B: int, device: torch.device) -> torch.Tensor:
    """[B] int64 Philox keys for the Triton kernel: the caller's per-row seeds, or B keys derived from one seed.

    Built on ``device`` without a host-to-device copy or a device read: an int seed picks (s, c) on the host, and
    row b's key is ``(s + b * c) mod PHILOX_KEY_MOD``; distinct keys give independent Philox streams.
    """
    if isinstance(seed, torch.Tensor):
        if seed.device != device:
            raise ValueError(f"verify_tree: seed is on {seed.device} but target_logits is on {device}")
        return seed.to(torch.int64) % PHILOX_KEY_MOD
    gen = torch.Generator()
    gen.manual_seed(seed)
    start, step = torch.randint(1, PHILOX_KEY_MOD, (2,), generator=gen).tolist()  # CPU generator: no device read
    return (start + torch.arange(B, dtype=torch.int64, device=device) * step) % PHILOX_KEY_MOD


# --- native CPU path --------------------------------------------------------------------------------------------


if triton_available():
    import triton
    import triton.language as tl

    GOLDEN_U64: tl.constexpr = tl.constexpr(GOLDEN % 2**64)  # rng.GOLDEN as the uint64 0x9E3779B97F4A7C15

    @triton.jit
    def _load_z(row_ptr, offs, V, inv_temp, all_neginf):
        """Sanitised scaled logits of one tile: -inf beyond V, NaN -> -inf, +inf -> float32 max."""
        mask = offs < V
        # times 1/temperature, not divided by it: an IEEE division per element calls ptxas's slow-path subroutine,
        # and live registers around those calls spilled (4-104 bytes, sm_80 and sm_90a; bench/aot_compile.py)
        z = tl.load(row_ptr + offs, mask=mask, other=float("-inf")).to(tl.float32) * inv_temp
        z = tl.where(z != z, float("-inf"), z)
        z = tl.minimum(z, 3.4028234663852886e38)
        z = tl.where(all_neginf, 0.0, z)
        return tl.where(mask, z, float("-inf")), mask

    @triton.jit
    def _key(z):
        """Order-preserving int32 key of a float32 (bisection over keys finds an exact threshold in 32 steps)."""
        bits = z.to(tl.int32, bitcast=True)
        return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)

    @triton.jit
    def _mix64(x):
        """spec_kernels.rng.mix64 on uint64 (wrapping multiplies, logical shifts): bit-identical to the torch one."""
        x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9
        x = (x ^ (x >> 27)) * 0x94D049BB133111EB
        return x ^ (x >> 31)

    @triton.jit
    def _node_key(noise_seed, position):
        """uint64 key of one node's noise, from int64 (s, t): mix64(rng.noise_keys(s, t) + GOLDEN), as rng.uniform
        derives it from the key."""
        key = _mix64(_mix64(noise_seed.to(tl.uint64, bitcast=True)) + position.to(tl.uint64, bitcast=True) * GOLDEN_U64)
        return _mix64(key + GOLDEN_U64)

    @triton.jit
    def _position_uniform(node_key, offs):
        """U(s, t, x) for the tile's ids ``offs``: bit for bit rng.position_uniform. One hash per logit, in
        registers: the noise never touches memory."""
        h = _mix64(node_key + offs.to(tl.uint64) * GOLDEN_U64)
        u = ((h >> 40).to(tl.uint32).to(tl.float32) + 0.5) * (1.0 / 16777216.0)  # top 24 bits: (k + 0.5) / 2^24
        return tl.minimum(u, 0.99999994)  # rng.UNIFORM_MAX: k = 2^24 - 1 rounds to 1, whose noise is infinite

    @triton.jit
    def _verify_tree_kernel(
        logits_ptr,  # [B, T, V]
        tokens_ptr,  # [B, T] int64
        parents_ptr,  # [B, T] int64
        draft_probs_ptr,  # [B, T, V] (HAS_DRAFT)
        temperature_ptr,  # [B] fp32
        top_k_ptr,  # [B] int64
        top_p_ptr,  # [B] fp32
        min_p_ptr,  # [B] fp32
        seeds_ptr,  # [B] int64
        noise_seeds_ptr,  # [B] int64 (HAS_COUPLING)
        positions_ptr,  # [B, T] int64 (HAS_COUPLING)
        coupled_ptr,  # [B] bool (HAS_COUPLING)
        work_p_ptr,  # [B, V] fp32 scratch: the materialised residual p (HAS_DRAFT)
        work_q_ptr,  # [B, V] fp32 scratch: the draft without earlier siblings (WITHOUT_REPLACEMENT)
        accepted_nodes_ptr,  # [B, T] int64, pre-filled with -1
        output_tokens_ptr,  # [B, T] int64, pre-filled with -1
        num_accepted_ptr,  # [B] int64
        T,
        V,
        stride_lb,
        stride_lt,
        stride_db,
        stride_dt,
        EPS: tl.constexpr,
        HAS_DRAFT: tl.constexpr,
        WITHOUT_REPLACEMENT: tl.constexpr,
        HAS_FILTERS: tl.constexpr,
        HAS_COUPLING: tl.constexpr,
        BLOCK_V: tl.constexpr,
    ):
        b = tl.program_id(0).to(tl.int64)
        temp = tl.load(temperature_ptr + b)
        greedy = temp == 0.0
        sampled = temp != 0.0
        inv_temp = 1.0 / tl.where(greedy, 1.0, temp)
        top_k = tl.load(top_k_ptr + b)
        top_p = tl.load(top_p_ptr + b)
        min_p = tl.load(min_p_ptr + b)
        seed = tl.load(seeds_ptr + b)
        coupled = False
        if HAS_COUPLING:
            coupled = (tl.load(coupled_ptr + b) != 0) & sampled
        walk_greedy = greedy | coupled  # coupled rows walk greedily on their perturbed argmax
        arange = tl.arange(0, BLOCK_V)
        KEY_NEG_INF = tl.full((), -2139095041, tl.int32)  # _key(-inf)
        tok_row = tokens_ptr + b * T
        par_row = parents_ptr + b * T
        work_p = work_p_ptr + b * V
        work_q = work_q_ptr + b * V

        tl.store(accepted_nodes_ptr + b * T, 0)
        cur = 0
        active = 1
        for depth in range(0, T):
            if active != 0:
                row = logits_ptr + b * stride_lb + cur * stride_lt
                # pass 1: max and first argmax of the scaled logits
                z_max = float("-inf")
                amax = 0
                for v0 in range(0, V, BLOCK_V):
                    z, _ = _load_z(row, v0 + arange, V, inv_temp, False)
                    tile_max = tl.max(z, 0)
                    tile_arg = tl.argmax(z, 0)
                    better = tile_max > z_max
                    amax = tl.where(better, v0 + tile_arg, amax)
                    z_max = tl.where(better, tile_max, z_max)
                all_neginf = z_max == float("-inf")  # nothing finite: uniform over V, greedy id 0
                z_max = tl.where(all_neginf, 0.0, z_max)

                # the transform keeps key(z) >= thr; the thresholds are exact values of z, so ties are kept
                thr = KEY_NEG_INF
                if HAS_FILTERS:
                    if (top_k > 0) & (top_k < V) & sampled:
                        lo = KEY_NEG_INF.to(tl.int64)  # count(z >= lo) = V >= k
                        hi = _key(z_max).to(tl.int64) + 1  # count(z >= hi) = 0 < k
                        # bisection that snaps both ends to actual values: exact, and ~log2(distinct values) passes
                        for _ in range(32):
                            if hi - lo > 1:
                                mid = (lo + hi) >> 1
                                count = 0
                                min_above = hi
                                max_below = lo
                                for v0 in range(0, V, BLOCK_V):
                                    z, mask = _load_z(row, v0 + arange, V, inv_temp, all_neginf)
                                    k = _key(z).to(tl.int64)
                                    above = (k >= mid) & mask
                                    count += tl.sum(above.to(tl.int32), 0)
                                    min_above = tl.minimum(min_above, tl.min(tl.where(above, k, hi), 0))
                                    max_below = tl.maximum(max_below, tl.max(tl.where(mask & ~above, k, lo), 0))
                                if count >= top_k:
                                    lo = min_above
                                    if count == top_k:
                                        hi = lo + 1
                                else:
                                    hi = max_below + 1
                        thr = lo.to(tl.int32)
                    if (top_p < 1.0) & sampled:
                        mass_k = 0.0
                        for v0 in range(0, V, BLOCK_V):
                            z, mask = _load_z(row, v0 + arange, V, inv_temp, all_neginf)
                            mass_k += tl.sum(tl.where((_key(z) >= thr) & mask, tl.exp(z - z_max), 0.0), 0)
                        # smallest key whose strictly-greater mass is < top_p: the least kept value
                        lo = KEY_NEG_INF.to(tl.int64) - 1
                        hi = _key(z_max).to(tl.int64)
                        for _ in range(33):
                            if hi - lo > 1:
                                mid = (lo + hi) >> 1
                                mass_above = 0.0
                                min_above = hi
                                max_below = lo
                                for v0 in range(0, V, BLOCK_V):
                                    z, mask = _load_z(row, v0 + arange, V, inv_temp, all_neginf)
                                    k = _key(z).to(tl.int64)
                                    kept = (k >= thr) & mask
                                    above = kept & (k > mid)
                                    mass_above += tl.sum(tl.where(above, tl.exp(z - z_max), 0.0), 0)
                                    min_above = tl.minimum(min_above, tl.min(tl.where(above, k, hi), 0))
                                    max_below = tl.maximum(max_below, tl.max(tl.where(kept & ~above, k, lo), 0))
                                if mass_above < top_p * mass_k:
                                    hi = tl.maximum(max_below, lo + 1)  # no value in (max_below, mid]
                                else:
                                    lo = min_above - 1  # no value in (mid, min_above)
                        thr = tl.maximum(thr, hi.to(tl.int32))
                    if min_p > 0.0:
                        thr = tl.maximum(thr, _key(z_max + tl.log(min_p)))
                if HAS_COUPLING:
                    if coupled:
                        # the Gumbel-max sample at this node: argmax over the support of z + g_t
                        node_key = _node_key(tl.load(noise_seeds_ptr + b), tl.load(positions_ptr + b * T + cur))
                        best = float("-inf")
                        for v0 in range(0, V, BLOCK_V):
                            offs = v0 + arange
                            z, mask = _load_z(row, offs, V, inv_temp, all_neginf)
                            g = -tl.log(-tl.log(_position_uniform(node_key, offs)))  # rng.position_gumbel
                            score = tl.where((_key(z) >= thr) & mask, z + g, float("-inf"))
                            tile_best = tl.max(score, 0)
                            tile_arg = tl.argmax(score, 0)
                            better = tile_best > best
                            amax = tl.where(better, v0 + tile_arg, amax)
                            best = tl.where(better, tile_best, best)
                lse = 0.0
                if not walk_greedy:  # a greedy walk needs only the argmax
                    mass = 0.0
                    for v0 in range(0, V, BLOCK_V):
                        z, mask = _load_z(row, v0 + arange, V, inv_temp, all_neginf)
                        mass += tl.sum(tl.where((_key(z) >= thr) & mask, tl.exp(z - z_max), 0.0), 0)
                    lse = z_max + tl.log(mass)

                # try the children in index order
                nxt = -1
                p_mat = 0  # residual p lives in work_p (unnormalised, mass p_mass)
                p_mass = 1.0
                q_mat = 0  # draft lives in work_q (unnormalised, mass q_mass)
                q_mass = 1.0
                rejected_mass = 0.0  # point-mass mode: p-mass of the rejected tokens since reset_from
                reset_from = 1
                for i in range(1, T):
                    par = tl.load(par_row + i)
                    if (nxt < 0) & (par == cur):
                        x = tl.load(tok_row + i)
                        if walk_greedy:
                            if x == amax:
                                nxt = i
                        else:
                            u = tl.sum(tl.rand(seed, tl.zeros([1], tl.int32) + i), 0)
                            z_x, _ = _load_z(row, x, V, inv_temp, all_neginf)
                            p_x = tl.where(_key(z_x) >= thr, tl.exp(z_x - lse), 0.0)
                            if HAS_DRAFT:
                                q_row = draft_probs_ptr + b * stride_db + cur * stride_dt
                                if p_mat != 0:
                                    p_x = tl.load(work_p + x) * (1.0 / p_mass)
                                q_x = tl.load(q_row + x).to(tl.float32)
                                if WITHOUT_REPLACEMENT:
                                    if q_mat != 0:
                                        q_x = tl.load(work_q + x) * (1.0 / q_mass)
                                if u * q_x < p_x:
                                    nxt = i
                                else:
                                    new_mass = 0.0
                                    inv_p_mass = 1.0 / p_mass
                                    inv_q_mass = 1.0 / q_mass
                                    new_q_mass = 0.0
                                    for v0 in range(0, V, BLOCK_V):
                                        offs = v0 + arange
                                        z, mask = _load_z(row, offs, V, inv_temp, all_neginf)
                                        p_v = tl.where(_key(z) >= thr, tl.exp(z - lse), 0.0)
                                        if p_mat != 0:
                                            p_v = tl.load(work_p + offs, mask=mask, other=0.0) * inv_p_mass
                                        q_v = tl.load(q_row + offs, mask=mask, other=0.0).to(tl.float32)
                                        if WITHOUT_REPLACEMENT:
                                            if q_mat != 0:
                                                q_v = tl.load(work_q + offs, mask=mask, other=0.0) * inv_q_mass
                                        r = tl.where(mask, tl.maximum(p_v - q_v, 0.0), 0.0)
                                        tl.store(work_p + offs, r, mask=mask)
                                        new_mass += tl.sum(r, 0)
                                        if WITHOUT_REPLACEMENT:
                                            q_v = tl.where(mask & (offs != x), q_v, 0.0)
                                            tl.store(work_q + offs, q_v, mask=mask)
                                            new_q_mass += tl.sum(q_v, 0)
                                    # a ~0 residual is rounding noise: fall back to the node's own distribution
                                    p_mat = (new_mass > EPS).to(tl.int32)
                                    p_mass = new_mass
                                    if WITHOUT_REPLACEMENT:
                                        q_mat = (new_q_mass > EPS).to(tl.int32)
                                        q_mass = new_q_mass
                            else:
                                duplicate = 0
                                for j in range(1, T):
                                    if j < i:
                                        if j >= reset_from:
                                            dup = (tl.load(par_row + j) == cur) & (tl.load(tok_row + j) == x)
                                            duplicate = tl.where(dup, 1, duplicate)
                                p_x = tl.where(duplicate != 0, 0.0, p_x)
                                if u * (1.0 - rejected_mass) < p_x:
                                    nxt = i
                                else:
                                    rejected_mass += p_x
                                    lost = 1.0 - rejected_mass <= EPS  # rounding noise: back to the node's p
                                    rejected_mass = tl.where(lost, 0.0, rejected_mass)
                                    reset_from = tl.where(lost, i + 1, reset_from)

                if nxt >= 0:
                    tl.store(accepted_nodes_ptr + b * T + depth + 1, nxt)
                    tl.store(output_tokens_ptr + b * T + depth, tl.load(tok_row + nxt))
                    cur = nxt
                else:
                    # recovered/bonus token: exponential race argmax(w / Exp(1)) over the residual weights w
                    final = amax
                    if not walk_greedy:
                        best = float("-inf")
                        for v0 in range(0, V, BLOCK_V):
                            offs = v0 + arange
                            z, mask = _load_z(row, offs, V, inv_temp, all_neginf)
                            w = tl.where(_key(z) >= thr, tl.exp(z - lse), 0.0)
                            if HAS_DRAFT:
                                if p_mat != 0:
                                    w = tl.load(work_p + offs, mask=mask, other=0.0)
                            else:
                                for j in range(1, T):
                                    if j >= reset_from:
                                        if tl.load(par_row + j) == cur:
                                            w = tl.where(offs == tl.load(tok_row + j), 0.0, w)
                            u = tl.rand(seed, T + offs)
                            live = mask & (w > 0.0)
                            gumbel = -tl.log(-tl.log(tl.maximum(u, 1e-30)))
                            score = tl.where(live, tl.log(tl.where(live, w, 1.0)) + gumbel, float("-inf"))
                            tile_best = tl.max(score, 0)
                            tile_arg = tl.argmax(score, 0)
                            better = tile_best > best
                            final = tl.where(better, v0 + tile_arg, final)
                            best = tl.where(better, tile_best, best)
                    tl.store(output_tokens_ptr + b * T + depth, final)
                    tl.store(num_accepted_ptr + b, depth + 1)
                    active = 0

    @torch.library.custom_op("spec_kernels::verify_tree_triton", mutates_args=())
    def _verify_tree_triton(
        target_logits: torch.Tensor,
        draft_tokens: torch.Tensor,
        parents: torch.Tensor,
        draft_probs: torch.Tensor | None,
        without_replacement: bool,
        temperature: torch.Tensor,
        top_k: torch.Tensor,
        top_p: torch.Tensor,
        min_p: torch.Tensor,
        seeds: torch.Tensor,
        has_filters: bool,
        noise_seeds: torch.Tensor | None,
        positions: torch.Tensor | None,
        coupled: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Launcher: inputs already checked by verify_tree. One program per sequence; seeds [B] int64 Philox keys;
        the coupling's noise_seeds [B] int64, positions [B, T] int64 and coupled [B] bool, or all None.

        ``has_filters`` compiles the top-k/top-p/min-p code; decided from the arguments' presence, never their
        values (that would be a host sync). Inside, each row branches at run time on its own top_k/top_p/min_p.
        """
        B, T, V = target_logits.shape
        dev = target_logits.device
        logits = target_logits if target_logits.stride(-1) == 1 else target_logits.contiguous()
        has_draft = draft_probs is not None
        has_coupling = noise_seeds is not None
        probs = draft_probs
        if has_draft and probs.stride(-1) != 1:
            probs = probs.contiguous()
        work_p = torch.empty((B, V) if has_draft else (1,), dtype=torch.float32, device=dev)
        work_q = torch.empty((B, V) if has_draft and without_replacement else (1,), dtype=torch.float32, device=dev)
        accepted_nodes = torch.full((B, T), PAD_NODE, dtype=torch.int64, device=dev)
        output_tokens = torch.full((B, T), PAD_NODE, dtype=torch.int64, device=dev)
        num_accepted = torch.zeros(B, dtype=torch.int64, device=dev)
        block_v = min(1024, triton.next_power_of_2(V))
        _verify_tree_kernel[(B,)](
            logits,
            draft_tokens.contiguous(),
            parents.contiguous(),
            probs if has_draft else logits,
            temperature.contiguous(),
            top_k.contiguous(),
            top_p.contiguous(),
            min_p.contiguous(),
            seeds,
            noise_seeds.contiguous() if has_coupling else seeds,
            positions.contiguous() if has_coupling else seeds,
            coupled.contiguous() if has_coupling else seeds,
            work_p,
            work_q,
            accepted_nodes,
            output_tokens,
            num_accepted,
            T,
            V,
            logits.stride(0),
            logits.stride(1),
            probs.stride(0) if has_draft else 0,
            probs.stride(1) if has_draft else 0,
            EPS=RESIDUAL_EPS,
            HAS_DRAFT=has_draft,
            WITHOUT_REPLACEMENT=has_draft and without_replacement,
            HAS_FILTERS=has_filters,
            HAS_COUPLING=has_coupling,
            # Wider tiles spilled (ptxas: 4096 wide, 16-40 bytes of stack on sm_80 and sm_90a; 2048 wide, 96-208
            # bytes on sm_90a with a draft). One warp per 128 logits: with 4 warps for any width, 128 and 1024 wide
            # tiles saved 16-36 bytes around ptxas's outlined warp-shuffle calls; 1 and 8 warps saved none.
            # bench/aot_compile.py checks every variant.
            BLOCK_V=block_v,
            num_warps=max(1, min(8, block_v // 128)),
        )
        return accepted_nodes, output_tokens, num_accepted

    @_verify_tree_triton.register_fake
    def _(
        target_logits,
        draft_tokens,
        parents,
        draft_probs,
        without_replacement,
        temperature,
        top_k,
        top_p,
        min_p,
        seeds,
        has_filters,
        noise_seeds,
        positions,
        coupled,
    ):
        B, T, _ = target_logits.shape
        new = target_logits.new_empty
        return (
            new((B, T), dtype=torch.int64),
            new((B, T), dtype=torch.int64),
            new((B,), dtype=torch.int64),
        )
