"""One rank's shard of a Llama-family target for tensor parallelism (spec_engine/distributed/ runs the ranks):
Megatron's split of the model (``shard_plan``), the checkpoint slices a rank reads (``Checkpoint``), and the shard's
forward (``ShardedLlama``). Glossary: spec_engine/distributed/__init__.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F

from spec_engine.models.config import ModelConfig, rope_inv_freq
from spec_kernels import linear, plan_tree_attention, tree_attention
from spec_kernels.decoder_layers.ref import decoder_layer_loop
from spec_kernels.fused_elementwise import layer_ops


class AllReduce(Protocol):
    """What a shard needs of its process group: an in-place sum over the ranks."""

    def all_reduce(self, tensor: torch.Tensor) -> None: ...


@dataclass(frozen=True)
class ShardPlan:
    """Which slice of every sharded dimension rank ``rank`` of ``world`` holds (half-open ranges)."""

    rank: int
    world: int
    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]
    intermediate: tuple[int, int]
    vocab: tuple[int, int]  # the rows this rank owns; its shard is padded to vocab_per_rank rows
    vocab_per_rank: int

    @property
    def num_q_heads(self) -> int:
        return self.q_heads[1] - self.q_heads[0]

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]


# the families whose HF checkpoints this reads slices of by name (the Llama layer, q/k/v and gate/up apart)
SHARDED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


def shard_plan(cfg: ModelConfig, world: int, rank: int) -> ShardPlan:
    """Megatron's split of ``cfg`` over ``world`` ranks. KV heads are split when there are at least ``world`` of
    them and replicated otherwise (each rank keeps the one its query heads read).

    Raises ValueError when the heads or the MLP width do not divide."""
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"tensor_parallel_size must be a positive int, got {world!r}")
    if world > 1 and cfg.model_type not in SHARDED_FAMILIES:
        raise ValueError(f"tensor_parallel_size > 1 runs {', '.join(SHARDED_FAMILIES)} (separate q/k/v and gate/up "
                         f"matrices, Llama's layer); not model_type {cfg.model_type!r}")  # fmt: skip
    Hq, Hkv, inter = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size
    if Hq % world:
        raise ValueError(
            f"tensor_parallel_size={world} does not divide the {Hq} attention heads: each rank must hold whole heads"
        )
    if Hkv >= world and Hkv % world:
        raise ValueError(f"tensor_parallel_size={world} does not divide the {Hkv} KV heads")
    if Hkv < world and world % Hkv:
        raise ValueError(
            f"tensor_parallel_size={world} is not a multiple of the {Hkv} KV heads (fewer KV heads than ranks are "
            "replicated, which needs each KV head shared by the same number of ranks)"
        )
    if inter % world:
        raise ValueError(f"tensor_parallel_size={world} does not divide intermediate_size={inter}")
    q_per = Hq // world
    if Hkv >= world:
        kv_per = Hkv // world
        kv = (rank * kv_per, (rank + 1) * kv_per)
    else:
        head = rank // (world // Hkv)  # the KV head of this rank's query heads
        kv = (head, head + 1)
    v_per = -(-cfg.vocab_size // world)
    inter_per = inter // world
    return ShardPlan(
        rank, world, (rank * q_per, (rank + 1) * q_per), kv, (rank * inter_per, (rank + 1) * inter_per),
        (min(rank * v_per, cfg.vocab_size), min((rank + 1) * v_per, cfg.vocab_size)), v_per,
    )  # fmt: skip


def shard_config(cfg: ModelConfig, plan: ShardPlan) -> ModelConfig:
    """The config of one rank's KV cache: its own KV heads."""
    return replace(cfg, num_key_value_heads=plan.num_kv_heads)


class Checkpoint:
    """Reads slices of named tensors from HF safetensors files without loading the rest (``safe_open.get_slice``)."""

    def __init__(self, model_dir: Path):
        from safetensors import safe_open

        index = model_dir / "model.safetensors.index.json"
        if index.is_file():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        else:
            files = sorted(p.name for p in model_dir.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
        self._files = [safe_open(str(model_dir / f), framework="pt") for f in files]
        self._where = {name: f for f in self._files for name in f.keys()}

    def has(self, name: str) -> bool:
        return name in self._where

    def read(self, name: str, shape: tuple[int, ...], rows=None, cols=None) -> torch.Tensor:
        """``name``'s [rows, cols] slice, after checking the full tensor has ``shape``."""
        if name not in self._where:
            raise ValueError(f"the checkpoint lacks {name}")
        sl = self._where[name].get_slice(name)
        if tuple(sl.get_shape()) != tuple(shape):
            raise ValueError(f"weight {name}: checkpoint shape {tuple(sl.get_shape())} != expected {tuple(shape)}")
        r = slice(*rows) if rows else slice(None)
        if cols:
            return sl[r, slice(*cols)]
        return sl[r] if rows else sl[:]


class ShardedLlama:
    """One rank's shard of a Llama-family target: the engine's forward over this rank's heads, intermediate columns,
    vocabulary rows and KV-cache shard, with the all-reduces of Megatron's layer inside.

    The layer loop is ``spec_kernels.decoder_layers.ref.decoder_layer_loop`` (the CUDA / meta path of
    ``decoder_layers``) with a ``linear`` that all-reduces the row-parallel outputs (o and down). Shapes as
    ``LlamaForCausalLM.forward``, with Hq and Hkv this rank's; ``logits`` returns this rank's vocabulary slice
    [..., vocab_per_rank].
    """

    def __init__(self, model_dir: str | Path, cfg: ModelConfig, plan: ShardPlan, comm: AllReduce, dtype, device):
        ckpt = Checkpoint(Path(model_dir))
        self.config, self.plan, self.comm = cfg, plan, comm
        H, D, V = cfg.hidden_size, cfg.head_dim, cfg.vocab_size
        Hq, Hkv, inter = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size
        q_rows = (plan.q_heads[0] * D, plan.q_heads[1] * D)
        kv_rows = (plan.kv_heads[0] * D, plan.kv_heads[1] * D)

        def read(name, shape, rows=None, cols=None):
            return ckpt.read(name, shape, rows, cols).to(device=device, dtype=dtype).contiguous()

        def vocab_rows(name):  # this rank's rows, zero-padded to vocab_per_rank
            w = read(name, (V, H), plan.vocab) if plan.vocab[1] > plan.vocab[0] else torch.empty(0, H, dtype=dtype)
            return F.pad(w, (0, 0, 0, plan.vocab_per_rank - w.shape[0])).to(device)

        self.embed = vocab_rows("model.embed_tokens.weight")  # [V / N, H]
        tied = cfg.tie_word_embeddings or not ckpt.has("lm_head.weight")
        self.lm_head = self.embed if tied else vocab_rows("lm_head.weight")  # [V / N, H]
        self.final_norm = read("model.norm.weight", (H,))
        self.weights: list[torch.Tensor | None] = []  # LAYER_FIELDS per layer
        self._row_parallel: set[int] = set()  # ids of the o and down shards: their outputs are all-reduced
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            qkv = torch.cat([read(a + "q_proj.weight", (Hq * D, H), q_rows), read(a + "k_proj.weight", (Hkv * D, H),
                            kv_rows), read(a + "v_proj.weight", (Hkv * D, H), kv_rows)])  # fmt: skip
            bias = None
            if cfg.attention_bias:
                bias = torch.cat([read(a + "q_proj.bias", (Hq * D,), q_rows), read(a + "k_proj.bias", (Hkv * D,),
                                 kv_rows), read(a + "v_proj.bias", (Hkv * D,), kv_rows)])  # fmt: skip
            o = read(a + "o_proj.weight", (H, Hq * D), None, q_rows)  # [H, Hq/N D]
            m = p + "mlp."
            gate_up = torch.cat([read(m + "gate_proj.weight", (inter, H), plan.intermediate),
                                 read(m + "up_proj.weight", (inter, H), plan.intermediate)])  # fmt: skip
            down = read(m + "down_proj.weight", (H, inter), None, plan.intermediate)  # [H, I/N]
            norms = (read(a + "q_norm.weight", (D,)), read(a + "k_norm.weight", (D,))) if cfg.qk_norm else (None, None)
            self.weights += [read(p + "input_layernorm.weight", (H,)), qkv, bias, o,
                             read(p + "post_attention_layernorm.weight", (H,)), gate_up, down,
                             *norms, None, None, None]  # fmt: skip
            self._row_parallel |= {id(o), id(down)}
        self.inv_freq = rope_inv_freq(cfg.rope, D).to(device)

    def _linear(self, x, w, b):
        y = linear(x, w, b)
        if id(w) in self._row_parallel:
            self.comm.all_reduce(y)
        return y

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        lo = self.plan.vocab[0]
        local = input_ids - lo
        mine = (local >= 0) & (local < self.plan.vocab[1] - lo)  # [B, T]
        h = F.embedding(local.clamp(0, self.embed.shape[0] - 1), self.embed) * mine[..., None].to(self.embed.dtype)
        self.comm.all_reduce(h)  # exactly one rank contributes each row: the sum is exact
        return h  # [B, T, H]

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        freqs = positions.float()[..., None] * self.inv_freq.float()  # as LlamaForCausalLM's table: same values
        emb = torch.cat((freqs, freqs), dim=-1)
        return torch.stack((emb.cos().to(dtype), emb.sin().to(dtype)))  # [2, B, T, D]

    def forward(self, input_ids, positions, kv_cache, cache_seqlens, tree_mask, block_table=None) -> torch.Tensor:
        h = self._embed(input_ids)
        plan = plan_tree_attention(kv_cache[0, 0], cache_seqlens, tree_mask, num_q_heads=self.plan.num_q_heads,
                                   block_table=block_table)  # fmt: skip

        def attend(q, k_cache, v_cache, window):  # (the Llama layer's: no window)
            return tree_attention(q, k_cache, v_cache, cache_seqlens, tree_mask, block_table=block_table, plan=plan)

        return decoder_layer_loop(
            h, self.weights, self.final_norm, kv_cache, cache_seqlens, self._rope(positions, h.dtype), tree_mask,
            block_table, self.plan.num_q_heads, self.config.rms_norm_eps, self._linear, attend, None, layer_ops(),
        )  # fmt: skip

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> this rank's vocabulary slice [..., vocab_per_rank] in float32."""
        return linear(hidden, self.lm_head).float()
