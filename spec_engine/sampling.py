"""Per-request sampling parameters (vLLM-style) and their validation.

The engine builds float32 and int64 tensors from these values, so they are checked in those dtypes: a value that is
fine as a Python float but ``inf`` or 0 in float32 (temperature 1e300, top_p 1e-300) or that overflows int64
(top_k 2**64) is refused here, before it can fail inside a batched step that other requests share.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import struct
from dataclasses import dataclass

SEED_MASK = (1 << 62) - 1  # row seeds stay positive int64 after mixing
INT64_MAX = (1 << 63) - 1
# Below this, logits / temperature can overflow float32 (logits of 1e4 / 1e-35 = inf, then inf - inf = NaN); at it,
# sampling is already greedy for every practical purpose.
MIN_TEMPERATURE = 1e-5
# Stop strings: at most this many a request, each at most this many characters (the engine reads a window of the
# output's tail about this long behind each call's tokens to find them)
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 128
# An output's text is decoded after this many of its prompt's last tokens (vLLM reads 4 or 5): a SentencePiece
# decoder drops the space before the first word of what it decodes ("\u2581Hello" alone reads "Hello")
TEXT_CONTEXT_TOKENS = 4
REPLACEMENT_CHAR = "\ufffd"  # what a byte-level decoder shows for a cut multi-byte character
MAX_N = 64  # sequences a request may ask for
MAX_REPETITION_PENALTY = 100.0  # (past it every seen token is as good as banned: a typo)
MAX_LOGIT_BIAS = 300  # token ids a request may bias (OpenAI's bound)
MAX_BAD_WORDS = 100  # strings (or token sequences) a request may ban
MAX_CHOICES = 64  # guided_choice's strings
MAX_CHOICE_TOKENS = 256  # tokens in one choice
MAX_BAD_WORD_TOKENS = 64  # tokens in one banned sequence
GRAMMAR_GUIDES = ("guided_json", "guided_regex", "guided_grammar")  # the guides a grammar engine compiles
MAX_GRAMMAR_CHARS = 64 * 1024  # guided_json's schema (as JSON), guided_regex, guided_grammar: compiling grows with it
MAX_LOGPROBS = 20  # most likely tokens a request may ask for beside each emitted one (OpenAI's top_logprobs bound)


def as_float32(x: float) -> float:
    """``x`` rounded to float32 as the engine's tensors hold it (inf past float32's range, 0 below its tiniest)."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:  # struct refuses finite doubles past float32's range
        return float("inf") if x > 0 else float("-inf")


@dataclass
class SamplingParams:
    """How one request samples. ``temperature=0`` is greedy; the transform order is HF's (temperature, top-k, top-p,
    min-p). ``seed`` makes a request's samples reproducible whatever batch it runs in.

    ``invariant``: sample through the position-keyed Gumbel coupling (``spec_engine.coupling``), so the tokens do not
    depend on the drafter, the depth or the batch: with a seed, the same tokens with or without speculation. None (the
    default) means on for seeded requests and off for unseeded ones, which keep rejection sampling: it accepts more
    drafted tokens (1 - TV against at least (1 - TV) / (1 + TV)), and without a seed there is nothing to reproduce.

    ``n``: sequences sampled for the prompt (vLLM's ``n``; ``LLM.generate`` returns them as one output's
    ``outputs``), each its own request: sequence i's seed derives from ``seed`` (``sequence_params``), and the prompt's
    K/V is computed once and shared (prefix caching).

    ``stop``: strings that end the request (OpenAI's ``stop``): the token whose text completes one is its last token
    (finish reason "stop"), and its text ends before the string (``visible_text``). ``stop_token_ids`` (and EOS) end
    it at a token, which is kept in its token ids; its text is left out unless ``include_stop_str_in_output``
    (vLLM's).

    ``logprobs``: with each emitted token, the target's log-probabilities of it and of its ``logprobs`` most likely
    alternatives (0: the token's alone; None: none): the model's distribution, before temperature and the top-k /
    top-p / min-p transform (vLLM's default), from the target pass that verified the token. A request asking for them
    decodes one Python-driven step per call (no native multi-step chains), so it costs more than one that does not.
    ``prompt_logprobs``: the same for each prompt token after the first (vLLM's), from the prefill's passes; such a
    request computes its whole prompt (no prefix cache).

    ``presence_penalty``, ``frequency_penalty`` (in [-2, 2], 0: off; the output's tokens) and ``repetition_penalty``
    (> 0, 1: off; the prompt's and the output's): vLLM's penalties; ``logit_bias`` {token id: bias in [-100, 100]}
    (OpenAI's, at most ``MAX_LOGIT_BIAS`` entries); ``min_tokens``: the stop tokens held back until that many output
    tokens, and no stop string read before (one that ends at an earlier token counts for nothing; vLLM's);
    ``allowed_token_ids``: the only tokens it may emit (vLLM's). All on the logits before temperature
    (``spec_engine.logits_processors``); such a request decodes one Python-driven step per call, as ``logprobs``
    does. ``include_stop_str_in_output``: the text ends after the stop string found, not before it.

    ``bad_words``: strings the output must not contain (vLLM's): each one's tokens, with and without a leading space,
    as ``bad_words_token_ids`` (``LLM.generate`` and the server fill that in with the tokenizer; the engine takes
    token sequences only); a sequence's last token is banned where the output so far ends with the rest of it (a
    one-token sequence: always), each drafted node under its own path.

    ``guided_choice``: the output is one of these strings (vLLM's), as ``guided_choice_token_ids`` (each string's
    tokens; ``LLM.generate`` and the server fill that in): each node may emit only a token that continues one of them
    from its context, and a stop token (EOS, ``stop_token_ids``) once its context is one whole; so the request needs a
    stop token, and takes no ``ignore_eos``, ``min_tokens``, ``allowed_token_ids`` or ``bad_words`` beside it (nor do
    ``bad_words`` and ``allowed_token_ids`` go together: each could leave a node no token).

    ``guided_json`` (a JSON schema: a dict, or its JSON text; ``{"type": "object"}`` is any JSON object; an object
    that names its ``properties`` takes no other keys unless it says ``"additionalProperties"``, as vLLM's default
    backend reads schemas: ``structured.closed_objects``),
    ``guided_regex`` (a regular expression the whole output matches) and ``guided_grammar`` (a GBNF grammar, as
    llama.cpp writes them, or a Lark one in llguidance's dialect): the output is a sentence of that language
    (vLLM's), through llguidance
    (``spec_engine.structured``; the ``structured`` extra): each node may emit only a token that keeps its context a
    prefix of one, and a stop token once its context is one whole; so, as with ``guided_choice``, the request needs a
    stop token and takes none of the four fields above beside it, and one guide at most. A request that reaches
    ``max_tokens`` or a stop string first ends with the sentence unfinished. ``disable_any_whitespace``
    (vLLM's): ``guided_json`` writes no whitespace between its tokens (by default any amount is allowed there, and a
    weak model may spend its tokens on it).

    ``skip_special_tokens``: the output text leaves special tokens (end of turn, BOS...) out (True, as vLLM's and HF's
    default) or shows them. ``truncate_prompt_tokens``: only the prompt's last that many tokens are used (vLLM's;
    the request's ``prompt_token_ids`` are those).
    """

    max_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    invariant: bool | None = None
    stop: list[str] | None = None
    n: int = 1
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0
    allowed_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = None
    guided_choice: list[str] | None = None
    guided_choice_token_ids: list[list[int]] | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self):
        if isinstance(self.stop, str):  # one stop string, as vLLM and OpenAI take it
            self.stop = [self.stop]
        if isinstance(self.top_k, int) and not isinstance(self.top_k, bool) and self.top_k == -1:  # vLLM's "all tokens"
            self.top_k = 0
        self.validate()

    def validate(self) -> None:
        def _num(name, value, kind):
            if isinstance(value, bool) or not isinstance(value, kind):
                raise ValueError(f"SamplingParams.{name} must be {kind if isinstance(kind, type) else 'a number'}")

        _num("max_tokens", self.max_tokens, int)
        _num("n", self.n, int)
        if not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be in [1, {MAX_N}], got {self.n}")
        _num("temperature", self.temperature, (int, float))
        _num("top_k", self.top_k, int)
        _num("top_p", self.top_p, (int, float))
        _num("min_p", self.min_p, (int, float))
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not self.temperature >= 0:  # also rejects NaN
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        temperature = as_float32(self.temperature)
        if temperature == float("inf"):
            raise ValueError(f"temperature must be finite in float32 (< 3.4e38), got {self.temperature}")
        if self.temperature != 0 and not temperature >= as_float32(MIN_TEMPERATURE):
            raise ValueError(f"temperature must be 0 (greedy) or >= {MIN_TEMPERATURE}, got {self.temperature}")
        if not 0 <= self.top_k <= INT64_MAX:
            raise ValueError(f"top_k must be in [0, 2**63) (0 or -1 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not as_float32(self.top_p) > 0:
            raise ValueError(f"top_p must be > 0 in float32 (>= 1.4e-45), got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        if self.seed is not None and not -(1 << 63) <= self.seed < 1 << 64:  # what torch.Generator.manual_seed takes
            raise ValueError(f"seed must fit in 64 bits, got {self.seed}")
        if self.stop is not None and (
            not isinstance(self.stop, list)
            or len(self.stop) > MAX_STOP_STRINGS
            or not all(isinstance(t, str) and 0 < len(t) <= MAX_STOP_CHARS for t in self.stop)
        ):
            raise ValueError(
                f"stop must be a list of at most {MAX_STOP_STRINGS} non-empty strings of at most {MAX_STOP_CHARS} "
                "characters"
            )
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None:
                _num(name, k, int)
                if not 0 <= k <= MAX_LOGPROBS:
                    raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}] or None, got {k}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            _num(name, v, (int, float))
            if not -2 <= v <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {v}")
        _num("repetition_penalty", self.repetition_penalty, (int, float))
        r = self.repetition_penalty
        if not 0 < r <= MAX_REPETITION_PENALTY:
            raise ValueError(f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY}], got {r}")
        if not as_float32(self.repetition_penalty) > 0:
            raise ValueError(f"repetition_penalty must be > 0 in float32, got {self.repetition_penalty}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or len(self.logit_bias) > MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias must be a dict of at most {MAX_LOGIT_BIAS} token ids to biases")
            for t, v in self.logit_bias.items():
                if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                    raise ValueError(f"logit_bias keys must be token ids (ints >= 0), got {t!r}")
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not -100 <= v <= 100:
                    raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {v!r}")
        if self.allowed_token_ids is not None and (
            not isinstance(self.allowed_token_ids, list)
            or not self.allowed_token_ids
            or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.allowed_token_ids)
        ):
            raise ValueError("allowed_token_ids must be a non-empty list of token ids (ints >= 0)")
        if not isinstance(self.include_stop_str_in_output, bool):
            raise ValueError("include_stop_str_in_output must be True or False")
        if self.bad_words is not None and not _strings(self.bad_words, 0, MAX_BAD_WORDS, MAX_STOP_CHARS, blank=False):
            raise ValueError(f"bad_words must be a list of at most {MAX_BAD_WORDS} non-blank strings of at most "
                             f"{MAX_STOP_CHARS} characters")  # fmt: skip
        if self.bad_words_token_ids is not None and not _token_lists(
            self.bad_words_token_ids, 0, 2 * MAX_BAD_WORDS, MAX_BAD_WORD_TOKENS
        ):
            raise ValueError(f"bad_words_token_ids must be a list of at most {2 * MAX_BAD_WORDS} non-empty lists of "
                             f"at most {MAX_BAD_WORD_TOKENS} token ids (ints >= 0)")  # fmt: skip
        if self.guided_choice is not None and not _strings(self.guided_choice, 1, MAX_CHOICES, 4 * MAX_CHOICE_TOKENS):
            raise ValueError(f"guided_choice must be a list of 1 to {MAX_CHOICES} non-empty strings of at most "
                             f"{4 * MAX_CHOICE_TOKENS} characters")  # fmt: skip
        if self.guided_choice_token_ids is not None and not _token_lists(
            self.guided_choice_token_ids, 1, MAX_CHOICES, MAX_CHOICE_TOKENS
        ):
            raise ValueError(f"guided_choice_token_ids must be a list of 1 to {MAX_CHOICES} non-empty lists of at "
                             f"most {MAX_CHOICE_TOKENS} token ids (ints >= 0)")  # fmt: skip
        if (self.bad_words or self.bad_words_token_ids) and self.allowed_token_ids:
            raise ValueError("bad_words with allowed_token_ids is not supported: together they may leave no token")
        self._check_guides()
        if not isinstance(self.skip_special_tokens, bool):
            raise ValueError("skip_special_tokens must be True or False")
        if self.truncate_prompt_tokens is not None:
            _num("truncate_prompt_tokens", self.truncate_prompt_tokens, int)
            if self.truncate_prompt_tokens < 1:
                raise ValueError(f"truncate_prompt_tokens must be >= 1, got {self.truncate_prompt_tokens}")
        _num("min_tokens", self.min_tokens, int)
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens ({self.max_tokens})], got {self.min_tokens}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        if self.invariant is not None and not isinstance(self.invariant, bool):
            raise ValueError(f"invariant must be True, False or None, got {self.invariant!r}")
        if self.stop_token_ids is not None:
            if not isinstance(self.stop_token_ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids
            ):
                raise ValueError("stop_token_ids must be a list of token ids (ints >= 0)")

    def _check_guides(self) -> None:
        """``guided_choice``, ``guided_json``, ``guided_regex``, ``guided_grammar``: one at most, well formed, and none
        of the fields that could keep it from ending at a stop token."""
        if self.guided_json is not None:
            schema = self.guided_json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError as e:
                    raise ValueError(f"guided_json is not JSON: {e}") from None
                except RecursionError:  # (nesting past Python's stack)
                    raise ValueError("guided_json is not JSON Python can read: nested too deep") from None
            try:
                size = len(json.dumps(schema))
            except (TypeError, ValueError, RecursionError):  # (a set, a circular dict, nesting too deep: not JSON)
                size = None
            if not isinstance(schema, dict) or size is None or size > MAX_GRAMMAR_CHARS:
                raise ValueError(f"guided_json must be a JSON schema (an object) of at most "
                                 f"{MAX_GRAMMAR_CHARS} characters as JSON")  # fmt: skip
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError("disable_any_whitespace must be True or False")
        for name in ("guided_regex", "guided_grammar"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value.strip() and len(value) <= MAX_GRAMMAR_CHARS):
                raise ValueError(f"{name} must be a non-blank string of at most {MAX_GRAMMAR_CHARS} characters")
        guides = ["guided_choice"] if self.guided_choice is not None or self.guided_choice_token_ids else []
        guides += [name for name in GRAMMAR_GUIDES if getattr(self, name) is not None]
        if len(guides) > 1:
            raise ValueError(f"{guides[0]} with {guides[1]}: give one guide")
        if guides:
            for name in ("ignore_eos", "min_tokens", "allowed_token_ids", "bad_words", "bad_words_token_ids"):
                if getattr(self, name):
                    raise ValueError(f"{guides[0]} with {name} is not supported: the output ends at a stop token")

    @property
    def processes_logits(self) -> bool:
        """Whether a logits processor changes the target's logits (``spec_engine.logits_processors``)."""
        return bool(self.min_tokens) or self.processes_logits_past_min_tokens

    @property
    def processes_logits_past_min_tokens(self) -> bool:
        """Whether one does once ``min_tokens`` are out (``min_tokens`` then holds nothing back:
        ``Request.processes_logits``)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1 or self.logit_bias
                    or self.allowed_token_ids or self.bad_words_token_ids or self.guided_choice_token_ids
                    or self.guided is not None)  # fmt: skip

    @property
    def guided(self) -> tuple[str, object] | None:
        """The structured-output field set, as (name, value): ``guided_json``, ``guided_regex`` or ``guided_grammar``
        (``guided_choice`` is the engine's own, by token ids); None where there is none."""
        return next(((name, getattr(self, name)) for name in GRAMMAR_GUIDES if getattr(self, name) is not None), None)

    @property
    def filtered(self) -> bool:
        """Whether top-k, top-p or min-p cut the distribution."""
        return bool(self.top_k or self.top_p < 1 or self.min_p)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def coupled(self) -> bool:
        """Sampled through the position-keyed coupling (see ``invariant``); greedy rows need no noise."""
        return not self.greedy and (self.invariant if self.invariant is not None else self.seed is not None)


def _strings(value, least: int, most: int, max_chars: int, blank: bool = True) -> bool:
    """Whether ``value`` is a list of ``least`` to ``most`` non-empty strings of at most ``max_chars`` characters (not
    all whitespace, unless ``blank``)."""
    return (
        isinstance(value, list)
        and least <= len(value) <= most
        and all(isinstance(v, str) and v and (blank or v.strip()) and len(v) <= max_chars for v in value)
    )


def _token_lists(value, least: int, most: int, max_tokens: int) -> bool:
    """Whether ``value`` is a list of ``least`` to ``most`` non-empty lists of at most ``max_tokens`` token ids."""
    return (
        isinstance(value, list)
        and least <= len(value) <= most
        and all(
            isinstance(seq, list) and 0 < len(seq) <= max_tokens
            and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in seq)
            for seq in value
        )
    )  # fmt: skip


def with_token_ids(params: SamplingParams, encode) -> SamplingParams:
    """``params`` with the token ids of its strings filled in (``encode``: text -> token ids, no special tokens):
    ``bad_words_token_ids`` (each word's tokens as written, and after one leading space where that is another token
    sequence: vLLM's, a word at the start of the text and inside it; no duplicates) and ``guided_choice_token_ids``
    (each choice's tokens); ``params`` itself when there is nothing to fill in."""
    fill = {}
    if params.bad_words and params.bad_words_token_ids is None:
        seqs: list[list[int]] = []
        for word in params.bad_words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = list(encode(text))
                if len(ids) > MAX_BAD_WORD_TOKENS:
                    raise ValueError(f"bad_words must be at most {MAX_BAD_WORD_TOKENS} tokens each; {word!r} is "
                                     f"{len(ids)}")  # fmt: skip
                if ids and ids not in seqs:
                    seqs.append(ids)
        fill["bad_words_token_ids"] = seqs
    if params.guided_choice and params.guided_choice_token_ids is None:
        choices = [list(encode(c)) for c in params.guided_choice]
        if any(not 0 < len(ids) <= MAX_CHOICE_TOKENS for ids in choices):
            raise ValueError(f"guided_choice must be 1 to {MAX_CHOICE_TOKENS} tokens each")
        fill["guided_choice_token_ids"] = choices
    return dataclasses.replace(params, **fill) if fill else params


def truncate_prompt(prompt_token_ids: list[int], k: int | None) -> list[int]:
    """The prompt tokens a request uses: the last ``k`` (``SamplingParams.truncate_prompt_tokens``), or all."""
    return list(prompt_token_ids if k is None else prompt_token_ids[-k:])


def sequence_params(params: SamplingParams, i: int) -> SamplingParams:
    """The parameters of sequence ``i`` of ``params.n``: one sequence, the same seed for the first (its tokens are
    those of the same request with n = 1) and a seed derived from it for each other (seeded requests stay
    reproducible, their sequences distinct)."""
    seed = params.seed
    if seed is not None and i > 0:
        seed = int.from_bytes(hashlib.sha256(f"{seed}:{i}".encode()).digest()[:8], "little") & SEED_MASK
    return dataclasses.replace(params, n=1, seed=seed)


def output_text(detokenize, prompt: list[int], ids: list[int], skip: bool) -> str:
    """The text of ``ids``, a request's output tokens from its first, as they read after its ``prompt`` (vLLM's
    incremental detokenizer): the text of the prompt's last ``TEXT_CONTEXT_TOKENS`` and the output, less the text of
    those tokens alone. Decoded alone, a SentencePiece output "\u2581Hello" reads "Hello", not " Hello". The output is
    read alone after no prompt or one that ends in a cut character (which the output may complete), and where it
    changes the text before it; so a byte-level decoder's text is the output's own. ``detokenize``: (token ids, skip
    special tokens) -> text, the tokenizer's."""
    context = list(prompt[-TEXT_CONTEXT_TOKENS:])
    if not context:
        return detokenize(ids, skip)
    before = detokenize(context, skip)
    if before.endswith(REPLACEMENT_CHAR):
        return detokenize(ids, skip)
    whole = detokenize(context + list(ids), skip)
    return whole[len(before) :] if whole.startswith(before) else detokenize(ids, skip)


def stop_string_end(params: SamplingParams, output: list[int], toks: list[int], detokenize,
                    prompt: list[int] = ()) -> int | None:  # fmt: skip
    """How many of ``toks`` (a call's new tokens after ``output``, the request's tokens so far) it takes to complete
    one of ``params.stop``, or None (``detokenize``: (token ids, skip special tokens) -> text, the tokenizer's; the
    output's text is read after its ``prompt``: ``output_text``). A stop string completed before this call would have
    ended the request then, so only the output's tail is read: as many tokens as give at least the longest string's
    length in text (a token of a cut character or a special one gives less than a character), while that tail is past
    the first ``min_tokens`` - 1 tokens."""
    stop, skip = params.stop, params.skip_special_tokens
    minimum = params.min_tokens
    if not stop or not toks or len(output) + len(toks) < minimum:
        return None
    longest = max(map(len, stop))
    window, stepped_back = longest + 4, 0
    while window < len(output):
        tail_text = detokenize(output[-window:], skip)
        if len(tail_text) <= longest:
            window *= 2
        elif tail_text.startswith(REPLACEMENT_CHAR) and stepped_back < 3:
            # a tail that starts inside a character: a ByteFallback decoder reads the whole run of "<0xNN>" tokens
            # it starts as U+FFFD, a stop string completed in that run included; up to 3 tokens earlier it starts at
            # the character's first byte (a byte-level decoder's U+FFFD is the cut bytes' alone: no loss there)
            window, stepped_back = window + 1, stepped_back + 1
        else:
            break
    if minimum > 1 and len(output) - window < minimum - 1:
        # the tail reaches into the first min_tokens - 1 tokens' text, where a string completed before the minimum
        # counts for nothing, then or later: read the whole output, that text excluded (a bounded stretch of the
        # request: past it the tail alone is read)
        whole = list(output) + list(toks)
        start = stop_search_start(params, whole, detokenize, prompt)

        def counts(n: int) -> bool:
            if len(output) + n < minimum:
                return False
            text = output_text(detokenize, prompt, whole[: len(output) + n], skip)
            return any(_find_stop(text, s, start) >= 0 for s in stop)

        return next((n for n in range(1, len(toks) + 1) if counts(n)), None)
    tail = output[-window:]
    # read after the prompt where the tail is the whole output; a shorter tail's text is longer than any stop string,
    # so the first word's space it drops is in none that this call completes
    head = prompt if len(tail) == len(output) else ()

    def found(n: int) -> bool:
        text = output_text(detokenize, head, tail + toks[:n], skip)
        return any(s in text for s in stop)

    text = output_text(detokenize, head, tail + toks, skip)
    # (the common case: the tail read twice a call). Where the text shows U+FFFD each prefix is read: a ByteFallback
    # decoder (SentencePiece's "<0xNN>" tokens) reads a run of bytes that is not UTF-8 as U+FFFD a byte, so the bytes
    # of a character that a shorter prefix completed, followed by a cut one, read as U+FFFD
    if not any(s in text for s in stop) and REPLACEMENT_CHAR not in text:
        return None
    return next((n for n in range(1, len(toks) + 1) if found(n)), None)


def stop_search_start(params: SamplingParams, output: list[int], detokenize, prompt: list[int] = ()) -> int:
    """Where a stop string may end in the text of ``output`` (a request's output tokens, read after its ``prompt``:
    ``output_text``) at the earliest: past the text of its first ``min_tokens`` - 1 tokens (vLLM reads no stop string
    before the minimum); 0 without one."""
    if not params.stop or params.min_tokens <= 1:
        return 0
    return len(output_text(detokenize, prompt, list(output[: params.min_tokens - 1]), params.skip_special_tokens))


def _find_stop(text: str, stop: str, start: int) -> int:
    """Where ``stop`` first starts in ``text`` among the places where it ends past ``start`` (-1: nowhere)."""
    return text.find(stop, max(0, start - len(stop) + 1))


def visible_text(text: str, stop: list[str] | None, finished: bool, include_stop: bool = False, start: int = 0) -> str:
    """The part of a request's decoded output ``text`` its client sees: cut before the first stop string that ends
    past ``start`` (``stop_search_start``; which the output leaves out, as OpenAI's does; after it with
    ``include_stop``, vLLM's ``include_stop_str_in_output``); while the request runs, short of a tail that may be the
    start of one (a stream never sends text that a later token turns into a stop string)."""
    if not stop:
        return text
    found = [(i, -len(s)) for i, s in ((_find_stop(text, s, start), s) for s in stop) if i >= 0]
    if found:
        start, minus_len = min(found)  # the first to start (the longest of those that start there)
        return text[: start - minus_len if include_stop else start]
    if finished:
        return text
    held = max((n for s in stop for n in range(1, len(s)) if text.endswith(s[:n])), default=0)
    return text[: len(text) - held]
