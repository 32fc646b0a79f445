"""The distribution: every runtime import is declared with a tested lower bound, the wheel carries
the example configs, and `moepar train tiny` finds the packaged one from anywhere."""

import ast
import importlib.metadata
import os
import pathlib
import re
import subprocess
import sys
import tomllib
import zipfile

import pytest

from moepar.config import config_path, load_config

ROOT = pathlib.Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

# Needed at run time without an import of their own in moepar: torch.utils.tensorboard imports
# tensorboard and encodes images with Pillow, and torch declares neither.
INDIRECT = {"tensorboard": "torch.utils.tensorboard", "pillow": "TensorBoard images"}


def declared() -> dict[str, str]:
    """{normalized distribution name: lower bound} of [project] dependencies."""
    out = {}
    for req in PROJECT["dependencies"]:
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)>=([0-9][0-9.]*)", req.replace(" ", ""))
        assert match, f"{req!r}: declare a plain lower bound, name>=X.Y (tested by .ci/min-deps)"
        out[re.sub(r"[-_.]+", "-", match.group(1)).lower()] = match.group(2)
    return out


def third_party_imports() -> dict[str, set[str]]:
    """{top-level module: files importing it} for moepar/, layers/ and parallel/, including the
    imports inside functions (the lazy ones run too)."""
    found: dict[str, set[str]] = {}
    for folder in ("moepar", "layers", "parallel"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    if top not in sys.stdlib_module_names and top != "moepar":
                        found.setdefault(top, set()).add(str(path.relative_to(ROOT)))
    return found


def test_every_runtime_import_is_declared_and_nothing_else():
    modules = third_party_imports()
    assert {"torch", "numpy", "safetensors", "matplotlib"} <= set(modules)   # the walk works
    distributions = importlib.metadata.packages_distributions()
    needed = {}
    for module, files in modules.items():
        assert module in distributions, f"{module} (imported by {sorted(files)}) is not installed"
        for dist in distributions[module]:
            needed[re.sub(r"[-_.]+", "-", dist).lower()] = sorted(files)
    deps = declared()
    # A benchmark's import may come from an extra of its own (not "dev"): moepar[hf].
    extras = {re.sub(r"[-_.]+", "-", re.split(r"[<>=]", req)[0]).lower(): name
              for name, reqs in PROJECT["optional-dependencies"].items() if name != "dev"
              for req in reqs}
    assert all(files == ["moepar/bench/hf_baseline.py"] for d, files in needed.items()
               if d in extras and d not in deps), needed
    missing = {d: files for d, files in needed.items() if d not in deps and d not in extras}
    assert not missing, f"imported but not in [project] dependencies: {missing}"
    unused = set(deps) - set(needed) - set(INDIRECT)
    assert not unused, f"declared but never imported: {unused}"
    assert set(INDIRECT) <= set(deps)


def test_optional_dev_dependencies_have_lower_bounds_too():
    for req in PROJECT["optional-dependencies"]["dev"]:
        assert re.fullmatch(r"[A-Za-z0-9_.-]+>=[0-9][0-9.]*", req.replace(" ", "")), req


def test_torch_bound_admits_zero3():
    """The declared floor is at least the torch that parallel/zero.py needs for zero=3 at all."""
    from torch.torch_version import TorchVersion
    need = re.search(r"parallel.zero=3 needs torch >= ([0-9.]+)",
                     (ROOT / "parallel" / "zero.py").read_text())
    assert need, "parallel/zero.py's zero=3 version check moved; update this test"
    assert TorchVersion(declared()["torch"]) >= need.group(1)


def packages_on_disk() -> set[str]:
    """moepar and its sub-packages, as dotted names, from the folders holding __init__.py."""
    return {".".join(p.parent.relative_to(ROOT).parts)
            for p in (ROOT / "moepar").rglob("__init__.py")}


def test_pyproject_lists_every_package():
    """setuptools still copies an unlisted sub-package into the wheel (as package data of moepar,
    with a warning that a later release will stop), so the wheel alone misses a lacking entry."""
    found = packages_on_disk()
    assert {"moepar", "moepar.checkpoint", "moepar.hf"} <= found          # the walk works
    listed = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    missing = sorted(found - set(listed))
    assert not missing, f"add to [tool.setuptools] packages in pyproject.toml: {missing}"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> pathlib.Path:
    out = tmp_path_factory.mktemp("wheel")
    # No build isolation: the environment's own setuptools, nothing downloaded.
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps",
                             "--no-build-isolation", "-q", "-w", str(out)],
                            capture_output=True, text=True, timeout=300, cwd=out)
    assert result.returncode == 0, result.stderr[-3000:]
    (path,) = out.glob("moepar-*.whl")
    return path


def test_wheel_carries_the_example_configs_and_every_package(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    examples = sorted(p.name for p in (ROOT / "examples").glob("*.toml"))
    assert examples
    for name in examples:
        assert f"moepar/examples/{name}" in names, name
    for package in (*(p.replace(".", "/") for p in packages_on_disk()), "moepar/layers",
                    "moepar/parallel"):
        assert f"{package}/__init__.py" in names, package
    assert not any(n.startswith(("layers/", "parallel/", "examples/")) for n in names)
    # pip builds in ROOT/build, and setuptools never removes a module deleted from the source
    # since the last build (moepar/checkpoint.py, now a package): the wheel would ship it
    folders = {"moepar/layers/": "layers/", "moepar/parallel/": "parallel/",
               "moepar/examples/": "examples/"}
    for name in sorted(n for n in names if n.endswith(".py")):
        src = next((name.replace(w, s, 1) for w, s in folders.items() if name.startswith(w)), name)
        assert (ROOT / src).is_file(), f"the wheel carries {name}, which has no {src}: " \
                                       f"a stale file in {ROOT / 'build'} (delete that folder)"
    metadata = zipfile.ZipFile(wheel).read(
        next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    requires = {line.split(": ", 1)[1] for line in metadata.splitlines()
                if line.startswith("Requires-Dist:") and "extra ==" not in line}
    assert requires == set(PROJECT["dependencies"])


def test_train_tiny_runs_the_packaged_config_from_the_installed_wheel(wheel, tmp_path):
    """Installed from the wheel (not this checkout), run from a folder with no examples/."""
    site = tmp_path / "site"
    result = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                             "--target", str(site), str(wheel)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    work = tmp_path / "work"
    work.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site)}
    where = subprocess.run([sys.executable, "-c", "import moepar, moepar.config as c; "
                            "print(moepar.__file__); print(c.config_path('tiny'))"],
                           capture_output=True, text=True, cwd=work, env=env, timeout=120)
    assert where.returncode == 0, where.stderr[-2000:]
    module, config = where.stdout.split()
    assert module.startswith(str(site)) and config == str(site / "moepar/examples/tiny.toml")
    result = subprocess.run(
        [sys.executable, "-m", "moepar", "train", "tiny", "--train.steps=1",
         "--train.global_batch_size=4", "--train.micro_batch_size=4", "--train.warmup_steps=1",
         "--run.dir=run", "--run.tensorboard=false", "--run.log_every=1"],
        capture_output=True, text=True, cwd=work, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "step     1/1" in result.stdout
    saved = load_config(str(work / "run" / "config.toml"))
    assert (saved.model.num_layers, saved.model.num_experts) == (4, 8)   # examples/tiny.toml


def test_config_names_resolve_to_packaged_examples(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert config_path("tiny") == config_path("tiny.toml")
    packaged = pathlib.Path(config_path("tiny"))
    assert packaged.read_text() == (ROOT / "examples/tiny.toml").read_text()
    (tmp_path / "tiny").write_text("")                # a file of that name wins
    assert config_path("tiny") == "tiny"
    assert config_path("sub/tiny.toml") == "sub/tiny.toml"       # a path is never an example
    with pytest.raises(ValueError, match="'nope' does not exist, and it is not one of the "
                                         "packaged examples: .*tiny"):
        load_config("nope")


@pytest.mark.skipif(os.environ.get("MOEPAR_MIN_DEPS") != "1",
                    reason="installs the minimum versions in a scratch venv (minutes, a ~4 GB "
                           "torch download unless MOEPAR_MIN_TORCH is set); MOEPAR_MIN_DEPS=1 "
                           "runs it")
@pytest.mark.timeout(3600)
def test_unit_tests_pass_on_the_minimum_versions(tmp_path):
    result = subprocess.run([str(ROOT / ".ci" / "min-deps"), str(tmp_path / "venv")],
                            capture_output=True, text=True, timeout=3600)
    assert result.returncode == 0, (result.stdout + result.stderr)[-5000:]
