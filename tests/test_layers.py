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
    {"scheduling"},
    {"decoding"},
    {"llama_cpp"},  # the second engine: over the decoder's seam
    {"pipeline"},
    {"generate", "__init__"},
]


def layer_of(key: str) -> int:
    for i, names in enumerate(LAYERS):
        if key in names:
            return i
    raise KeyError(f"module group {key!r} has no layer: add it to LAYERS")


def _imported(path: Path, package: Path, name: str) -> list[str]:
    """The first package component of every module ``path`` imports from ``name`` (relative or absolute)."""
    rel = path.relative_to(package).with_suffix("")
    here = list(rel.parts[:-1])  # the importing module's package, relative to the root package
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - (node.level - 1)] if node.level > 1 else list(here)
                parts = base + (node.module.split(".") if node.module else [])
                if not parts:  # `from . import x` at the top level
                    parts = [alias.name for alias in node.names][:1]
            elif node.module and node.module.split(".")[0] == name:
                parts = node.module.split(".")[1:]
            else:
                continue
            if parts:
                out.append(parts[0])
        elif isinstance(node, ast.Import):
            for alias in node.names:
                bits = alias.name.split(".")
                if bits[0] == name and len(bits) > 1:
                    out.append(bits[1])
    return out


def import_violations(package: Path = PACKAGE) -> list[str]:
    """``"<module> imports <group> (layer a > b)"`` for every import that goes up a layer."""
    name = package.name
    problems = []
    for path in sorted(package.rglob("*.py")):
        own_key = path.relative_to(package).parts[0].removesuffix(".py")
        own = layer_of(own_key)
        for target in _imported(path, package, name):
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
        "scheduling/signals.py imports decoding (layer 3 > 2)",
        "tree/buffers.py imports pipeline (layer 5 > 0)",
    ]
