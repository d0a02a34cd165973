"""Structured outputs: ``guided_json`` (a JSON schema), ``guided_regex`` and ``guided_grammar`` (Lark), vLLM's, through
llguidance (the grammar engine vLLM and llama.cpp use; the ``structured`` extra). ``Grammars`` compiles a request's
grammar against the model's tokenizer (once per grammar, then copied); each request keeps its own ``GrammarState``,
which follows the output and masks each tree node's logits under its own path (``logits_processors``): a node may
emit only the tokens that keep the output a prefix of the grammar's language, and a stop token (EOS,
``stop_token_ids``) only where the output is one whole sentence of it. Verification judges every node by that
masked distribution, so speculation stays lossless; the drafters propose as they would.
"""

from __future__ import annotations

import json
from collections import OrderedDict

import numpy as np

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
    if name == "guided_json":
        schema = json.loads(value) if isinstance(value, str) else value  # (SamplingParams checked that it parses)
        try:
            return llg.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": whitespace_flexible})
        except Exception as e:  # llguidance raises its own errors on schemas it cannot compile
            raise ValueError(f"guided_json is not a JSON schema llguidance compiles: {e}") from None
    if name == "guided_regex":
        return llg.LLMatcher.grammar_from_regex(value)
    return llg.LLMatcher.grammar_from_lark(value)


class Grammars:
    """One model's grammar compiler: llguidance's view of ``tokenizer`` (a ``tokenizers.Tokenizer``; built at the
    first structured request, ~0.3 s for 49K tokens) and the grammars compiled so far (an LRU of fresh matchers)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int] | None = None):
        self._tokenizer, self.vocab_size, self._eos = tokenizer, vocab_size, list(eos_token_ids or [])
        self._ll_tokenizer = None
        self._compiled: OrderedDict[str, object] = OrderedDict()  # grammar text -> a matcher that consumed nothing

    def _ll(self):
        if self._ll_tokenizer is None:
            llg = _llguidance()
            n = max(self.vocab_size, self._tokenizer.get_vocab_size(with_added_tokens=True))
            self._ll_tokenizer = llg.LLTokenizer(self._tokenizer.to_str(), n_vocab=n, eos_token=self._eos or None)
        return self._ll_tokenizer

    def _fresh(self, params):
        name, value = params.guided
        text = grammar_text(name, value, whitespace_flexible=not params.disable_any_whitespace)
        matcher = self._compiled.get(text)
        if matcher is None:
            llg = _llguidance()
            matcher = llg.LLMatcher(self._ll(), text, log_level=0)
            if matcher.is_error():
                raise ValueError(f"{name} does not compile: {matcher.get_error()}")
            self._compiled[text] = matcher
            if len(self._compiled) > GRAMMAR_CACHE_SIZE:
                self._compiled.popitem(last=False)
        self._compiled.move_to_end(text)
        return matcher

    def check(self, params) -> None:
        """Raise ValueError (naming the field) where the request's grammar does not compile."""
        self._fresh(params)

    def state(self, params) -> GrammarState:
        """A new request's state: its own copy of the compiled grammar, at the output's start."""
        ll = self._ll()
        special = [t for t in ll.eos_tokens if ll.is_special_token(t)]  # llguidance's "accepting" token(s)
        return GrammarState(self._fresh(params).deep_copy(), special)


class GrammarState:
    """One request's grammar: the matcher follows the committed output (caught up at each step, before masking)."""

    def __init__(self, matcher, eos_tokens: list[int]):
        self.matcher, self._eos = matcher, eos_tokens
        self.num_consumed = 0  # output tokens the matcher has consumed

    def masks(self, output: list[int], paths: list[list[int]], stops: list[int], vocab_size: int):
        """Per node whose context (``output``, then its drafted ``paths[t]``) the grammar still accepts: the tokens it
        may emit, as (nodes [N], allowed [N, V] bool). A node off the grammar is left out: its own token was masked
        at its parent, so verification never reaches it. ``stops`` (the row's stop tokens in the vocabulary) are
        allowed where the context is a whole sentence, and nowhere else. ValueError where a node could emit
        nothing (the grammar needs a token that is one of the request's stop tokens)."""
        m = self.matcher
        if len(output) > self.num_consumed:
            if not m.consume_tokens(np.asarray(output[self.num_consumed :]).tolist()):
                raise ValueError(f"the output left its grammar: {m.get_error()}")
            self.num_consumed = len(output)
        nodes, rows = [], []
        for t, path in enumerate(paths):
            n = m.try_consume_tokens(path)
            if n != len(path):
                if n:
                    m.rollback(n)
                continue
            bits = np.unpackbits(np.frombuffer(m.compute_bitmask(), dtype=np.uint8), bitorder="little")[:vocab_size]
            allowed = np.zeros(vocab_size, dtype=bool)
            allowed[: len(bits)] = bits.astype(bool)
            allowed[[e for e in self._eos if e < vocab_size]] = False
            allowed[stops] = m.is_accepting()
            if path:
                m.rollback(len(path))
            if not allowed.any():
                raise ValueError("the grammar needs a token that is one of the request's stop tokens here")
            nodes.append(t)
            rows.append(allowed)
        return nodes, np.stack(rows) if rows else np.zeros((0, vocab_size), dtype=bool)
