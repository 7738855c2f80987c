"""Request bodies of the OpenAI-compatible routes: OpenAI's fields plus vLLM's extras.

Every field OpenAI or vLLM defines is declared, so none is silently dropped: each is either
supported or listed in the model's `REFUSED` table, which answers 400 to any value that asks for
something (see `check_supported`). Unknown fields are a 400 too, as on OpenAI. Types are strict
(`max_tokens: "5"` is an error, as on OpenAI), text must be valid Unicode, and lists have caps.
Pydantic checks types and the server's caps; the sampling limits (temperature >= 0, top_p in
(0, 1], ...) are SamplingParams' to check, so they live in one place.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal, NamedTuple

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, WrapValidator, create_model
from pydantic_core import PydanticCustomError

from llmpipe.errors import InvalidRequestError
from llmpipe.sampling_params import SamplingParams, StructuredOutputsParams
from llmpipe.structured_output import check_structured_outputs

MAX_N = 16
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 64  # OpenAI allows 4 and vLLM sets no cap; each string is checked at every token
MAX_STOP_CHARS = 256
MAX_MESSAGES = 4096
MAX_LOGIT_BIAS = 1024  # entries
MAX_PROMPTS = 256  # prompts in one completions request (each is an engine request)
MAX_CHOICES = 1024  # structured_outputs.choice / guided_choice strings


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
            # a union inside a union ("input[0].call_id") already starts its message with its path
            separator = "" if error["msg"].startswith((".", "[")) else ": "
            message = f"{where}{separator}{{msg}}" if where else "{msg}"
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
    "use_beam_search": BEAM_SEARCH,
    "length_penalty": Refused("length_penalty applies to beam search, which is not supported", (None, 1.0)),
    "allowed_token_ids": Refused(NOT_YET),
    "bad_words": Refused(NOT_YET, (None, [])),
    "spaces_between_special_tokens": Refused("special tokens are always decoded without added spaces", (None, True)),
    "guided_decoding_backend": Refused("structured outputs run on llguidance", (None, "auto", "guidance")),
    "guided_whitespace_pattern": Refused(NOT_YET),
    "logits_processors": Refused("custom logits processors are not supported"),
    "priority": Refused("requests are served first come, first served", (None, 0)),
    "request_id": Refused("the server names each request itself"),
    "return_token_ids": Refused(NOT_YET, (None, False)),
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


class JsonSchemaFormat(_Body):
    name: Annotated[Text, Field(min_length=1, max_length=64)]
    description: Text | None = None
    schema_: dict[Text, Any] | None = Field(None, alias="schema")
    strict: bool | None = Field(None, description="the schema is always enforced")


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def structured_outputs(self) -> StructuredOutputsParams | None:
        if self.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if self.type == "json_schema":
            if self.json_schema is None:
                raise InvalidRequestError("response_format.json_schema: required for type json_schema",
                                          param="response_format.json_schema")
            return StructuredOutputsParams(json=self.json_schema.schema_ or {})
        return None


@refusing
class StructuredOutputsBody(_Body):
    """vLLM's `structured_outputs`: exactly one of json, regex, choice, grammar, json_object."""

    json_: dict[Text, Any] | Text | None = Field(None, alias="json")
    regex: Text | None = None
    choice: Annotated[list[Text], Field(min_length=1, max_length=MAX_CHOICES)] | None = None
    grammar: Text | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    REFUSED: ClassVar[dict[str, Refused]] = {
        "structural_tag": Refused(NOT_YET),
        "whitespace_pattern": Refused(NOT_YET),
        "backend": Refused("structured outputs run on llguidance", (None, "auto", "guidance")),
    }

    def structured_outputs(self) -> StructuredOutputsParams:
        return StructuredOutputsParams(json=self.json_, regex=self.regex, choice=self.choice, grammar=self.grammar,
                                       json_object=bool(self.json_object),
                                       disable_any_whitespace=self.disable_any_whitespace)


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
    response_format: ResponseFormat | None = Field(None, description="text, json_object or json_schema (enforced)")
    structured_outputs: StructuredOutputsBody | None = Field(
        None, description="vLLM's: the output held to json (a schema), regex, choice, grammar or json_object"
    )
    guided_json: dict[Text, Any] | Text | None = Field(None, description="vLLM's older structured_outputs.json")
    guided_regex: Text | None = Field(None, description="vLLM's older structured_outputs.regex")
    guided_choice: Annotated[list[Text], Field(min_length=1, max_length=MAX_CHOICES)] | None = Field(
        None, description="vLLM's older structured_outputs.choice"
    )
    guided_grammar: Text | None = Field(None, description="vLLM's older structured_outputs.grammar")
    cache_salt: Text | None = Field(
        None, min_length=1, description="vLLM's: the prompt's prefix-cache blocks are shared only with requests of the same salt"
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
        if self.structured_outputs is not None:
            try:
                self.structured_outputs.check_supported()
            except InvalidRequestError as err:
                raise InvalidRequestError(f"structured_outputs.{err}", param=f"structured_outputs.{err.param}",
                                          code=err.code) from None

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The one constraint the body asks for, checked: a 400 naming the field when it does not
        compile, or when two fields ask for one."""
        legacy = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                  "guided_grammar": "grammar"}
        asked = [(name, StructuredOutputsParams(**{kind: getattr(self, name)}))
                 for name, kind in legacy.items() if getattr(self, name) is not None]
        if self.structured_outputs is not None:
            asked.append((None, self.structured_outputs.structured_outputs()))  # None: named by its kind
        if self.response_format is not None and self.response_format.structured_outputs() is not None:
            asked.append(("response_format", self.response_format.structured_outputs()))
        if len(asked) > 1:
            names = [name or "structured_outputs" for name, _ in asked]
            raise InvalidRequestError(f"{names[1]}: only one of {' and '.join(names)} may be given", param=names[1])
        if not asked:
            return None
        name, spec = asked[0]
        return check_structured_outputs(spec, name)

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
            structured_outputs=self.structured_outputs_params(),
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
    prompt: Prompt = Field(
        description=f"text or token ids, or a list of up to {MAX_PROMPTS} of either: n choices per prompt, in order"
    )
    max_tokens: Count | None = 16
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = Field(False, description="each choice's text (and logprobs) starts with its prompt's")
    prompt_logprobs: int | None = Field(
        None, ge=0, le=MAX_LOGPROBS, description="each choice carries the top-N logprobs of every prompt token (vLLM's)"
    )
    add_special_tokens: bool = Field(True, description="let the tokenizer add BOS/EOS as the model configures")
    REFUSED: ClassVar[dict[str, Refused]] = {
        **REFUSED_SAMPLING,
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


MAX_TOOLS = 128  # OpenAI's cap


class FunctionDefinition(_Body):
    name: Annotated[Text, Field(min_length=1, max_length=256)]
    description: Text | None = None
    parameters: dict[Text, Any] | None = Field(None, description="a JSON schema of the arguments")
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Body):
    name: Text


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Annotated[
    Literal["none", "auto", "required"] | NamedToolChoice,
    _one_of("'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}"),
]
Tools = Annotated[list[Tool], Field(max_length=MAX_TOOLS)]


class FunctionCall(_Body):
    name: Text
    arguments: Text = Field(description="the arguments as JSON text")


class ToolCallParam(_Body):
    """A call the assistant made, in a conversation's history."""

    id: Text
    type: Literal["function"]
    function: FunctionCall
    index: Annotated[int, Field(ge=0)] | None = Field(
        None, description="the call's place in a streamed reply (sent back by clients that rebuilt it): ignored"
    )

    def check_arguments(self) -> None:
        try:
            is_object = isinstance(json.loads(self.function.arguments), dict)
        except json.JSONDecodeError:
            is_object = False
        if not is_object:
            raise InvalidRequestError("function.arguments: must be a JSON object", param="function.arguments")


@refusing
class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Content | None = None
    name: Text | None = None
    tool_call_id: Text | None = Field(None, description="passed to the chat template")
    tool_calls: Annotated[list[ToolCallParam], Field(max_length=MAX_TOOLS)] | None = Field(
        None, description="the assistant's calls, rendered by the chat template"
    )
    REFUSED: ClassVar[dict[str, Refused]] = {
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
        if self.tool_calls:
            # arguments parsed by the template's renderer
            extra["tool_calls"] = [call.model_dump(exclude={"index"}) for call in self.tool_calls]
        return {"role": self.role, "content": content or "", **extra}

    def check_supported(self) -> None:
        super().check_supported()
        if self.tool_calls and self.role != "assistant":
            raise InvalidRequestError("tool_calls: only assistant messages make tool calls", param="tool_calls")
        if self.role == "tool" and self.tool_call_id is None:  # as OpenAI: a result must name its call
            raise InvalidRequestError("tool_call_id: required in tool messages", param="tool_call_id",
                                      code="missing_required_parameter")
        for i, call in enumerate(self.tool_calls or []):
            try:
                call.check_arguments()
            except InvalidRequestError as err:
                raise InvalidRequestError(f"tool_calls[{i}].{err}", param=f"tool_calls[{i}].{err.param}") from None


Messages = Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
TemplateKwargs = dict[Text, Any]
REFUSED_CHAT = {
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
    tools: Tools | None = Field(None, description="function tools, rendered by the chat template")
    tool_choice: ToolChoice | None = Field(
        None, description="'auto' (the default with tools): calls read by the tool-call parser; 'required' and a "
        "named tool: enforced by structured outputs"
    )
    parallel_tool_calls: bool | None = Field(None, description="false: at most one call")
    prompt_logprobs: int | None = Field(
        None, ge=0, le=MAX_LOGPROBS,
        description="the reply carries the top-N logprobs of every prompt token (vLLM's); not when streaming",
    )
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
        if self.prompt_logprobs is not None and self.stream:  # vLLM's rule
            raise InvalidRequestError("prompt_logprobs: not available when stream is true", param="prompt_logprobs")
        check_messages(self.messages)
        check_tools(self.tools)
        self.check_tool_choice()

    @property
    def tool_choice_mode(self) -> str:
        """"none", "auto", "required" or "named", as OpenAI defaults it ("auto" when there are tools)."""
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice):
            return "named"
        return choice or ("auto" if self.tools else "none")

    def check_tool_choice(self) -> None:
        choice = self.tool_choice
        if choice in (None, "none", "auto"):
            return
        if not self.tools:
            raise InvalidRequestError(f"tool_choice: {self.tool_choice_mode!r} needs tools", param="tool_choice")
        if choice == "required":
            return
        names = [tool.function.name for tool in self.tools]
        if choice.function.name not in names:
            raise InvalidRequestError(
                f"tool_choice: no tool named {choice.function.name!r} in tools ({', '.join(map(repr, names))})",
                param="tool_choice.function.name",
            )

    def named_tool(self) -> dict | None:
        """The tool tool_choice names, as the template sees it."""
        if not isinstance(self.tool_choice, NamedToolChoice):
            return None
        return next(t for t in template_tools(self.tools) if t["function"]["name"] == self.tool_choice.function.name)


def check_messages(messages: list[ChatMessage]) -> None:
    for i, message in enumerate(messages):
        try:
            message.check_supported()
        except InvalidRequestError as err:
            raise InvalidRequestError(f"messages[{i}].{err}", param=f"messages[{i}].{err.param}", code=err.code)


def check_tools(tools: list[Tool] | None) -> None:
    names = [tool.function.name for tool in tools or []]
    repeated = next((name for name in names if names.count(name) > 1), None)
    if repeated is not None:
        raise InvalidRequestError(f"tools: two tools are named {repeated!r}", param="tools")


def template_tools(tools: list[Tool] | None) -> list[dict] | None:
    """The tools as transformers hands them to a chat template: OpenAI's dicts, as the client sent them."""
    return [tool.model_dump(exclude_unset=True) for tool in tools] if tools else None


@refusing
class TokenizeRequest(_Body):
    model: Text | None = None
    prompt: Text | None = None
    messages: Annotated[list[ChatMessage], Field(max_length=MAX_MESSAGES)] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: TemplateKwargs | None = None
    return_token_strs: bool = Field(False, description="also return each token as its string")
    tools: Tools | None = Field(None, description="function tools, rendered by the chat template")
    REFUSED: ClassVar[dict[str, Refused]] = {
        key: REFUSED_CHAT[key] for key in ("continue_final_message", "chat_template", "mm_processor_kwargs")
    }

    def check_supported(self) -> None:
        super().check_supported()
        check_tools(self.tools)
        check_messages(self.messages or [])


class DetokenizeRequest(_Body):
    model: Text | None = None
    tokens: list[Count]


# ---- the Responses API (POST /v1/responses): run as the chat completion it amounts to ----------
# No state is kept between responses: previous_response_id and store: true are refused.

LOGPROBS_INCLUDE = "message.output_text.logprobs"
STATELESS = "responses are not stored: send the whole conversation as input"


class InputTextPart(_Body):
    type: Literal["input_text", "output_text"]
    text: Text
    annotations: list[Any] | None = None  # on output_text parts a client sends back
    logprobs: list[Any] | None = None


ResponsesPartList = Annotated[list[InputTextPart], Field(max_length=MAX_MESSAGES)]
MessageContent = Annotated[
    Text | ResponsesPartList, _one_of("a string or a list of input_text parts ({'type': 'input_text', 'text': ...})")
]


class InputMessage(_Body):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: MessageContent
    id: Text | None = None  # set on output items a client sends back
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    phase: Literal["commentary", "final_answer"] | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class FunctionCallItem(_Body):
    type: Literal["function_call"]
    call_id: Text
    name: Text
    arguments: Text
    id: Text | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputItem(_Body):
    type: Literal["function_call_output"]
    call_id: Text
    output: MessageContent
    id: Text | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(part.text for part in self.output)


InputItem = Annotated[
    InputMessage | FunctionCallItem | FunctionCallOutputItem,
    _one_of("a message, a function_call or a function_call_output item"),
]
Input = Annotated[
    Text | Annotated[list[InputItem], Field(min_length=1, max_length=MAX_MESSAGES)],
    _one_of("a string or a list of input items"),
]


class FunctionTool(_Body):
    type: Literal["function"]
    name: Text
    description: Text | None = None
    parameters: dict[Text, Any] | None = None
    strict: bool | None = None

    def as_chat_tool(self) -> dict:
        function = {"name": self.name, "parameters": self.parameters or {"type": "object", "properties": {}}}
        function.update({k: v for k, v in (("description", self.description), ("strict", self.strict)) if v is not None})
        return {"type": "function", "function": function}


class ToolChoiceFunction(_Body):
    type: Literal["function"]
    name: Text


class TextFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    name: Text | None = None
    schema_: dict[Text, Any] | None = Field(None, alias="schema")
    description: Text | None = None
    strict: bool | None = None

    def as_response_format(self) -> dict:
        if self.type != "json_schema":
            return {"type": self.type}
        if self.schema_ is None:
            raise InvalidRequestError("text.format.schema is required for json_schema", param="text.format.schema")
        spec = {"name": self.name or "response", "schema": self.schema_}
        spec.update({k: v for k, v in (("description", self.description), ("strict", self.strict)) if v is not None})
        return {"type": "json_schema", "json_schema": spec}


@refusing
class TextConfig(_Body):
    format: TextFormat | None = None
    REFUSED: ClassVar[dict[str, Refused]] = {"verbosity": Refused("verbosity controls are not supported", (None, "medium"))}


@refusing
class ResponsesStreamOptions(_Body):
    REFUSED: ClassVar[dict[str, Refused]] = {"include_obfuscation": Refused("stream obfuscation is not supported", (None, False))}


@refusing
class ResponsesRequest(_Body):
    model: Text | None = None
    input: Input
    instructions: Text | None = None
    max_output_tokens: Annotated[int, Field(ge=1, le=2**31 - 1)] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    include: list[Literal["message.output_text.logprobs"]] | None = Field(
        None, description="only message.output_text.logprobs (the output text's token logprobs)"
    )
    stream: bool = False
    stream_options: ResponsesStreamOptions | None = None
    tools: Annotated[list[FunctionTool], Field(max_length=MAX_MESSAGES)] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    metadata: Annotated[dict[Text, Annotated[str, Field(max_length=512)]], Field(max_length=16)] | None = Field(
        None, description="returned as sent"
    )
    user: Text | None = Field(None, description="the end user, as OpenAI defines it: logged, no effect on the output")
    safety_identifier: Text | None = Field(None, description="as user")
    seed: Int64 | None = Field(None, description="vLLM's extra: seeded sampling")
    REFUSED: ClassVar[dict[str, Refused]] = {
        "previous_response_id": Refused(STATELESS),
        "store": Refused(STATELESS + " (store must be false)", (None, False)),
        "conversation": Refused(STATELESS),
        "background": Refused("background responses are not supported", (None, False)),
        "background_options": Refused("background responses are not supported"),
        "truncation": Refused("a prompt over the context is refused, not truncated", (None, "disabled")),
        "reasoning": Refused("reasoning controls are not supported"),
        "prompt": Refused("stored prompt templates are not supported"),
        "max_tool_calls": Refused("max_tool_calls is not supported"),
        "service_tier": Refused("there is one service tier", (None, "auto", "default")),
        "prompt_cache_key": Refused("prefix caching is automatic and needs no key"),
        "prompt_cache_retention": Refused("prefix caching is automatic and needs no settings"),
        "prompt_cache_options": Refused("prefix caching is automatic and needs no settings"),
        "context_management": Refused("context management is not supported"),
        "moderation": Refused("moderation is not supported"),
        "image": Refused("images are not supported"),
        "access_programs": Refused("access programs are not supported"),
    }

    def check_supported(self) -> None:
        super().check_supported()
        for part in (self.text, self.stream_options):
            if part is not None:
                part.check_supported()
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options: only allowed when stream is true", param="stream_options")

    @property
    def wants_logprobs(self) -> bool:
        return self.top_logprobs is not None or LOGPROBS_INCLUDE in (self.include or ())

    def chat_body(self) -> dict:
        """The same request as a chat completions body."""
        body: dict[str, Any] = {"messages": self.messages(), "stream": self.stream}
        optional = {
            "model": self.model,
            "max_completion_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "user": self.user,
            "safety_identifier": self.safety_identifier,
            "seed": self.seed,
            "parallel_tool_calls": self.parallel_tool_calls,
        }
        body.update({k: v for k, v in optional.items() if v is not None})
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        if self.wants_logprobs:
            body.update(logprobs=True, top_logprobs=self.top_logprobs or 0)
        if self.tools:
            body["tools"] = [tool.as_chat_tool() for tool in self.tools]
        if isinstance(self.tool_choice, ToolChoiceFunction):
            body["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice
        if self.text is not None and self.text.format is not None:
            body["response_format"] = self.text.format.as_response_format()
        return body

    def messages(self) -> list[dict]:
        """instructions first (as a system message), then the input items as chat messages; function
        calls in a row join one assistant turn, as the model produced them."""
        messages = [{"role": "system", "content": self.instructions}] if self.instructions is not None else []
        items = [InputMessage(role="user", content=self.input)] if isinstance(self.input, str) else self.input
        for item in items:
            if isinstance(item, InputMessage):
                messages.append({"role": item.role, "content": item.text()})
            elif isinstance(item, FunctionCallOutputItem):
                messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
            else:
                call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
                last = messages[-1] if messages else None
                if last is None or last["role"] != "assistant":
                    last = {"role": "assistant", "content": None}
                    messages.append(last)
                last.setdefault("tool_calls", []).append(call)
        return messages

    def echo(self) -> dict:
        """The request's settings as the response object repeats them."""
        return {
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "metadata": self.metadata or {},
            "parallel_tool_calls": self.parallel_tool_calls is not False,
            "previous_response_id": None,
            "store": False,
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "top_logprobs": self.top_logprobs,
            "text": {"format": self.text.format.model_dump(by_alias=True, exclude_none=True)}
            if self.text is not None and self.text.format is not None
            else {"format": {"type": "text"}},
            "tools": [{"strict": None, "description": None, "parameters": None, **t.model_dump(exclude_none=True)}
                      for t in self.tools or ()],
            "tool_choice": self.tool_choice.model_dump() if isinstance(self.tool_choice, ToolChoiceFunction)
            else self.tool_choice or "auto",
            "truncation": "disabled",
            "user": self.user,
            "safety_identifier": self.safety_identifier,
        }


REQUESTS = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/responses": ResponsesRequest,
    "/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
}


class LoadLoRAAdapterRequest(_Body):
    """vLLM's /v1/load_lora_adapter body."""

    lora_name: Text = Field(min_length=1, description="the name requests give as their model")
    lora_path: Text = Field(min_length=1, description="a PEFT adapter directory or a GGUF LoRA file, on the server")


class UnloadLoRAAdapterRequest(_Body):
    """vLLM's /v1/unload_lora_adapter body (lora_int_id, which llmpipe does not key by, is accepted and unused)."""

    lora_name: Text = Field(min_length=1)
    lora_int_id: int | None = None


def field_table(requests: dict[str, type[_Body]] = REQUESTS) -> list[tuple[str, str, str]]:
    """(route, field, what happens) for every field of `requests`' bodies: docs/serving.md's table is this
    table (with the pooling routes': server/pooling_protocol.py)."""
    rows = []
    for route, model in requests.items():
        for name, info in model.model_fields.items():
            refused = model.REFUSED.get(name)
            if refused is not None:
                rows.append((route, name, f"refused with 400 ({refused.why})"))
            else:
                rows.append((route, name, "supported" + (f": {info.description}" if info.description else "")))
    return rows
