"""A sentence-transformers model's prompts: the text it was trained to see before a query or a document
(config_sentence_transformers.json's `prompts`, and the `default_prompt_name` applied when none is named).

Qwen3-Embedding's "query" prompt is "Instruct: Given a web search query, retrieve relevant passages that
answer the query\\nQuery:", EmbeddingGemma's "task: search result | query: ". A request names one with
`prompt_name` (text-embeddings-inference's field, sentence-transformers' argument); it is put before each
text as sentence-transformers puts it, before tokenizing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from llmpipe.errors import InvalidRequestError
from llmpipe.files import read_json

CONFIG_FILE = "config_sentence_transformers.json"


@dataclass(frozen=True)
class SentencePrompts:
    prompts: dict[str, str] = field(default_factory=dict)
    default: str | None = None

    @classmethod
    def read(cls, path: Path) -> SentencePrompts:
        """The prompts of a model directory (none for a file, or a directory without the config)."""
        file = Path(path) / CONFIG_FILE
        if not file.is_file():
            return cls()
        config = read_json(file)
        prompts = {str(name): str(text) for name, text in (config.get("prompts") or {}).items()}
        default = config.get("default_prompt_name")
        return cls(prompts, default if default in prompts else None)

    def apply(self, text: str, name: str | None) -> str:
        """text after the named prompt, or the default one; a name the model lacks is a 400."""
        name = name if name is not None else self.default
        if name is None:
            return text
        if name not in self.prompts:
            known = ", ".join(self.prompts) or "none"
            raise InvalidRequestError(f"prompt_name {name!r} is not one of this model's prompts ({known})",
                                      param="prompt_name")
        return self.prompts[name] + text
