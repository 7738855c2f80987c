"""Admission: a prompt (text, token ids, or {"prompt_token_ids": …}) and its SamplingParams checked
against what the engine core takes, on the front end, before anything is sent to the core."""

from __future__ import annotations

from llmpipe.engine.core_messages import CoreInfo, EngineCoreRequest
from llmpipe.errors import InvalidRequestError
from llmpipe.pooling_params import PoolingParams
from llmpipe.sampling_params import SamplingParams
from llmpipe.structured_output import check_structured_outputs
from llmpipe.tokenizer import Tokenizer

PromptInput = str | list[int] | dict


class Admission:
    def __init__(self, tokenizer: Tokenizer | None, max_model_len: int, vocab_size: int, task: str = "generate",
                 embedding_size: int | None = None, generates: bool = True) -> None:
        """`task`: what the engine serves (EngineConfig.task, resolved); `embedding_size`: the width of its
        embeddings (None: it embeds nothing); `generates` False: an encoder, which pools only."""
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.task = task
        self.embedding_size = embedding_size
        self.generates = generates

    @classmethod
    def serving(cls, tokenizer: Tokenizer | None, info: CoreInfo) -> Admission:
        """The front end's admission for the engine core `info` describes."""
        return cls(tokenizer, info.max_model_len, info.vocab_size, info.task, info.embedding_size, info.generates)

    def request(self, request_id: str, prompt: PromptInput, params: SamplingParams | PoolingParams,
                lora_name: str | None = None) -> tuple[str | None, EngineCoreRequest]:
        """(text, the core's request) of an admissible generation (SamplingParams) or pooling request
        (PoolingParams: it ends with its prompt, which may then fill the whole context), under LoRA adapter
        `lora_name` (None: the base model). A prompt dict's "cache_salt" (vLLM's) keeps its prefix-cache
        blocks apart from other salts'."""
        pooling = params if isinstance(params, PoolingParams) else None
        sampling = SamplingParams() if pooling is not None else params
        self.check_task(pooling)
        if pooling is not None and lora_name is not None:
            raise InvalidRequestError("LoRA adapters serve generation only, not embeddings or scores", param="model")
        cache_salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt or "\x00" in cache_salt):
            raise InvalidRequestError("cache_salt must be a non-empty string without NUL characters", param="cache_salt")
        text, token_ids = self.prompt(prompt, sampling, generates=pooling is None)
        return text, EngineCoreRequest(request_id, token_ids, sampling, pooling, cache_salt, lora_name)

    def check_task(self, pooling: PoolingParams | None) -> None:
        """What the model serves: generation, embeddings of its width, scores where it reranks."""
        task = "generate" if pooling is None else pooling.task
        if task == "generate" and not self.generates:
            raise InvalidRequestError("this model does not generate text: it serves embeddings or scores", param="model")
        if task == "embed" and self.embedding_size is None:
            raise InvalidRequestError("this model scores (query, document) pairs; it does not embed single texts",
                                      param="model")
        if task == "score" and self.task != "score":
            raise InvalidRequestError("this model is not a reranker: scores are served by rerankers and cross-encoders "
                                      "(start a decoder reranker with --task score)", param="model")
        if pooling is not None and pooling.dimensions is not None and pooling.dimensions > (self.embedding_size or 0):
            raise InvalidRequestError(f"dimensions must be at most the model's {self.embedding_size}, got "
                                      f"{pooling.dimensions}", param="dimensions")

    def prompt(self, prompt: PromptInput, params: SamplingParams, generates: bool = True) -> tuple[str | None, list[int]]:
        """(text, token ids) of an admissible request; InvalidRequestError naming the field if not.
        `generates` False: a pooling request, whose prompt may fill the whole context."""
        text, token_ids, from_ids = self._tokenize(prompt)
        self._check_length(token_ids, generates)
        if from_ids:
            self._check_ids(token_ids)
        if params.stop_list and self.tokenizer is None:
            raise InvalidRequestError("stop strings need a tokenizer; this model has none", param="stop")
        if params.structured_outputs is not None and self.tokenizer is None:
            raise InvalidRequestError("structured outputs need a tokenizer; this model has none", param="structured_outputs")
        params.structured_outputs = check_structured_outputs(params.structured_outputs)  # GBNF: as Lark
        _check_min_tokens(params)
        params.check_token_ids(self.vocab_size)
        return text, token_ids

    def check(self, token_ids: list[int], params: SamplingParams, generates: bool = True) -> None:
        """What the engine core itself takes (no text): the length and every token id."""
        self._check_length(token_ids, generates)
        self._check_ids(token_ids)
        params.check_token_ids(self.vocab_size)

    def _check_length(self, token_ids: list[int], generates: bool = True) -> None:
        limit = self.max_model_len
        if not token_ids:
            raise InvalidRequestError("prompt is empty", param="prompt")
        if not generates and len(token_ids) > limit:
            raise InvalidRequestError(f"input has {len(token_ids)} tokens, over the context limit (max_model_len={limit})",
                                      param="input", code="context_length_exceeded")
        if generates and len(token_ids) >= limit:
            raise InvalidRequestError(
                f"prompt has {len(token_ids)} tokens, over the context limit: at most {limit - 1} "
                f"leave room for one generated token (max_model_len={limit})",
                param="prompt",
                code="context_length_exceeded",
            )

    def _tokenize(self, prompt: PromptInput) -> tuple[str | None, list[int], bool]:
        """(text, token ids, whether the ids came from the caller and still need checking)."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"]), True
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("this model has no tokenizer: pass prompt_token_ids")
            return prompt, self.tokenizer.encode(prompt), False
        return None, list(prompt), True

    def _check_ids(self, ids: list[int]) -> None:
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"prompt_token_ids must be integers in [0, {self.vocab_size}), got {bad[0]!r}", param="prompt"
            )


def _check_min_tokens(params: SamplingParams) -> None:
    """min_tokens that no output of a choice can reach (every token spells at least one byte) is
    refused; where the constraint's longest output is not known here, the grammar's end outranks
    min_tokens (the output ends there, stop_reason "grammar_end")."""
    spec = params.structured_outputs
    if spec is None or spec.choice is None or not params.min_tokens:
        return
    longest = max(len(choice.encode("utf-8")) for choice in spec.choice)
    if params.min_tokens > longest:
        raise InvalidRequestError(
            f"min_tokens ({params.min_tokens}) is more than the longest choice can take ({longest} bytes, "
            f"at most {longest} tokens)", param="min_tokens",
        )
