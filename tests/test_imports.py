"""The packages' import directions: the models (and the layers and KV cache pieces they build on) never
import the engine, so the engine can import them; and no module of llmpipe imports one that imports
it back, so no cycle is dodged by a deferred import."""

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


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in ROOT.rglob("*.py")}


def import_edges(path: Path) -> set[str]:
    """The llmpipe modules `path` imports at any depth, but for type checking only: `from pkg import
    name` is pkg's, unless the name is a submodule of pkg (then that submodule's)."""
    tree = ast.parse(path.read_text())
    typing_only = {id(sub) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
                   for sub in ast.walk(node)}
    edges = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            edges |= {alias.name for alias in node.names if alias.name in MODULES}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            submodules = {f"{node.module}.{alias.name}" for alias in node.names} & MODULES.keys()
            edges |= submodules
            if node.module in MODULES and len(submodules) < len(node.names):
                edges.add(node.module)
    return edges - {module_name(path)}


def test_no_module_imports_one_that_imports_it_back():
    graph = {name: import_edges(path) for name, path in MODULES.items()}
    reaches: dict[str, set[str]] = {}

    def reach(start: str) -> set[str]:
        if start not in reaches:
            seen, todo = set(), list(graph[start])
            while todo:
                name = todo.pop()
                if name not in seen:
                    seen.add(name)
                    todo += graph[name]
            reaches[start] = seen
        return reaches[start]

    cycles = sorted((a, b) for a in graph for b in graph[a] if a in reach(b))
    assert not cycles, f"import cycles (module → a module that reaches it back): {cycles}"


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
