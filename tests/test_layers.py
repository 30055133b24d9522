"""The package's layers: a module imports only from its own layer or lower ones (read from the source)."""

from __future__ import annotations

import ast
from pathlib import Path

from .conftest import REPO_ROOT

PACKAGE = REPO_ROOT / "src" / "treegraft"

# lowest first; the key is the first component of a module's path inside the package
LAYERS = [
    {"atomic", "paths", "torch_ops", "devices", "hostreads", "machine", "config", "errors", "model_io", "tree", "stats"},
    {"drafters", "data", "models"},
    {"engines"},  # protocols at the bottom, the implementations (torch, llama_cpp) beside each other above them
    {"scheduling"},
    {"decoding"},  # the decoding loop: engines' protocols only (test_the_decoding_loop_imports_no_engine)
    {"front", "settings"},  # the front door (a pair's engines, the one method dispatch); typed settings
    {"pipeline", "hf_generate"},
    {"generate", "__init__"},
]


def layer_of(key: str) -> int:
    for i, names in enumerate(LAYERS):
        if key in names:
            return i
    raise KeyError(f"module group {key!r} has no layer: add it to LAYERS")


def _modules_imported(path: Path, package: Path) -> list[str]:
    """Every module of the package ``path`` imports, as a dotted path below the package (``engines.torch.target``)."""
    rel = path.relative_to(package).with_suffix("")
    here = list(rel.parts[:-1])
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - (node.level - 1)] if node.level > 1 else list(here)
                parts = base + (node.module.split(".") if node.module else [])
            elif node.module and node.module.split(".")[0] == package.name:
                parts = node.module.split(".")[1:]
            else:
                continue
            if not parts:  # `from . import x` at the top level
                parts = [alias.name for alias in node.names][:1]
            out.append(".".join(parts))
        elif isinstance(node, ast.Import):
            out += [".".join(a.name.split(".")[1:]) for a in node.names if a.name.split(".")[0] == package.name]
    return [m for m in out if m]


def _imported(path: Path, package: Path) -> list[str]:
    """The first package component of every module ``path`` imports from the package (relative or absolute)."""
    return [module.split(".")[0] for module in _modules_imported(path, package)]


def import_violations(package: Path = PACKAGE) -> list[str]:
    """``"<module> imports <group> (layer a > b)"`` for every import that goes up a layer."""
    problems = []
    for path in sorted(package.rglob("*.py")):
        own_key = path.relative_to(package).parts[0].removesuffix(".py")
        own = layer_of(own_key)
        for target in _imported(path, package):
            if layer_of(target) > own:
                problems.append(f"{path.relative_to(package)} imports {target} (layer {layer_of(target)} > {own})")
    return problems


def test_no_module_imports_from_a_higher_layer():
    assert import_violations() == []


def test_the_check_catches_an_upward_import(tmp_path):
    import shutil

    copy = tmp_path / "treegraft"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__", "*.cpp"))
    target = copy / "tree" / "buffers.py"
    target.write_text(target.read_text() + "\nfrom ..pipeline.artifacts import stage_dir  # deliberately upward\n")
    absolute = copy / "scheduling" / "signals.py"
    absolute.write_text(absolute.read_text() + "\nimport treegraft.decoding.budget\n")
    problems = import_violations(copy)
    assert problems == [
        "scheduling/signals.py imports decoding (layer 4 > 3)",
        "tree/buffers.py imports pipeline (layer 6 > 0)",
    ]


# what the decoding loop may import of the engines layer: the protocols and the data they hand over
ENGINE_INTERFACE = {"engines", "engines.protocols", "engines.logprobs"}


def engine_leaks(package: Path = PACKAGE) -> list[str]:
    """``"<module> imports <engine module>"`` for every decoding module that imports more of the engines
    layer than its protocols."""
    problems = []
    for path in sorted((package / "decoding").rglob("*.py")):
        for module in _modules_imported(path, package):
            if module.split(".")[0] == "engines" and module not in ENGINE_INTERFACE:
                problems.append(f"{path.relative_to(package)} imports {module}")
    return problems


def import_cycles(package: Path = PACKAGE) -> list[list[str]]:
    """Cycles among the package's modules (an import inside a function counts: it is still a dependency)."""
    def module_of(path: Path) -> str:
        rel = path.relative_to(package).with_suffix("")
        parts = list(rel.parts[:-1]) if rel.name == "__init__" else list(rel.parts)
        return ".".join(parts)

    files = {module_of(p): p for p in package.rglob("*.py")}
    graph = {}
    for name, path in files.items():
        deps = set()
        for module in _modules_imported(path, package):
            # `from .x import y` may name a submodule y or a name in x: take the longest module that exists
            while module and module not in files:
                module = module.rpartition(".")[0]
            if module and module != name and not name.startswith(module + ".") and module != "":
                deps.add(module)
        graph[name] = deps
    cycles, state = [], {}

    def visit(node, stack):
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                cycles.append(stack[stack.index(dep):] + [dep])
            elif dep not in state:
                visit(dep, stack)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    return cycles


def test_the_decoding_loop_imports_no_engine():
    assert engine_leaks() == []


def test_no_module_imports_itself_back():
    assert import_cycles() == []


def test_the_checks_catch_an_engine_import_and_a_cycle(tmp_path):
    import shutil

    copy = tmp_path / "treegraft"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__", "*.cpp"))
    loop = copy / "decoding" / "tree_decoder.py"
    loop.write_text(loop.read_text() + "\nfrom ..engines.torch.target import TorchTarget\n")
    costs = copy / "engines" / "llama_cpp" / "model.py"
    costs.write_text(costs.read_text() + "\nfrom .costs import model_key\n")
    assert engine_leaks(copy) == ["decoding/tree_decoder.py imports engines.torch.target"]
    assert [set(c) for c in import_cycles(copy)] == [{"engines.llama_cpp.costs", "engines.llama_cpp.model"}]


MAX_MODULE_LINES = 400  # a module longer than this holds more than one concern: split it by concern


def test_no_module_is_longer_than_the_limit():
    long = {str(p.relative_to(PACKAGE)): n for p in sorted(PACKAGE.rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert long == {}
