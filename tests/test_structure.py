"""The package's import graph: no cycle, and every arrow points down, from the
entry points to the API, the registration, the backends and the kernels."""

import ast
import pathlib

import kda_ops

PACKAGE = pathlib.Path(kda_ops.__file__).parent
# Layers, top to bottom: a module may import only from layers below its own.
LAYERS = [
    {"kda_ops.__main__", "kda_ops.bench", "kda_ops.transformers.bench"},
    {"kda_ops", "kda_ops.transformers"},
    {"kda_ops.models", "kda_ops.planner", "kda_ops._cli", "kda_ops.transformers.cache"},
    {"kda_ops.api", "kda_ops.transformers.model"},
    {"kda_ops.ops", "kda_ops.value_checks"},
    {"kda_ops.torch_impl", "kda_ops.naive",
     "kda_ops.kernels.verify", "kda_ops.kernels.commit", "kda_ops.kernels.staging"},
    {"kda_ops.kernels.verify_tensor_cores", "kda_ops.kernels.conv", "kda_ops._validation"},
    {"kda_ops.kernels.common", "kda_ops.kernels.dispatch"},
    {"kda_ops.constants", "kda_ops.kernels"},
]


def module_name(path):
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path):
    """The kda_ops modules that `path` imports (a `from .x import y` of a
    module y counts as importing x.y)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                found.add(candidate if (PACKAGE.parent / (candidate.replace(".", "/") + ".py"))
                          .exists() else base)
    return {m for m in found if m == "kda_ops" or m.startswith("kda_ops.")}


def test_every_module_has_a_layer():
    modules = {module_name(p) for p in PACKAGE.rglob("*.py")}
    placed = set().union(*LAYERS)
    assert modules == placed, (f"unplaced: {sorted(modules - placed)}, "
                               f"gone: {sorted(placed - modules)}")


def test_imports_point_down():
    rank = {module: depth for depth, layer in enumerate(LAYERS) for module in layer}
    upward = [f"{module_name(p)} -> {target}" for p in PACKAGE.rglob("*.py")
              for target in imports_of(p) if rank[target] <= rank[module_name(p)]]
    assert upward == []
