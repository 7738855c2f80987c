"""The docs cannot rot: every `llmpipe` command line in them parses (its optional [..] parts' flags
exist too), every `make` target they name exists, every relative link leads to a file, and every Python
block compiles. test_docs_run.py runs them."""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from llmpipe.cli import build_parser

ROOT = Path(__file__).parents[1]
DOCS = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").rglob("*.md"))]


def blocks(path: Path, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", path.read_text(), re.S)


def shell_lines(block: str) -> list[str]:
    """A bash block's commands: continuations joined, comments and a trailing `&` dropped."""
    lines = []
    for line in block.replace("\\\n", " ").splitlines():
        line = re.sub(r"(^|\s)#.*", "", line).strip().removesuffix("&").strip()
        if line:
            lines.append(line)
    return lines


def llmpipe_commands() -> list[tuple[str, str]]:
    """(doc, command line) for each `llmpipe …` (or `-m llmpipe.cli …`) command in a bash block."""
    found = []
    for path in DOCS:
        for block in blocks(path, "bash"):
            for line in shell_lines(block):
                at = line.find("-m llmpipe.cli ")
                if line.startswith("llmpipe "):
                    found.append((path.name, line[len("llmpipe "):]))
                elif at >= 0:
                    found.append((path.name, line[at + len("-m llmpipe.cli "):]))
    return found


def subparser(parser: argparse.ArgumentParser, words: list[str]) -> argparse.ArgumentParser:
    """The (sub)parser a command's leading words select."""
    for word in words:
        actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not actions or word not in actions[0].choices:
            break
        parser = actions[0].choices[word]
    return parser


@pytest.mark.parametrize("doc,command", llmpipe_commands(), ids=lambda v: v[:60])
def test_every_llmpipe_command_in_the_docs_parses(doc, command):
    optional = re.findall(r"\[([^\]]*)\]", command)
    required = re.sub(r"\[[^\]]*\]", "", command)
    parser = build_parser()
    with contextlib.redirect_stderr(io.StringIO()) as err:
        try:
            parser.parse_args(shlex.split(required))
        except SystemExit:
            pytest.fail(f"{doc}: `llmpipe {required}` does not parse: {err.getvalue().strip()}")
    flags = {flag for action in subparser(parser, shlex.split(required))._actions for flag in action.option_strings}
    for part in optional:
        for flag in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", part):
            assert flag in flags, f"{doc}: `llmpipe {required}` has no {flag}"


def test_the_make_targets_the_docs_name_exist():
    targets = set(re.findall(r"^([a-z][a-z0-9-]*):", (ROOT / "Makefile").read_text(), re.M))
    named = {(path.name, target) for path in DOCS for target in re.findall(r"`make ([a-z][a-z0-9-]*)", path.read_text())}
    assert named and not [(doc, target) for doc, target in named if target not in targets]


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_every_relative_link_leads_to_a_file(path):
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if not re.match(r"[a-z]+:", target) and not target.startswith("#"):
            assert (path.parent / target.split("#")[0]).exists(), f"{path.name}: {target}"


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_every_python_block_compiles(path):
    for block in blocks(path, "python"):
        compile(block, str(path), "exec")
