"""Structured outputs: ``guided_json`` (a JSON schema), ``guided_regex`` and ``guided_grammar`` (GBNF or Lark), vLLM's,
through llguidance (the structured-output engine behind vLLM's ``guidance`` backend; the ``structured`` extra).
``Grammars`` compiles a request's grammar against the model's tokenizer (once per grammar, then copied); each request
keeps its own ``GrammarState``, which follows the output and masks each tree node's logits under its own path
(``logits_processors``): a node may emit only the tokens that keep the output a prefix of the grammar's language, and
a stop token (EOS, ``stop_token_ids``) only where the output is one whole sentence of it. Verification judges every
node by that masked distribution, so speculation stays lossless; the drafters propose as they would.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict

import numpy as np

MAX_FORCED_DRAFT = 16  # forced tokens a row's view carries (a draft takes as many as its depth allows)
GRAMMAR_CACHE_SIZE = 64  # compiled grammars kept (a fresh matcher each, copied per request)
INSTALL_HINT = "structured outputs need llguidance: pip install 'specdec[structured]'"


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise ValueError(INSTALL_HINT) from None
    return llguidance


def grammar_text(name: str, value, *, whitespace_flexible: bool = True) -> str:
    """llguidance's grammar for one structured-output field (ValueError naming the field where it is malformed)."""
    llg = _llguidance()
    try:
        if name == "guided_json":
            schema = json.loads(value) if isinstance(value, str) else value  # (SamplingParams checked it parses)
            return llg.LLMatcher.grammar_from_json_schema(
                closed_objects(schema), defaults={"whitespace_flexible": whitespace_flexible}
            )
        if name == "guided_regex":
            return llg.LLMatcher.grammar_from_regex(value)
        return llg.grammar_from("grammar", value)  # GBNF (llama.cpp's, vLLM's examples) or Lark
    except Exception as e:  # llguidance raises its own errors on what it cannot read
        raise ValueError(f"{name} does not compile: {e}") from None


# keywords whose values are subschemas (a dict), lists of them, or maps of names to them; any other keyword's value
# (const, enum, default, examples) is data and never edited
_SUBSCHEMA = ("additionalProperties", "items", "not", "if", "then", "else", "contains", "propertyNames",
              "unevaluatedItems", "unevaluatedProperties", "additionalItems")  # fmt: skip
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems", "items")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def closed_objects(schema):
    """``schema`` (not edited) with ``"additionalProperties": false`` on each object schema that names its
    ``properties`` and says nothing of other keys, as vLLM's default structured-output backend (xgrammar's strict
    mode) and OpenAI's strict schemas treat them: a small model otherwise wanders into keys the schema never named
    (JSON Schema's own default allows them). A schema says ``"additionalProperties": true`` to keep them; objects
    without ``properties`` stay free. A schema with ``allOf`` or ``unevaluatedProperties`` anywhere is left as given:
    closing each branch of an ``allOf`` would refuse the other branches' keys."""
    text = json.dumps(schema)
    if '"allOf"' in text or '"unevaluatedProperties"' in text:
        return schema
    schema = json.loads(text)  # a copy to edit
    todo = [schema]
    while todo:  # (iterative: a deep schema must not reach Python's recursion limit here)
        node = todo.pop()
        if not isinstance(node, dict):
            continue
        says_others = "additionalProperties" in node or "patternProperties" in node
        if isinstance(node.get("properties"), dict) and not says_others:
            node["additionalProperties"] = False
        todo += [node[k] for k in _SUBSCHEMA if isinstance(node.get(k), dict)]
        todo += [s for k in _SUBSCHEMA_LISTS if isinstance(node.get(k), list) for s in node[k]]
        todo += [s for k in _SUBSCHEMA_MAPS if isinstance(node.get(k), dict) for s in node[k].values()]
    return schema


def _allowed(matcher, vocab_size: int, eos: list[int], stops: list[int]) -> np.ndarray:
    """[V] bool: the tokens ``matcher`` allows next, its EOS replaced by ``stops`` where the output is whole."""
    bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")[:vocab_size]
    allowed = np.zeros(vocab_size, dtype=bool)
    allowed[: len(bits)] = bits.astype(bool)
    allowed[[e for e in eos if e < vocab_size]] = False
    allowed[stops] = matcher.is_accepting()
    return allowed


def _first_line(error: str) -> str:
    """llguidance's error without the parser state it dumps after it."""
    return error.strip().splitlines()[0] if error.strip() else "unknown error"


class Grammars:
    """One model's grammar compiler: llguidance's view of ``tokenizer`` (a ``tokenizers.Tokenizer``; built once, ~0.3 s
    for 49K tokens: ``warm`` builds it ahead) and the grammars compiled so far (an LRU of fresh matchers). Safe to
    call from several threads: a grammar may compile off the engine's thread (``AsyncEngine``), a cache hit on it."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int] | None = None):
        self._tokenizer, self.vocab_size, self._eos = tokenizer, vocab_size, list(eos_token_ids or [])
        self._ll_tokenizer = None
        self._ll_error: str | None = None  # why llguidance cannot read this tokenizer (asked once)
        self._special_eos: list[int] = []  # llguidance's EOS tokens that are no text (its "whole" signal)
        self._compiled: OrderedDict[str, object] = OrderedDict()  # grammar text -> a matcher that consumed nothing
        self._lock = threading.Lock()

    def warm(self) -> None:
        """Build llguidance's tokenizer now (a server does, before its first request) where llguidance is installed."""
        try:
            self._ll()
        except ValueError:
            pass  # (said to the first request that asks for a guide)

    def _ll(self):
        with self._lock:
            if self._ll_tokenizer is None and self._ll_error is None:
                llg = _llguidance()
                n = max(self.vocab_size, self._tokenizer.get_vocab_size(with_added_tokens=True))
                try:
                    ll = llg.LLTokenizer(self._tokenizer.to_str(), n_vocab=n, eos_token=self._eos or None)
                except Exception as e:  # a tokenizer llguidance cannot read: the model's limit, not the request's
                    self._ll_error = (f"structured outputs are not available for this model: llguidance cannot read "
                                      f"its tokenizer ({e})")  # fmt: skip
                else:
                    self._special_eos = [t for t in ll.eos_tokens if ll.is_special_token(t)]
                    self._ll_tokenizer = ll
            if self._ll_error is not None:
                raise ValueError(self._ll_error)
            return self._ll_tokenizer

    def _fresh(self, params):
        name, value = params.guided
        text = grammar_text(name, value, whitespace_flexible=not params.disable_any_whitespace)
        with self._lock:
            matcher = self._compiled.get(text)
            if matcher is not None:
                self._compiled.move_to_end(text)
                return matcher
        matcher = _llguidance().LLMatcher(self._ll(), text, log_level=0)  # (compiled outside the lock)
        if matcher.is_error():
            raise ValueError(f"{name} does not compile: {_first_line(matcher.get_error())}")
        first = matcher.deep_copy()  # the first step's mask: an empty language, or a grammar past llguidance's
        allowed = _allowed(first, self.vocab_size, self._special_eos, [])  # limits, shows only here
        if first.is_error():
            raise ValueError(f"{name} does not compile: {_first_line(first.get_error())}")
        if not allowed.any() and not first.is_accepting():
            raise ValueError(f"{name} allows no output at all")
        with self._lock:
            self._compiled[text] = matcher
            if len(self._compiled) > GRAMMAR_CACHE_SIZE:
                self._compiled.popitem(last=False)
        return matcher

    def check(self, params) -> None:
        """Raise ValueError (naming the field) where the request's grammar does not compile or allows nothing."""
        self._fresh(params)

    def state(self, params) -> GrammarState:
        """A new request's state: its own copy of the compiled grammar, at the output's start."""
        fresh = self._fresh(params)
        return GrammarState(fresh.deep_copy(), self._special_eos)


class GrammarState:
    """One request's grammar: the matcher follows the committed output (caught up at each step, before masking)."""

    def __init__(self, matcher, eos_tokens: list[int]):
        self.matcher, self._eos = matcher, eos_tokens
        self.num_consumed = 0  # output tokens the matcher has consumed

    def _caught_up(self, output):
        """The matcher, after ``output`` (the request's committed output tokens, the root last)."""
        m = self.matcher
        if len(output) > self.num_consumed:
            if not m.consume_tokens(np.asarray(output[self.num_consumed :]).tolist()):
                raise ValueError(f"the output left its grammar: {_first_line(m.get_error())}")
            self.num_consumed = len(output)
        return m

    def forced(self, output, most: int) -> tuple[int, ...]:
        """The tokens the grammar forces after ``output`` (llguidance's fast-forward tokens: the only way on, a key
        of a schema's object, say), at most ``most``: a draft the masked target accepts but where another
        tokenization of the same text is allowed too. Empty where the grammar failed (the step's masks say why)."""
        try:
            m = self._caught_up(output)
        except ValueError:
            return ()
        return tuple(m.compute_ff_tokens()[:most]) if not m.is_error() else ()

    def masks(self, output, paths: list[list[int]], stops: list[int], vocab_size: int):
        """Per node that verification can reach (its context, ``output`` then its drafted ``paths[t]``, has every
        drafted token allowed at its parent and no stop token before its own): the tokens it may emit, as
        (nodes [N], allowed [N, V] bool). Other nodes are left out: verification never judges them. ``stops`` (the
        row's stop tokens in the vocabulary) are allowed where the context is a whole sentence, and nowhere else.
        ValueError where a reachable node could emit nothing (the grammar needs a token that is one of the request's
        stop tokens) or llguidance fails."""
        m = self._caught_up(output)
        rows: dict[tuple[int, ...], np.ndarray | None] = {}  # a path -> its node's row (None: unreachable)
        stop_set = set(stops)
        for path in sorted({tuple(p) for p in paths}, key=len):  # parents before children; padding is the root
            parent = rows.get(path[:-1]) if path else None
            if path and (parent is None or not parent[path[-1]] or path[-1] in stop_set):
                rows[path] = None
                continue
            if m.try_consume_tokens(list(path)) != len(path) or m.is_error():
                raise ValueError(f"llguidance refused a token its mask allowed: {_first_line(m.get_error())}")
            allowed = _allowed(m, vocab_size, self._eos, stops)
            if m.is_error():
                raise ValueError(f"the grammar failed: {_first_line(m.get_error())}")
            if path:
                m.rollback(len(path))
            if not allowed.any():
                raise ValueError("the grammar needs a token that is one of the request's stop tokens here")
            rows[path] = allowed
        nodes = [t for t, p in enumerate(paths) if rows[tuple(p)] is not None]
        allowed = np.stack([rows[tuple(paths[t])] for t in nodes]) if nodes else np.zeros((0, vocab_size), dtype=bool)
        return nodes, allowed
