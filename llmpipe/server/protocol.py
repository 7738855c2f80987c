"""Request bodies of the OpenAI-compatible routes: OpenAI's fields plus vLLM's extras.

Every field OpenAI or vLLM defines is declared, so none is silently dropped: each is either
supported or listed in the model's `REFUSED` table, which answers 400 to any value that asks for
something (see `check_supported`). Unknown fields are a 400 too, as on OpenAI. Types are strict
(`max_tokens: "5"` is an error, as on OpenAI), text must be valid Unicode, and lists have caps.
Pydantic checks types and the server's caps; the sampling limits (temperature >= 0, top_p in
(0, 1], ...) are SamplingParams' to check, so they live in one place.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, NamedTuple

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, WrapValidator, create_model
from pydantic_core import PydanticCustomError

from llmpipe.errors import InvalidRequestError
from llmpipe.sampling_params import SamplingParams

MAX_N = 16
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 64  # OpenAI allows 4 and vLLM sets no cap; each string is checked at every token
MAX_STOP_CHARS = 256
MAX_MESSAGES = 4096
MAX_LOGIT_BIAS = 1024  # entries


def _valid_text(text: str) -> str:
    """JSON may carry lone UTF-16 surrogates ("\\udfff"); no tokenizer can encode them."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise PydanticCustomError(
            "invalid_text", "must be valid Unicode text: character {at} is an unpaired surrogate", {"at": err.start}
        ) from None
    return text


def _one_of(description: str) -> WrapValidator:
    """A union's error in words, not one error per pydantic branch ("prompt.str", "list[int]")."""

    def validate(value: Any, handler) -> Any:
        try:
            return handler(value)
        except ValidationError as err:
            branches: dict[Any, list[dict]] = {}
            for error in err.errors():
                branches.setdefault(error["loc"][0] if error["loc"] else None, []).append(error)
            took = [errors for errors in branches.values() if any(_took_shape(e) for e in errors)]
            if not took:  # the value has none of the accepted shapes
                raise PydanticCustomError("union_type", f"Input should be {description}") from None
            closest = min(took, key=lambda errors: (sum(map(_type_error, errors)), len(errors)))
            error = next(e for e in closest if _took_shape(e))
            where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error["loc"][1:])
            message = f"{where}: {{msg}}" if where else "{msg}"
            raise PydanticCustomError(error["type"], message, {"msg": error["msg"]}) from None

    return WrapValidator(validate)


def _type_error(error: dict) -> bool:
    return error["type"].endswith(("_type", "_parsing"))


def _took_shape(error: dict) -> bool:
    """Whether a union branch's error is about what is inside the value, not the value's type."""
    return len(error["loc"]) > 1 or not _type_error(error)


def _stop_string(text: str) -> str:
    if not 1 <= len(text) <= MAX_STOP_CHARS:
        raise PydanticCustomError(
            "string_length", "stop strings must have 1 to {most} characters, got {n}", {"most": MAX_STOP_CHARS, "n": len(text)}
        )
    return text


Text = Annotated[str, AfterValidator(_valid_text)]
Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
Count = Annotated[int, Field(ge=0, le=2**31 - 1)]
StopString = Annotated[
    Text, AfterValidator(_stop_string), Field(json_schema_extra={"minLength": 1, "maxLength": MAX_STOP_CHARS})
]
Stop = Annotated[
    StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)],
    _one_of(f"a string or a list of at most {MAX_STOP_STRINGS} non-empty strings of at most {MAX_STOP_CHARS} characters"),
]
Prompt = Annotated[
    Text | list[Count] | list[Text] | list[list[Count]],
    _one_of("a string, a list of token ids, a list of strings or a list of token-id lists"),
]


class Refused(NamedTuple):
    """A field llmpipe does not support yet: any value but `off` (which asks for nothing) is a 400."""

    why: str
    off: tuple = (None,)


NOT_YET = "not supported yet"
BEAM_SEARCH = Refused("beam search is not supported", (None, False))
REFUSED_SAMPLING = {
    "response_format": Refused("structured outputs are " + NOT_YET, (None, {"type": "text"})),
    "use_beam_search": BEAM_SEARCH,
    "length_penalty": Refused("length_penalty applies to beam search, which is not supported", (None, 1.0)),
    "allowed_token_ids": Refused(NOT_YET),
    "bad_words": Refused(NOT_YET, (None, [])),
    "spaces_between_special_tokens": Refused("special tokens are always decoded without added spaces", (None, True)),
    "prompt_logprobs": Refused(NOT_YET),
    "structured_outputs": Refused("structured outputs are " + NOT_YET),
    "guided_json": Refused("structured outputs are " + NOT_YET),
    "guided_regex": Refused("structured outputs are " + NOT_YET),
    "guided_choice": Refused("structured outputs are " + NOT_YET),
    "guided_grammar": Refused("structured outputs are " + NOT_YET),
    "guided_decoding_backend": Refused("structured outputs are " + NOT_YET),
    "guided_whitespace_pattern": Refused("structured outputs are " + NOT_YET),
    "logits_processors": Refused("custom logits processors are not supported"),
    "priority": Refused("requests are served first come, first served", (None, 0)),
    "request_id": Refused("the server names each request itself"),
    "return_token_ids": Refused(NOT_YET, (None, False)),
    "cache_salt": Refused(NOT_YET),
    "kv_transfer_params": Refused("disaggregated prefill is not supported"),
    "vllm_xargs": Refused("custom arguments are not supported"),
    "metadata": Refused("stored completions are not supported"),
    "store": Refused("stored completions are not supported", (None, False)),
    "service_tier": Refused("there is one service tier", (None, "auto", "default")),
    "prompt_cache_key": Refused("prefix caching is automatic and needs no key"),
}


class _Body(BaseModel):
    # strict: OpenAI answers 400 to "5" for an integer and "yes" for a boolean; NaN / Infinity are
    # never valid sampling values; an unknown field is an error, not silently dropped.
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="forbid")
    REFUSED: ClassVar[dict[str, Refused]] = {}

    def check_supported(self) -> None:
        """400 for a refused field that asks for something, naming the field."""
        for name, refused in self.REFUSED.items():
            value = getattr(self, name)
            if not any(value == off for off in refused.off):
                raise InvalidRequestError(f"{name}: {refused.why}", param=name, code="unsupported_parameter")


def refusing(model: type[_Body]) -> type[_Body]:
    """`model` with each field of its REFUSED table declared (any JSON value, default None), so the
    field is accepted, then refused by check_supported when it asks for something."""
    refused = {name: (Any, None) for name in model.REFUSED if name not in model.model_fields}
    return create_model(model.__name__, __base__=model, __module__=model.__module__, __doc__=model.__doc__, **refused)


@refusing
class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False
    REFUSED: ClassVar[dict[str, Refused]] = {"continuous_usage_stats": Refused(NOT_YET, (False,))}


@refusing
class SamplingFields(_Body):
    model: Text | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = Field(1, ge=1, le=MAX_N)
    stop: Stop | None = None
    seed: Int64 | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Annotated[dict[Text, float], Field(max_length=MAX_LOGIT_BIAS)] | None = Field(
        None, description="token id (as a string) → bias in [-100, 100] added to its logit"
    )
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Text | None = Field(None, description="the end user, as OpenAI defines it: logged, no effect on the output")
    safety_identifier: Text | None = Field(None, description="as user")
    # vLLM's extras
    top_k: Int64 = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: Count = 0
    ignore_eos: bool = False
    stop_token_ids: list[Int64] | None = Field(None, max_length=MAX_LOGIT_BIAS)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    return_tokens_as_token_ids: bool = False
    truncate_prompt_tokens: Annotated[int, Field(ge=-1, le=2**31 - 1)] | None = Field(
        None, description="keep only the prompt's last k tokens (-1: as many as the context holds)"
    )
    REFUSED: ClassVar[dict[str, Refused]] = REFUSED_SAMPLING

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def check_supported(self) -> None:
        super().check_supported()
        if self.stream_options is not None:
            if not self.stream:
                raise InvalidRequestError("stream_options: only allowed when stream is true", param="stream_options")
            self.stream_options.check_supported()

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """Raises InvalidRequestError naming the field and its limit."""
        return SamplingParams(
            n=self.n,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            seed=self.seed,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logit_bias=_token_biases(self.logit_bias),
        )


def _token_biases(logit_bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias keys are token ids written as JSON strings."""
    if not logit_bias:
        return None
    biases = {}
    for key, value in logit_bias.items():
        if not key.strip().lstrip("-").isdigit():
            raise InvalidRequestError(f"logit_bias: keys must be token ids, got {key!r}", param="logit_bias")
        biases[int(key)] = value
    return biases


@refusing
class CompletionRequest(SamplingFields):
    prompt: Prompt
    max_tokens: Count | None = 16
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_special_tokens: bool = Field(True, description="let the tokenizer add BOS/EOS as the model configures")
    REFUSED: ClassVar[dict[str, Refused]] = {
        **REFUSED_SAMPLING,
        "echo": Refused("echo is " + NOT_YET, (None, False)),
        "suffix": Refused("insertion (suffix) is not supported"),
        "best_of": Refused("best_of other than n is not supported"),
    }

    def check_supported(self) -> None:
        if self.best_of is not None and self.best_of == self.n and isinstance(self.best_of, int):
            self.best_of = None  # best_of == n asks for nothing more than n
        super().check_supported()


class TextPart(_Body):
    type: Literal["text"]
    text: Text


Content = Annotated[Text | list[TextPart], _one_of("a string or a list of text parts ({'type': 'text', 'text': ...})")]


@refusing
class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Content | None = None
    name: Text | None = None
    tool_call_id: Text | None = Field(None, description="passed to the chat template")
    REFUSED: ClassVar[dict[str, Refused]] = {
        "tool_calls": Refused("tool calls are " + NOT_YET, (None, [])),
        "function_call": Refused("function calls are " + NOT_YET),
        "refusal": Refused(NOT_YET),
        "audio": Refused("audio is not supported"),
        "reasoning_content": Refused(NOT_YET),
    }

    def as_template_input(self) -> dict:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        extra = {key: getattr(self, key) for key in ("name", "tool_call_id") if getattr(self, key)}
        return {"role": self.role, "content": content or "", **extra}


Messages = Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
TemplateKwargs = dict[Text, Any]
REFUSED_CHAT = {
    "tools": Refused("tool calling is " + NOT_YET, (None, [])),
    "tool_choice": Refused("tool calling is " + NOT_YET, (None, "none", "auto")),
    "parallel_tool_calls": Refused("tool calling is " + NOT_YET),
    "functions": Refused("function calling is " + NOT_YET, (None, [])),
    "function_call": Refused("function calling is " + NOT_YET, (None, "none", "auto")),
    "continue_final_message": Refused(NOT_YET, (None, False)),
    "chat_template": Refused("the server uses the model's own chat template"),
    "documents": Refused(NOT_YET),
    "mm_processor_kwargs": Refused("multimodal inputs are not supported"),
}


@refusing
class ChatCompletionRequest(SamplingFields):
    messages: Messages
    max_tokens: Count | None = None
    max_completion_tokens: Count | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    add_special_tokens: bool = Field(False, description="let the tokenizer add BOS/EOS on top of the template")
    chat_template_kwargs: TemplateKwargs | None = Field(None, description="extra variables for the chat template")
    REFUSED: ClassVar[dict[str, Refused]] = {
        **REFUSED_SAMPLING,
        **REFUSED_CHAT,
        "echo": Refused("echo is " + NOT_YET, (None, False)),
        "modalities": Refused("only text output is supported", (None, ["text"])),
        "audio": Refused("audio output is not supported"),
        "prediction": Refused("predicted outputs are not supported"),
        "reasoning_effort": Refused("reasoning controls are not supported"),
        "verbosity": Refused("verbosity controls are not supported"),
        "web_search_options": Refused("web search is not supported"),
    }

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs: only allowed when logprobs is true", param="top_logprobs")
        for i, message in enumerate(self.messages):
            try:
                message.check_supported()
            except InvalidRequestError as err:
                raise InvalidRequestError(f"messages[{i}].{err}", param=f"messages[{i}].{err.param}", code=err.code)


@refusing
class TokenizeRequest(_Body):
    model: Text | None = None
    prompt: Text | None = None
    messages: Annotated[list[ChatMessage], Field(max_length=MAX_MESSAGES)] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: TemplateKwargs | None = None
    return_token_strs: bool = Field(False, description="also return each token as its string")
    REFUSED: ClassVar[dict[str, Refused]] = {
        key: REFUSED_CHAT[key] for key in ("continue_final_message", "chat_template", "tools", "mm_processor_kwargs")
    }


class DetokenizeRequest(_Body):
    model: Text | None = None
    tokens: list[Count]


REQUESTS = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
    "/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
}


def field_table() -> list[tuple[str, str, str]]:
    """(route, field, what happens) for every request field: the README's table is this table."""
    rows = []
    for route, model in REQUESTS.items():
        for name, info in model.model_fields.items():
            refused = model.REFUSED.get(name)
            if refused is not None:
                rows.append((route, name, f"refused with 400 ({refused.why})"))
            else:
                rows.append((route, name, "supported" + (f": {info.description}" if info.description else "")))
    return rows
