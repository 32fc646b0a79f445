"""The dependency rule: layers -> torch; parallel -> layers; moepar -> parallel, layers."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]


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
