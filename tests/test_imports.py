"""The packages' import directions: the models (and the layers and KV cache pieces they build on) never
import the engine, so the engine can import them and no cycle is dodged by a deferred import."""

import ast
from pathlib import Path

ROOT = Path(__file__).parents[1] / "llmpipe"


def imports(path: Path) -> set[str]:
    """Every module `path` imports, at any depth (function-level imports included)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_models_layers_and_the_kv_cache_never_import_the_engine():
    for package in ("models", "layers", "kv_cache"):
        for path in (ROOT / package).rglob("*.py"):
            engine = sorted(name for name in imports(path) if name == "llmpipe.engine" or name.startswith("llmpipe.engine."))
            assert not engine, f"{path.relative_to(ROOT)} imports {engine}"


def test_the_kv_cache_pieces_import_no_model():
    for path in (ROOT / "kv_cache").rglob("*.py"):
        models = sorted(name for name in imports(path) if name.startswith("llmpipe.models"))
        assert not models, f"{path.relative_to(ROOT)} imports {models}"


def test_the_c_library_is_reached_only_through_kernels_ops():
    """One module of op wrappers (vLLM's _custom_ops): nothing else loads the library or calls torch.ops.llmpipe."""
    for path in ROOT.rglob("*.py"):
        if path.parent.name == "kernels" and path.name in ("ops.py", "build.py", "fake.py"):
            continue
        text = path.read_text()
        assert "torch.ops.llmpipe" not in text and "import library" not in text, path.relative_to(ROOT)
