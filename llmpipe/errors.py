"""The small family of errors llmpipe raises; the CLI prints any of them as one line."""


class LLMPipeError(Exception):
    """Base class of every error llmpipe raises on purpose."""


class ModelLoadError(LLMPipeError):
    """A model path, alias or file that cannot be read: missing, corrupt or truncated."""


class UnsupportedModelError(ModelLoadError):
    """A readable checkpoint that uses an architecture or tensor type llmpipe does not support."""


class InvalidRequestError(LLMPipeError, ValueError):
    """A request llmpipe refuses: invalid sampling values, a prompt over the context limit.

    `param` names the request field at fault and `code` says what is wrong with it, as OpenAI's
    error bodies do ("invalid_value", "context_length_exceeded", "unsupported_parameter", ...).
    """

    def __init__(self, message: str, *, param: str | None = None, code: str | None = "invalid_value") -> None:
        super().__init__(message)
        self.param = param
        self.code = code
