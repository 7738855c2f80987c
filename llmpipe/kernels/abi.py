"""The constants the C kernels and the Python side share, read from their one definition,
`csrc/abi.h` (its `#define NAME value` lines: integers, or sums and products of earlier names)."""

from __future__ import annotations

import ast
import operator
import re
from pathlib import Path

HEADER = Path(__file__).parent / "csrc" / "abi.h"
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def _value(node: ast.AST, known: dict[str, int]) -> int:
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.Name):
        return known[node.id]
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_value(node.left, known), _value(node.right, known))
    raise ValueError(f"{HEADER.name}: not an integer expression: {ast.dump(node)}")


def read_defines(text: str) -> dict[str, int]:
    known: dict[str, int] = {}
    for name, expr in re.findall(r"^#define (\w+) (.+)$", re.sub(r"/\*.*?\*/", "", text, flags=re.S), re.M):
        known[name] = _value(ast.parse(expr.strip(), mode="eval").body, known)
    return known


ABI = read_defines(HEADER.read_text())
MAX_ROWS = ABI["MAX_ROWS"]
