"""LLM: the offline entry point, shaped like vLLM's (generate, chat, plus stream)."""

from __future__ import annotations

import itertools
from dataclasses import replace
from typing import Iterator, Sequence

from tqdm import tqdm

from llmpipe.config import EngineConfig
from llmpipe.engine.engine import LLMEngine, PromptInput
from llmpipe.errors import InvalidRequestError, LLMPipeError
from llmpipe.lora.request import LoRARequest
from llmpipe.outputs import EmbeddingOutput, PoolingRequestOutput, RequestOutput, ScoringOutput
from llmpipe.pooling_params import PoolingParams
from llmpipe.sampling_params import SamplingParams
from llmpipe.tokenizer import Tokenizer

Messages = list[dict[str, str]]


class LLM:
    def __init__(self, model: str = "smollm2-135m-instruct", *, progress: bool = True, **engine_options):
        self.engine = LLMEngine(EngineConfig.from_kwargs(model=model, **engine_options), progress=progress)
        self._ids = itertools.count()
        self.last_output: RequestOutput | None = None  # the finished output of the latest stream()

    def close(self) -> None:
        """Stop tensor-parallel workers now (otherwise when the LLM is collected or Python exits)."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def get_tokenizer(self) -> Tokenizer | None:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion, all batched together; outputs come back in input order.
        `sampling_params`: one for every prompt, or a list with one per prompt (as vLLM's). A progress
        bar counts finished requests when there are several. `lora_request` (with enable_lora): the LoRA
        adapter every prompt runs under, or a list with one per prompt (None: the base model); each is
        loaded the first time it is named."""
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        elif len(params) != len(prompts):
            raise InvalidRequestError(f"{len(params)} sampling_params for {len(prompts)} prompts: give one, or one per prompt")
        loras = _per_prompt(lora_request, len(prompts))
        for lora in dict.fromkeys(lora for lora in loras if lora is not None):  # all loaded before any request is added
            self.engine.add_lora(lora)
        return self._run([self._add(prompt, p, lora) for prompt, p, lora in zip(prompts, params, loras)], use_tqdm)

    def embed(self, prompts: PromptInput | Sequence[PromptInput], pooling_params: PoolingParams | None = None,
              use_tqdm: bool = True, *, prompt_name: str | None = None) -> list[PoolingRequestOutput]:
        """Each prompt's embedding (`outputs.embedding`), batched together as generate's prompts are: a
        decoder's last-token hidden state, an encoder's pooled output; normalized unless asked not to.
        `prompt_name`: the model's prompt to put before each text (its default one otherwise, if any), as
        sentence-transformers' encode does."""
        params = replace(pooling_params or PoolingParams(), task="embed")
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = [self.engine.sentence_prompts.apply(p, prompt_name) if isinstance(p, str) else p for p in prompts]
        outputs = self._run([self._add(prompt, params) for prompt in prompts], use_tqdm)
        return [PoolingRequestOutput(o.request_id, o.prompt_token_ids, EmbeddingOutput(self._pooled(o))) for o in outputs]

    def score(self, queries: str | Sequence[str], documents: str | Sequence[str], *, instruction: str | None = None,
              use_tqdm: bool = True) -> list[PoolingRequestOutput]:
        """The relevance of each document to its query (`outputs.score`, in [0, 1]) by a reranker or
        cross-encoder: one query against every document, or queries and documents paired in order (vLLM's
        LLM.score). `instruction`: a decoder reranker's task description (its default otherwise)."""
        queries = [queries] if isinstance(queries, str) else list(queries)
        documents = [documents] if isinstance(documents, str) else list(documents)
        if len(queries) == 1:
            queries = queries * len(documents)
        if len(queries) != len(documents):
            raise InvalidRequestError(f"{len(queries)} queries for {len(documents)} documents: give one, or one per document")
        params = PoolingParams(task="score")
        prompts = [self.engine.score_prompts.prompt(q, d, instruction) for q, d in zip(queries, documents)]
        outputs = self._run([self._add(prompt, params) for prompt in prompts], use_tqdm)
        return [PoolingRequestOutput(o.request_id, o.prompt_token_ids, ScoringOutput(self._pooled(o)[0])) for o in outputs]

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        """Step until every request of `ids` finished; their outputs in that order. A progress bar counts
        finished requests when there are several."""
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="Processed prompts", unit="req", disable=not use_tqdm or len(ids) < 2) as bar:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        bar.update(1)
        return [finished[i] for i in ids]

    @staticmethod
    def _pooled(output: RequestOutput) -> list[float]:
        if output.pooled is None:
            raise LLMPipeError(f"request {output.request_id} failed: {output.outputs[0].error}")
        return output.pooled

    def chat(
        self,
        messages: Messages | list[Messages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
        *,
        tools: list[dict] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation and generate the assistant's reply.
        `tools`: OpenAI's function tools ({"type": "function", "function": {...}}) for the template;
        `lora_request`: as generate's."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.chat_prompt(c, add_generation_prompt, tools=tools) for c in conversations]
        return self.generate(prompts, sampling_params, lora_request=lora_request)

    def chat_prompt(
        self,
        messages: Messages,
        add_generation_prompt: bool = True,
        *,
        add_special_tokens: bool = False,
        template_kwargs: dict | None = None,
        tools: list[dict] | None = None,
    ) -> dict:
        """The conversation as a prompt; `template_kwargs` are extra variables for the chat template."""
        tokenizer = self._require_tokenizer()
        kwargs = dict(template_kwargs or {})
        if tools is not None:
            kwargs["tools"] = tools
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **kwargs)
        # The template writes BOS itself where the model wants one; don't add another by default.
        return {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=add_special_tokens)}

    def stream(self, prompt: PromptInput, sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Yield the text of the first sample as it decodes, in UTF-8-safe deltas."""
        request_id = self._add(prompt, sampling_params or SamplingParams())
        self.last_output = None
        sent = 0
        try:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if output.request_id != request_id:
                        continue
                    self.last_output = output
                    text = output.outputs[0].text
                    if len(text) > sent:
                        yield text[sent:]
                        sent = len(text)
                    if output.finished:
                        return
        finally:
            self.engine.abort_request(request_id)

    def _add(self, prompt: PromptInput, params: SamplingParams | PoolingParams, lora_request: LoRARequest | None = None) -> str:
        request_id = str(next(self._ids))
        self.engine.add_request(request_id, prompt, params, lora_request)
        return request_id

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter now (generate loads one on first use); True if it was not loaded yet."""
        return self.engine.add_lora(lora_request)

    def remove_lora(self, lora: str | LoRARequest) -> bool:
        """Unload an adapter, freeing its slot (refused while requests in flight use it)."""
        return self.engine.remove_lora(lora)

    def list_loras(self) -> dict[str, str]:
        """The adapters loaded: name → path."""
        return self.engine.list_loras()

    def _require_tokenizer(self) -> Tokenizer:
        if self.engine.tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer")
        return self.engine.tokenizer


def _per_prompt(lora_request: LoRARequest | Sequence[LoRARequest | None] | None, n: int) -> list[LoRARequest | None]:
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * n
    loras = list(lora_request)
    if len(loras) != n:
        raise InvalidRequestError(f"{len(loras)} lora_requests for {n} prompts: give one, or one per prompt",
                                  param="lora_request")
    return loras
