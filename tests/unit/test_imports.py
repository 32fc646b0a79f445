"""The import rules (docs/testing.md, "Import rules"), read from the source's AST:

- direction: layers -> torch; parallel -> layers; moepar -> parallel, layers;
- the engine (the modules a training run needs) imports no tool package;
- no import cycle between modules, counting imports inside functions;
- an import inside a function only where LAZY says why (a heavy import kept out of start-up).
"""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
# Source folder -> installed package (pyproject.toml's package-dir).
PACKAGES = {"moepar": "moepar", "layers": "moepar.layers", "parallel": "moepar.parallel"}

# Imports left inside functions: (importing module, imported module or its parent) -> why.
LAZY = {
    ("moepar", "moepar.infer.generate"):
        "`import moepar` runs before every submodule: moepar.from_hf/load import the tool on use",
    ("moepar.plots", "matplotlib"): "matplotlib; only drawing a picture needs it",
    ("moepar.metrics", "torch.utils.tensorboard"):
        "TensorBoard's writer (protobuf); only with run.tensorboard",
    ("moepar.data.bpe", "tokenizers"): "Hugging Face tokenizers; only to train a BPE",
    ("moepar.data.tokenizer", "tokenizers"): "Hugging Face tokenizers; only for tokenizer.json",
    ("moepar.infer.source", "tokenizers"): "Hugging Face tokenizers; only for tokenizer.json",
    ("moepar.parallel.zero", "torch.distributed.fsdp"):
        "FSDP2 pulls in torch's compiler (seconds); only parallel.zero=3 needs it",
    ("moepar.parallel.zero", "torch.distributed.tensor"): "DTensor, with FSDP2: zero=3 only",
    ("moepar.bench.fakeworld", "torch.testing._internal"):
        "torch's test package (the fake process group); only `bench memory --simulate`",
    ("moepar.bench.hf_baseline", "transformers"):
        "transformers (seconds to import); only `bench train --against-hf` builds its Mixtral",
    ("moepar.data.tokens", "pydoc_data"): "Python's 0.8 MB help text, the built-in sample corpus",
    ("moepar.data.split", "moepar.config"):
        "moepar.config imports torch: `moepar data prepare` and its workers never load it",
}
# The engine: what a training run needs. It never imports a tool (a command built on it).
ENGINE = ("moepar.train", "moepar.build", "moepar.checkpoint", "moepar.metrics", "moepar.process",
          "moepar.rundir", "moepar.config", "moepar.data", "moepar.validation", "moepar.plots")
TOOLS = ("moepar.plan", "moepar.bench", "moepar.inspect", "moepar.hf", "moepar.infer")


def module_name(path: pathlib.Path) -> str:
    """The installed name of a source file: layers/moe.py -> moepar.layers.moe."""
    rel = path.relative_to(ROOT)
    parts = [PACKAGES[rel.parts[0]], *rel.with_suffix("").parts[1:]]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def source_modules() -> dict[str, pathlib.Path]:
    return {module_name(p): p for folder in PACKAGES
            for p in sorted((ROOT / folder).glob("**/*.py"))}


def imports(path: pathlib.Path, modules) -> list[tuple[str, int, bool]]:
    """(imported module, line, inside a function) for every import of the file, relative ones
    resolved; `from package import name` names the submodule when `name` is one."""
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    found = []

    def visit(node, in_function: bool):
        for child in ast.iter_child_nodes(node):
            inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                       ast.Lambda))
            if isinstance(child, ast.Import):
                found.extend((a.name, child.lineno, in_function) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    up = package.split(".")[:len(package.split(".")) - (child.level - 1)]
                    base = ".".join(up + ([child.module] if child.module else []))
                for a in child.names:
                    sub = f"{base}.{a.name}"
                    found.append((sub if sub in modules else base, child.lineno, in_function))
            visit(child, inside)

    visit(ast.parse(path.read_text(), filename=str(path)), False)
    return found


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of moepar it imports, anywhere in the file."""
    modules = source_modules()
    return {name: {m for m, _, _ in imports(path, modules) if m in modules and m != name}
            for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None (depth-first search, three colours)."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def imported_modules(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_layers_never_import_torch_distributed_or_upper_packages():
    files = sorted((ROOT / "layers").glob("**/*.py"))
    assert files
    for path in files:
        for name in imported_modules(path):
            assert not name.startswith("torch.distributed"), f"{path.name} imports {name}"
            assert not name.startswith(("moepar", "parallel")), f"{path.name} imports {name}"


def test_parallel_never_imports_moepar_top_level():
    for path in sorted((ROOT / "parallel").glob("**/*.py")):
        for name in imported_modules(path):
            assert not (name.startswith("moepar") and not name.startswith("moepar.layers")), \
                f"{path.name} imports {name}"


def test_scanner_catches_a_violation(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import torch.distributed as dist\nfrom torch.distributed import all_reduce\n")
    assert {"torch.distributed", "torch.distributed.all_reduce"} <= imported_modules(bad)


def test_installed_names_are_namespaced(monkeypatch):
    """The install maps layers/ and parallel/ under moepar; neither is importable on its own."""
    import importlib.util
    import sys

    import moepar.layers
    import moepar.parallel
    assert moepar.layers.MoE.__module__ == "moepar.layers.moe"
    assert pathlib.Path(moepar.layers.__file__).parent.name == "layers"
    # Look only where the installation puts things, not in this checkout (the test's cwd).
    monkeypatch.setattr(sys, "path", [p for p in sys.path
                                      if p not in ("", ".") and pathlib.Path(p).resolve() != ROOT])
    for name in ("layers", "parallel"):
        sys.modules.pop(name, None)
        assert importlib.util.find_spec(name) is None, name


def test_every_internal_import_names_a_module_that_exists():
    modules = source_modules()
    for name, path in modules.items():
        for target, line, _ in imports(path, modules):
            if target.startswith("moepar"):
                assert target in modules, f"{path.relative_to(ROOT)}:{line} imports {target}"


def test_no_import_cycle_even_through_function_level_imports():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_cycle_finder_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_function_level_imports_only_where_they_keep_a_heavy_import_out_of_startup():
    modules = source_modules()
    used = set()
    for name, path in modules.items():
        for target, line, in_function in imports(path, modules):
            if not in_function:
                continue
            key = next((k for k in LAZY if k[0] == name
                        and (target == k[1] or target.startswith(k[1] + "."))), None)
            assert key is not None, (f"{path.relative_to(ROOT)}:{line} imports {target} inside a "
                                     "function: move it to the top of the file (or add it to "
                                     "LAZY with the reason, if it keeps a heavy import out of "
                                     "start-up)")
            used.add(key)
    assert used == set(LAZY), f"LAZY entries no file needs any more: {set(LAZY) - used}"


def test_no_private_name_is_imported_across_modules():
    """A name with a leading underscore belongs to its file: one used elsewhere is made public
    or moves beside its user."""
    for path in source_modules().values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                private = [a.name for a in node.names
                           if a.name.startswith("_") and not a.name.startswith("__")]
                assert not private, f"{path.relative_to(ROOT)}:{node.lineno} imports {private}"


def test_data_prepare_never_loads_torch():
    """`moepar data prepare` starts worker processes; none of them needs torch (~3 s each)."""
    import subprocess
    import sys
    code = "import sys, moepar.data.cli; print(sorted(m for m in sys.modules if m == 'torch'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_engine_imports_no_tool_even_indirectly():
    """Following every import (inside functions too) from an engine module never reaches a tool.
    The package root `moepar` is not followed: every module imports it, and its from_hf/load
    reach the tools only when called (LAZY)."""
    graph = import_graph()
    engine = [m for m in graph if any(m == e or m.startswith(e + ".") for e in ENGINE)]
    assert "moepar.train" in engine and "moepar.checkpoint.save" in engine
    for start in engine:
        came_from, todo = {start: None}, [start]
        while todo:
            node = todo.pop()
            for nxt in graph[node] - {"moepar"}:
                if nxt not in came_from:
                    came_from[nxt] = node
                    todo.append(nxt)
        for tool in (m for m in came_from if any(m == t or m.startswith(t + ".") for t in TOOLS)):
            path = [tool]
            while came_from[path[-1]] is not None:
                path.append(came_from[path[-1]])
            raise AssertionError("the engine imports a tool: " + " -> ".join(reversed(path)))
