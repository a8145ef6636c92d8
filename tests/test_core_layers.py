"""The core's imports run one way: records, errors and levels at the bottom; the plugin host;
config, selection and the kernel resolver; the facade; the public API and tools. Every
import statement counts, also inside functions; only `if TYPE_CHECKING:` blocks (type
annotations, never executed) are left out."""

from __future__ import annotations

import ast
from pathlib import Path

import torchbridge

PACKAGE = Path(torchbridge.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(name: str) -> set[str]:
    """The torchbridge modules `name` imports, at module level and inside functions."""
    path = MODULES[name]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(name, path.name == "__init__.py", node)
            found.add(target)
            found.update(f"{target}.{alias.name}" for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return {m for m in found if m in MODULES and m != name}


GRAPH = {name: imports_of(name) for name in MODULES}


def cycles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def strongconnect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH[v]:
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(GRAPH):
        if v not in index:
            strongconnect(v)
    return found


def test_the_graph_sees_function_local_imports() -> None:
    # backend.py imports the pipeline at module level; doctor imports at module level; the
    # CPU plugin imports its passes inside a hook: the walker must see all three.
    assert "torchbridge.optimize.pipeline" in GRAPH["torchbridge.backend"]
    assert "torchbridge.builtin.cpu.passes" in GRAPH["torchbridge.builtin.cpu.plugin"]
    assert "torchbridge.backend" not in GRAPH["torchbridge.hookspecs"]  # TYPE_CHECKING only


def test_core_modules_form_no_import_cycle() -> None:
    assert cycles() == []


LAYERS = [
    {"torchbridge.errors", "torchbridge.types", "torchbridge.hookspecs",
     "torchbridge.trees", "torchbridge.suggestions", "torchbridge.cpu_features",
     "torchbridge.tensor_bits"},
    # The Triton kernels need only the errors; whatever wraps them as ops sits above.
    {"torchbridge.kernels.triton._launch"},
    {"torchbridge.kernels.triton.rms_norm", "torchbridge.kernels.triton.silu_mul",
     "torchbridge.kernels.triton.rotary"},
    {"torchbridge.kernels.triton"},
    {"torchbridge.levels", "torchbridge.devices", "torchbridge.fp8", "torchbridge.atomic_file"},
    {"torchbridge.plugins", "torchbridge.config_errors"},
    {"torchbridge.config", "torchbridge.selection", "torchbridge.kernels.ops",
     "torchbridge.kernels.compute"},
    {"torchbridge.kernels.implementations"},
    {"torchbridge.kernels.choice", "torchbridge.kernels.fp8_linear"},
    {"torchbridge.kernels"},
    # Module patterns: structure only; the Hugging Face one reads the ops.
    {"torchbridge.optimize.kernel_patterns"},
    {"torchbridge.optimize.hf_attention"},
]


def test_lower_layers_import_only_below_themselves() -> None:
    below: set[str] = set()
    for layer in LAYERS:
        for module in layer:
            upward = GRAPH[module] - below - {"torchbridge"}
            assert not upward, f"{module} imports {sorted(upward)} from its layer or above"
        below |= layer


def test_nothing_in_the_core_imports_the_builtin_plugins() -> None:
    """The built-in plugins are loaded by the plugin host by module path, like any vendor
    plugin; the core itself never imports them."""
    for module, targets in GRAPH.items():
        if module.startswith("torchbridge.builtin"):
            continue
        assert not {t for t in targets if t.startswith("torchbridge.builtin")}, module
