"""Per-request sampling parameters (vLLM-style) and their validation."""

from __future__ import annotations

from dataclasses import dataclass

SEED_MASK = (1 << 62) - 1  # row seeds stay positive int64 after mixing


@dataclass
class SamplingParams:
    """How one request samples. ``temperature=0`` is greedy; the transform order is HF's (temperature, top-k, top-p,
    min-p). ``seed`` makes a request's samples reproducible whatever batch it runs in."""

    max_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        def _num(name, value, kind):
            if isinstance(value, bool) or not isinstance(value, kind):
                raise ValueError(f"SamplingParams.{name} must be {kind if isinstance(kind, type) else 'a number'}")

        _num("max_tokens", self.max_tokens, int)
        _num("temperature", self.temperature, (int, float))
        _num("top_k", self.top_k, int)
        _num("top_p", self.top_p, (int, float))
        _num("min_p", self.min_p, (int, float))
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not self.temperature >= 0:  # also rejects NaN
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        if self.stop_token_ids is not None:
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in self.stop_token_ids):
                raise ValueError("stop_token_ids must be a list of ints")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
