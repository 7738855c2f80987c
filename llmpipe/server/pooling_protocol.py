"""Request bodies of the pooling routes: OpenAI's embeddings, the Jina / Cohere rerank shape that
llama-server and vLLM serve, and vLLM's score. Strict types and caps, as protocol.py's bodies."""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import Field

from llmpipe.server.protocol import Count, Refused, Text, _Body, _one_of, refusing

MAX_INPUTS = 2048  # OpenAI's cap on one embeddings request's inputs
MAX_DOCUMENTS = 1024

EmbeddingInput = Annotated[
    Text | list[Count] | Annotated[list[Text], Field(max_length=MAX_INPUTS)]
    | Annotated[list[list[Count]], Field(max_length=MAX_INPUTS)],
    _one_of("a string, a list of token ids, a list of strings or a list of token-id lists"),
]


class DocumentText(_Body):
    text: Text


Document = Annotated[Text | DocumentText, _one_of("a string or {'text': ...}")]
Documents = Annotated[list[Document], Field(min_length=1, max_length=MAX_DOCUMENTS)]
ScoreText = Annotated[Text | Annotated[list[Text], Field(min_length=1, max_length=MAX_DOCUMENTS)],
                      _one_of("a string or a list of strings")]


@refusing
class EmbeddingRequest(_Body):
    model: Text | None = None
    input: EmbeddingInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1)] | None = Field(None, description="Matryoshka: the first N dimensions")
    user: Text | None = None
    truncate_prompt_tokens: int | None = Field(None, description="keep the last N tokens of each input (-1: the context)")
    add_special_tokens: bool = True
    normalize: bool = Field(True, description="L2-normalize each embedding (vLLM's field)")
    prompt_name: Text | None = Field(None, description="put the model's named prompt (sentence-transformers' prompts) "
                                     "before each text (text-embeddings-inference's field)")
    REFUSED: ClassVar[dict[str, Refused]] = {"priority": Refused("requests are served first come, first served", (None, 0))}


class RerankRequest(_Body):
    model: Text | None = None
    query: Text
    documents: Documents
    top_n: Annotated[int, Field(ge=0)] | None = Field(None, description="the best N results (0 or absent: all)")
    return_documents: bool = True
    instruction: Text | None = Field(None, description="a decoder reranker's task description")
    truncate_prompt_tokens: int | None = None


@refusing
class ScoreRequest(_Body):
    model: Text | None = None
    text_1: ScoreText = Field(description="the query, or one query per text_2 entry")
    text_2: ScoreText = Field(description="the documents")
    instruction: Text | None = Field(None, description="a decoder reranker's task description")
    truncate_prompt_tokens: int | None = None
    REFUSED: ClassVar[dict[str, Refused]] = {"encoding_format": Refused("scores are numbers", (None, "float"))}


POOLING_REQUESTS = {"/v1/embeddings": EmbeddingRequest, "/v1/rerank": RerankRequest, "/v1/score": ScoreRequest}
