"""The vLLM-style Python API: ``LLM(model, speculative_config).generate(prompts, SamplingParams)``."""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from spec_engine.chat_template import ChatTemplate
from spec_engine.config import DTYPES, parse_speculative_config
from spec_engine.drafters.factory import DrafterFactory
from spec_engine.engine import Engine, EngineConfig
from spec_engine.inputs import InputProcessor
from spec_engine.kv_cache import BlockAllocator, PagedKVCache, kv_bytes_per_token, plan_num_blocks
from spec_engine.models import load_model
from spec_engine.models.gguf import gguf_path_or_none
from spec_engine.models.gguf_tokenizer import load_tokenizer
from spec_engine.request import Request
from spec_engine.sampling import (
    SamplingParams,
    output_text,
    stop_search_start,
    visible_text,
)
from spec_engine.structured import Grammars
from spec_engine.zoo import shipped_drafter
from spec_engine.zoo.pull import resolve_model
from spec_kernels._backend import cpu_supports_native_bf16
from spec_kernels._ext import load_ext

DEFAULT_MAX_MODEL_LEN = 4096  # the context when none is asked for, where the model's is longer (KV memory)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    # SamplingParams.logprobs: per token of token_ids, {token: its log-probability, then the alternatives'}
    logprobs: list[dict[int, float]] | None = None
    # the sum of token_ids' log-probabilities (vLLM's), where SamplingParams.logprobs asks for them; else None
    cumulative_logprob: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: dict = field(default_factory=dict)
    # SamplingParams.prompt_logprobs: per prompt token, {token: its log-probability, then the alternatives'}; None
    # for the first
    prompt_logprobs: list[dict[int, float] | None] | None = None


def shipped_model(target_config, method: str) -> str:
    """The drafter the project ships for a target (``spec_engine.zoo.shipped_drafter``) for ``method``; the hybrid
    wraps a draft model where one is shipped, else an EAGLE head. ValueError, naming "model", where none is."""
    if method != "hybrid":
        return shipped_drafter(target_config, method)
    try:
        return shipped_drafter(target_config, "draft_model")
    except ValueError:
        return shipped_drafter(target_config, "eagle")


def _draft_dtype(dtype: str, device: str) -> str:
    """A draft model's default precision: the device's fastest (``auto_dtype``) where it is narrower than the
    target's, else the target's. The draft's precision changes which tokens it proposes, never which are emitted."""
    fast = auto_dtype(device)
    return fast if DTYPES[fast].itemsize < DTYPES[dtype].itemsize else dtype


def auto_dtype(device: str) -> str:
    """The fastest precision of the weights and KV caches on ``device`` (``dtype="auto"``, the default).

    CPU: bfloat16 where the native kernels have a vector bfloat16 path, AVX512-BF16 or AVX2 + FMA (the default
    pair, 2 threads: faster than float32, plain and speculative, because bf16 halves the bytes every step streams
    and target + draft then fit in the L3 cache; bench/RESULTS-log.md, "Figures moved from code comments (2026-11-26)"),
    float32 elsewhere. CUDA: bfloat16 where the GPU has it, float16 otherwise. Other devices (meta): float32. Greedy
    tokens are those of the chosen dtype; pass ``dtype="float32"`` for float32's. ``$SPECDEC_AUTO_DTYPE`` (one of
    ``DTYPES``), where set, is what "auto" means on every device: a process, or a test session, that must match
    float32 references without naming the dtype in each call."""
    chosen = os.environ.get("SPECDEC_AUTO_DTYPE")
    if chosen:
        if chosen not in DTYPES:
            raise ValueError(f"SPECDEC_AUTO_DTYPE must be one of {list(DTYPES)}, got {chosen!r}")
        return chosen
    kind = torch.device(device).type  # ("cuda:1" is a CUDA device too)
    if kind == "cuda":
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    if kind == "cpu" and cpu_supports_native_bf16():
        return "bfloat16"
    return "float32"


class LLM:
    """Generate with a target model, optionally speculating.

    Parameters
    ----------
    model : HF directory with config.json, *.safetensors and tokenizer.json; a GGUF file (``*.gguf``: config,
        tokenizer and chat template from its metadata, weights dequantized to ``dtype``); or a registry name
        (``"smollm2"``, ``spec_engine.zoo.pull``), pulled into the model cache on first use.
    speculative_config : None, ``{"method": "draft_model", "model": DIR, "num_speculative_tokens": g,
        "tree": [b1, b2, ...]}`` (children per depth, padded with 1 up to g) or ``{"method": "ngram", ...}``.
        ``num_speculative_tokens`` left out or ``"auto"`` is adaptive speculation: each step the engine picks the
        depth per request, 0 (no drafting) to 8 for chains or to the tree's depth, to maximise the tokens per
        second it expects from measured acceptance and measured step costs. An int fixes the depth. With an EAGLE
        head (``"method": "eagle"``, or the hybrid's) on a CPU it picks each step's width too (``"tree": "auto"``,
        the default there: a chain or EAGLE-2's dynamic tree of ``eagle_topk`` nodes a level, 3; ``"chain"``: chains).
        ``draft_vocab_size``: K, the draft's logits over the K most frequent token ids of its directory's
        ``draft_vocab.json`` only (FR-Spec; lossless: the target decides); left out, the file's own K, or the full
        vocabulary without the file; the vocabulary size turns it off.
        ``{"method": "suffix", ...}``: suffix decoding (``spec_engine.drafters.suffix``), model-free speculation trees
        from the request's own prompt and output and from earlier requests' outputs; ``num_speculative_tokens`` caps
        a row's tree nodes ("auto": up to 16, the adaptive controller choosing each row's cap); vLLM's knobs
        ``suffix_decoding_max_tree_depth`` (32; vLLM's 24), ``suffix_decoding_max_spec_factor`` (1.0),
        ``suffix_decoding_min_token_prob`` (0.1), ``suffix_decoding_max_cached_requests`` (1000 here; -1
        unbounded), and ours: ``suffix_decoding_use_tree_spec`` (True: trees; False: chains),
        ``suffix_decoding_min_score`` (1.0: the least expected accepted tokens worth drafting).
        ``{"method": "hybrid", "model": DIR, ...}``: per row and step, the suffix speculation where its score beats
        the model drafter's expected accepted tokens (a draft model, or an EAGLE head: told apart by its weights),
        the model drafter elsewhere; the model drafter's keys apply to it, the suffix keys to the suffix side, and
        ``suffix_decoding_max_spec_tokens`` (16) caps a suffix row's nodes.
    device, dtype : where and in what precision the weights and KV caches live; ``dtype="auto"`` (the default) is
        the fastest for the device (``auto_dtype``: bfloat16 on CPUs with AVX512-BF16 or AVX2 and on GPUs, else
        float32).
    max_model_len : context length (prompt + output), at most the model's; defaults to the model's, capped at
        ``DEFAULT_MAX_MODEL_LEN`` (4096: KV memory for ``max_num_seqs`` full requests).
    max_num_seqs : requests decoded together.
    kv_cache_memory : bytes for the KV caches of both models. Requests take blocks as they grow; where none are left
        the newest are preempted and resumed later with the same output (``Scheduler.make_room``).
    enable_prefix_caching : keep requests' full blocks of prompt K/V (as their prefill completes them), so a request
        whose prompt starts with the same tokens (a chat's history, a system prompt, a request served again)
        computes only the rest (vLLM's automatic prefix caching; ``spec_engine.kv_cache.BlockAllocator``). Cached
        blocks no request holds are reclaimed, least recently used first, when blocks run out.
    tensor_parallel_size : ranks the target is sharded over (Megatron-style, ``spec_engine.distributed``): N - 1
        worker processes are spawned (one per CUDA device, or CPU ranks over gloo); the drafter and verification run
        here, on rank 0. ``close()`` stops the workers. ValueError when the heads or MLP width do not divide.
    engine_config : the engine's knobs (``spec_engine.engine.EngineConfig``; native chain lengths); None: defaults.
    enforce_eager : run every step's target pass eagerly (vLLM's name and default, False): on CUDA the regular step
        otherwise replays it from a CUDA graph captured per bucket of (rows, verify width): the common buckets at
        start-up, the others when first met (``spec_engine.cuda_graphs``); same tokens and cache either way. On CPU
        and meta it changes nothing (a CPU runs its native multi-step calls); tensor parallelism always runs eagerly
        (its forward broadcasts from the host).
    quantization : None, or ``"gguf"`` (vLLM's name): keep a GGUF file's quantized matrices (Q8_0, Q4_0, Q4_1, Q5_0,
        Q5_1, Q2_K-Q6_K) as stored and multiply them with the native CPU kernels (``spec_kernels.quant_linear``);
        norms and activations in ``dtype``. Greedy output in float32 with ``quant_activations="float"`` is that of the
        same file dequantized at load. ValueError for a model that is not a GGUF file; on a non-CPU device the
        weights are dequantized at load, with a warning.
    quant_activations : how quantized weights multiply (``quantization="gguf"`` only): ``"float"`` (float32 products,
        the dequantized model's logits) or ``"int8"`` (llama.cpp's way: activations quantized to int8 per 32
        weights, integer dot products; logits near the float path's). None: int8 where the CPU has AVX2 or
        AVX-512, float elsewhere (``spec_engine.models.loader.default_quant_activations``, by measurement).
        Speculation stays lossless in either mode. ValueError for another value.
    """

    def __init__(
        self,
        model: str | Path,
        speculative_config: dict | None = None,
        device: str = "cpu",
        dtype: str = "auto",
        *,
        max_model_len: int | None = None,
        max_num_seqs: int = 16,
        kv_cache_memory: int | None = None,
        block_size: int = 32,
        prefill_chunk: int = 512,
        tensor_parallel_size: int = 1,
        engine_config: EngineConfig | None = None,
        quantization: str | None = None,
        quant_activations: str | None = None,
        enable_prefix_caching: bool = True,
        enforce_eager: bool = False,
    ):
        sizes = {
            "tensor_parallel_size": tensor_parallel_size,
            "max_num_seqs": max_num_seqs,
            "block_size": block_size,
            "prefill_chunk": prefill_chunk,
            "max_model_len": max_model_len,
            "kv_cache_memory": kv_cache_memory,
        }
        for name, value in sizes.items():
            if value is None and name in ("max_model_len", "kv_cache_memory"):  # the defaults
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        try:
            kind = torch.device(device).type
        except RuntimeError as error:
            raise ValueError(f"device must be a torch device such as 'cpu' or 'cuda', got {device!r}") from error
        self.tensor_parallel_size = tensor_parallel_size
        if dtype == "auto":
            dtype = auto_dtype(device)
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {list(DTYPES)}, got {dtype!r}")
        self.dtype = dtype
        if kind == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device={device!r} but no CUDA device is available")
        torch_dtype = DTYPES[dtype]
        spec = parse_speculative_config(speculative_config, device)
        model = resolve_model(model)
        self.model_dir = Path(model)
        if tensor_parallel_size > 1 and gguf_path_or_none(model) is not None:
            raise ValueError("tensor_parallel_size > 1 reads HF safetensors shards; a GGUF file loads on one device")
        model_method = spec["model_method"] if spec else None
        if tensor_parallel_size > 1:  # rank 0's shard plus N - 1 worker processes (spec_engine/distributed/)
            if quantization is not None or quant_activations is not None:
                raise ValueError("quantization='gguf' runs on one process: not supported with tensor_parallel_size > 1")
            if model_method == "eagle":
                raise ValueError("EAGLE heads read the target's features: not supported with tensor_parallel_size > 1")
            from spec_engine.distributed import launch

            self.target = launch(model, tensor_parallel_size, dtype=torch_dtype, device=device)
        else:
            self.target = load_model(model, dtype=torch_dtype, device=device, quantization=quantization,
                                     quant_activations=quant_activations)  # fmt: skip
        self.tokenizer = load_tokenizer(model)
        self.inputs = InputProcessor(self.tokenizer, self.model_dir)
        self.served_by = None  # the AsyncEngine stepping this engine in its thread, if any (generate then refuses)
        self._chat_template: ChatTemplate | None = None
        cfg = self.target.config
        if max_model_len is not None and max_model_len > cfg.max_position_embeddings:
            raise ValueError(f"max_model_len ({max_model_len}) is past the model's context "
                             f"({cfg.max_position_embeddings} positions)")  # fmt: skip
        self.max_model_len = max_model_len or min(cfg.max_position_embeddings, DEFAULT_MAX_MODEL_LEN)
        if spec and spec["model_method"] is None:  # a model-drafter method given no "model": the one shipped
            spec = parse_speculative_config({**speculative_config, "model": shipped_model(cfg, spec["method"])}, device)
            model_method = spec["model_method"]
        self.speculative_config = spec

        draft_dtype = DTYPES[(spec or {}).get("draft_dtype") or _draft_dtype(dtype, device)]
        drafts = DrafterFactory(spec, self.target, self.model_dir, dtype=torch_dtype, draft_dtype=draft_dtype,
                                device=device)  # fmt: skip
        gamma, max_tree_nodes = drafts.gamma, drafts.max_tree_nodes
        # the lean inference path: fused matrices and a RoPE table for every position a request can reach
        self.target.fuse(max_positions=self.max_model_len + max_tree_nodes + 1)
        drafts.fuse(max_positions=self.max_model_len + max_tree_nodes + 1)
        # one full-length request plus the tree of its last step must always fit
        max_request_tokens = self.max_model_len + max_tree_nodes
        caches = [(cfg, torch_dtype), *drafts.caches]  # each KV cache in its model's dtype
        if kv_cache_memory is None:  # room for max_num_seqs full-length requests and the scratch block, up to 2 GiB
            per_block = block_size * sum(kv_bytes_per_token(c, dt) for c, dt in caches)
            blocks_per_seq = math.ceil(max_request_tokens / block_size)
            kv_cache_memory = min(2 << 30, (max_num_seqs * blocks_per_seq + 1) * per_block)
        num_blocks = plan_num_blocks(caches, block_size, kv_cache_memory, max_request_tokens)
        self.allocator = BlockAllocator(num_blocks, block_size, prefix_caching=enable_prefix_caching)
        if tensor_parallel_size > 1:  # every rank's shard of the cache (its KV heads); rank 0's is the engine's
            kv = self.target.kv_cache(num_blocks, block_size)
        else:
            kv = PagedKVCache(cfg, num_blocks, block_size, torch_dtype, device)
        drafter = drafts.build(num_blocks, block_size)
        load_ext()  # compact_kv_'s extension: compiled (once per machine) here, not inside the first timed step
        config = engine_config or EngineConfig()
        if enforce_eager:
            config = dataclasses.replace(config, enforce_eager=True)
        self.engine = Engine(
            self.target, kv, self.allocator, drafter,
            num_speculative_tokens=gamma, max_model_len=self.max_model_len, max_num_seqs=max_num_seqs,
            prefill_chunk=prefill_chunk, eos_token_ids=cfg.eos_token_id, adaptive=bool(spec and spec["adaptive"]),
            config=config, detokenize=self.decode if self.tokenizer is not None else None,
            grammars=Grammars(self.tokenizer, cfg.vocab_size, cfg.eos_token_id) if self.tokenizer is not None else None,
        )  # fmt: skip

    @property
    def healthy(self) -> bool:
        """False once a tensor-parallel worker died or the group failed (every later step raises)."""
        return self.tensor_parallel_size == 1 or self.target.healthy

    def close(self) -> None:
        """Stop the tensor-parallel workers (also done at garbage collection and at exit); a no-op with one device."""
        if self.tensor_parallel_size > 1:
            self.target.close()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.inputs.encode(text, add_special_tokens)

    def encode_words(self, text: str) -> list[int]:
        """Text's tokens with no special tokens around them: ``bad_words`` and ``guided_choice`` strings as token ids
        (``InputProcessor.encode_words``)."""
        return self.inputs.encode_words(text)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """The text of ``ids`` ("" without a tokenizer); special tokens left out unless ``skip_special_tokens`` is
        False."""
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens) if self.tokenizer is not None else ""

    def get_chat_template(self, chat_template: str | None = None) -> ChatTemplate:
        """The model's chat template (HF directory or GGUF metadata), or ``chat_template`` (a Jinja source)."""
        if chat_template is not None:
            return ChatTemplate(self.model_dir, source=chat_template)
        if self._chat_template is None:
            self._chat_template = ChatTemplate(self.model_dir)
        return self._chat_template

    def render_chat(
        self, messages: list[dict], *, chat_template: str | None = None, add_generation_prompt: bool = True,
        chat_template_kwargs: dict | None = None,
    ) -> tuple[str, list[int]]:  # fmt: skip
        """One conversation rendered by the chat template: (text, token ids). A model's own template writes its
        special tokens (BOS...) itself, so encoding does not add them again."""
        template = self.get_chat_template(chat_template)
        text = template.render(messages, add_generation_prompt, **(chat_template_kwargs or {}))
        return text, self.encode(text, add_special_tokens=not template.from_model)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict | None = None,
        tools: list[dict] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to conversations, as vLLM's ``LLM.chat``.

        Parameters
        ----------
        messages : one conversation (``[{"role": "user", "content": "..."}, ...]``) or a list of them; a content is
            a string or OpenAI's ``[{"type": "text", "text": ...}]`` parts (joined, as the server reads them).
        sampling_params : one for all conversations, or one per conversation.
        chat_template : a Jinja source used instead of the model's template (HF directory or GGUF metadata;
            models without one get ``DEFAULT_CHAT_TEMPLATE``).
        add_generation_prompt : end the prompt with the assistant's header, for the model to continue from.
        chat_template_kwargs : more variables for the template.
        tools : OpenAI's tool definitions, the template's ``tools`` variable (a call's arguments are the caller's to
            guide: ``SamplingParams.guided_json`` with the function's parameters).

        Returns one ``RequestOutput`` per conversation, in order; ``prompt`` holds the rendered text.
        """
        shape = "messages must be a non-empty list of {'role': str, 'content': ...} dicts, or a list of them"
        if not isinstance(messages, (list, tuple)):  # (a bare message dict, None, a string)
            raise ValueError(f"{shape}; got {type(messages).__name__}")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        if not conversations:
            raise ValueError(shape)
        for conv in conversations:
            if not isinstance(conv, (list, tuple)) or not conv or not all(isinstance(m, dict) for m in conv):
                raise ValueError(shape)
            for m in conv:  # (an assistant's earlier tool calls may stand without content, as OpenAI's)
                if not isinstance(m.get("role"), str) or "content" not in m and not m.get("tool_calls"):
                    raise ValueError(f"{shape}; got {m!r}"[:300])
        if tools is not None:
            chat_template_kwargs = {**(chat_template_kwargs or {}), "tools": tools}
        kwargs = dict(chat_template=chat_template, add_generation_prompt=add_generation_prompt,
                      chat_template_kwargs=chat_template_kwargs)  # fmt: skip
        rendered = [self.render_chat(conv, **kwargs) for conv in conversations]
        outs = self.generate([{"prompt_token_ids": ids} for _, ids in rendered], sampling_params, use_tqdm=use_tqdm)
        for out, (text, _) in zip(outs, rendered):
            out.prompt = text
        return outs

    def generate(
        self,
        prompts,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt; returns one ``RequestOutput`` per prompt, in order.

        Invalid input raises ``ValueError`` before any work starts, and the engine stays usable.
        """
        if self.served_by is not None:
            raise RuntimeError("this LLM's engine is served by an AsyncEngine (a running server): send requests "
                               "through it, or build another LLM for direct calls")  # fmt: skip
        if not isinstance(prompts, (list, tuple)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
        parsed = [self.inputs.prompt(p) for p in prompts]
        for p in params:
            if not isinstance(p, SamplingParams):
                raise ValueError(f"sampling_params must be SamplingParams, got {type(p).__name__}")
        params = [self.inputs.word_ids(p) for p in params]
        sequences = [self.inputs.sequences(p) for p in params]  # each prompt's n sequences, one engine request each
        for seqs in sequences:  # the prompt's logprobs are the first sequence's: the others take its K/V from the cache
            for later in seqs[1:]:
                later.prompt_logprobs = None
        for (_, ids), seqs in zip(parsed, sequences):  # validate everything before queueing anything
            for p in seqs:
                self.engine.check_request(ids, p)
        groups: list[list[Request]] = []
        reqs: list[Request] = []
        try:
            for (_, ids), seqs in zip(parsed, sequences):
                groups.append([self.engine.add_request(ids, p) for p in seqs])
                reqs += groups[-1]
            total = sum(p.max_tokens for p in params for _ in range(p.n))
            with tqdm(total=total, desc="generate", unit="tok", disable=not use_tqdm, dynamic_ncols=True) as bar:
                while any(not r.finished for r in reqs):
                    for out in self.engine.step():
                        bar.update(len(out.new_token_ids) + (out.request.tokens_left if out.finished else 0))
        except BaseException:
            for r in reqs:
                if not r.finished:
                    self.engine.abort(r.request_id)
            raise
        failed = [r for r in reqs if r.finish_reason == "error"]
        if failed:
            raise RuntimeError(f"request {failed[0].request_id} failed in the engine: {failed[0].error}")
        return [self._output(group, text) for group, (text, _) in zip(groups, parsed)]

    def _output(self, group: list[Request], prompt: str | None) -> RequestOutput:
        """One prompt's output: its sequences in order; the metrics are the first sequence's."""
        first = group[0]
        outputs = [
            CompletionOutput(
                i,
                visible_text(
                    output_text(self.decode, r.prompt_token_ids, r.text_token_ids, r.params.skip_special_tokens),
                    r.params.stop,
                    True,
                    r.params.include_stop_str_in_output,
                    stop_search_start(r.params, r.output_token_ids, self.decode, r.prompt_token_ids),
                ),
                list(r.output_token_ids),
                r.finish_reason,
                list(r.output_logprobs) if r.params.logprobs is not None else None,
                sum(e[t] for t, e in zip(r.output_token_ids, r.output_logprobs))
                if r.params.logprobs is not None
                else None,
            )
            for i, r in enumerate(group)
        ]
        return RequestOutput(
            request_id=first.request_id,
            prompt=prompt,
            prompt_token_ids=first.prompt_token_ids,
            outputs=outputs,
            finished=all(r.finished for r in group),
            metrics=first.metrics.as_dict(len(first.output_token_ids)),
            prompt_logprobs=list(first.prompt_logprobs) if first.params.prompt_logprobs is not None else None,
        )


def model_config(model: str | Path):
    """The ``ModelConfig`` of an HF directory or a GGUF file (its metadata only: no weights are read)."""
    from spec_engine.models import ModelConfig
    from spec_engine.models.gguf import gguf_config, open_gguf

    path = gguf_path_or_none(model)
    return gguf_config(open_gguf(path)) if path is not None else ModelConfig.from_dir(model)


def default_method(model: str | Path, draft: str | None) -> str:
    """The CLI's speculation method when none is asked for: the hybrid wherever a model drafter exists (``draft``,
    or one the project ships for this target), suffix decoding elsewhere (it needs no weights)."""
    if draft:
        return "hybrid"
    try:
        shipped_model(model_config(model), "hybrid")
    except ValueError:
        return "suffix"
    return "hybrid"
