"""SamplingParams: how to pick each next token and when to stop (vLLM's fields and meanings)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from llmpipe.errors import InvalidRequestError

_GREEDY_EPS = 1e-5
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for each logit_bias value


def _check(ok: bool, name: str, rule: str, value: object) -> None:
    if not ok:
        raise InvalidRequestError(f"{name} must be {rule}, got {value!r}", param=name)


@dataclass
class StructuredOutputsParams:
    """A constraint on the output's text (vLLM's `structured_outputs`): exactly one field is set."""

    json: dict[str, Any] | str | None = None  # a JSON schema (a dict, or its JSON text)
    regex: str | None = None
    choice: list[str] | None = None  # the output is exactly one of these strings
    grammar: str | None = None  # an EBNF / GBNF / Lark grammar
    json_object: bool = False  # any JSON object (OpenAI's response_format json_object)
    disable_any_whitespace: bool = False  # JSON: compact, no whitespace between tokens (vLLM's field)

    def __post_init__(self) -> None:
        kinds = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        kinds += ["json_object"] if self.json_object else []
        _check(len(kinds) == 1, "structured_outputs", "exactly one of json, regex, choice, grammar, json_object",
               kinds or None)
        _check(self.choice is None or (bool(self.choice) and all(isinstance(c, str) for c in self.choice)),
               "structured_outputs.choice", "a non-empty list of strings", self.choice)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k filter
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # top-N per prompt position (the prompt's own token always included)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None  # token id → added to its logit before sampling
    structured_outputs: StructuredOutputsParams | None = None
    stop_list: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.stop_list = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        _check(isinstance(self.n, int) and self.n >= 1, "n", "an integer >= 1", self.n)
        _check(self.temperature >= 0.0, "temperature", ">= 0", self.temperature)
        _check(0.0 < self.top_p <= 1.0, "top_p", "in (0, 1]", self.top_p)
        _check(isinstance(self.top_k, int) and self.top_k >= 0, "top_k", "-1, 0 (off) or a positive integer", self.top_k)
        _check(0.0 <= self.min_p <= 1.0, "min_p", "in [0, 1]", self.min_p)
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "in [-2, 2]", self.presence_penalty)
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "in [-2, 2]", self.frequency_penalty)
        _check(self.repetition_penalty > 0.0, "repetition_penalty", "> 0", self.repetition_penalty)
        _check(self.max_tokens is None or self.max_tokens >= 1, "max_tokens", ">= 1", self.max_tokens)
        _check(self.min_tokens >= 0, "min_tokens", ">= 0", self.min_tokens)
        _check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            "min_tokens",
            f"<= max_tokens ({self.max_tokens})",
            self.min_tokens,
        )
        _check(self.logprobs is None or self.logprobs >= 0, "logprobs", ">= 0", self.logprobs)
        _check(self.prompt_logprobs is None or self.prompt_logprobs >= 0, "prompt_logprobs", ">= 0",
               self.prompt_logprobs)
        _check(all(isinstance(s, str) and s for s in self.stop_list), "stop", "non-empty strings", self.stop)
        _check(all(isinstance(t, int) for t in self.stop_token_ids), "stop_token_ids", "integers", self.stop_token_ids)
        bias = self.logit_bias or {}
        _check(all(isinstance(t, int) for t in bias), "logit_bias", "keyed by token ids", self.logit_bias)
        _check(
            all(-MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS for v in bias.values()),
            "logit_bias",
            f"values in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]",
            self.logit_bias,
        )
        _check(
            self.seed is None or (isinstance(self.seed, int) and -(2**63) <= self.seed < 2**63),
            "seed",
            "an integer in [-2**63, 2**63)",
            self.seed,
        )

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def uses_filters(self) -> bool:
        """Whether top-k, top-p or min-p cut the distribution."""
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0

    def check_token_ids(self, vocab_size: int) -> None:
        """Every token id the request names (stop ids, logit_bias keys) is in the model's vocabulary,
        and it asks for no more logprobs per position than the vocabulary has."""
        for name in ("logprobs", "prompt_logprobs"):
            _check(getattr(self, name) is None or getattr(self, name) <= vocab_size, name,
                   f"<= the vocabulary size ({vocab_size})", getattr(self, name))
        for name, ids in (("stop_token_ids", self.stop_token_ids), ("logit_bias", list(self.logit_bias or ()))):
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise InvalidRequestError(f"{name} must be token ids in [0, {vocab_size}), got {bad[0]!r}", param=name)

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
