"""The layering of ARCHITECTURE.md holds: no module imports a higher layer, no two packages of one layer import
each other, and no import cycle exists. Every import counts, also those inside functions; only imports under
`if TYPE_CHECKING:` (annotations, never run) are exempt.

Also: every `Literal` of choices left in the config equals the registry that implements it (fields that name
an extension point's registry have no Literal: tests/test_registries.py).
"""

from __future__ import annotations

import ast
import importlib
import shutil
import subprocess
import typing
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
# Bottom to top; packages on one line (a tuple) share a layer and must not import each other.
LAYERS = ["utils", "config", "data", "nn", "diffusion", "runs", ("diagnostics", "metrics"), "train", "experiments",
          "cli"]


def _layer_of() -> dict[str, int]:
    out = {}
    for i, entry in enumerate(LAYERS):
        for name in entry if isinstance(entry, tuple) else (entry,):
            out[name] = i
    return out


def module_imports(path: Path, module: str, is_package: bool) -> set[str]:
    """Absolute names of every package module `path` imports (anywhere but under `if TYPE_CHECKING:`)."""
    tree = ast.parse(path.read_text())
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    here = module.split(".") if is_package else module.split(".")[:-1]
    found = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = here[: len(here) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            if node.module is None:  # `from . import x`: x may be a submodule
                found |= {f"{target}.{a.name}" for a in node.names}
            else:
                found.add(target)
    return found


def package_graph(src: Path, top: str) -> dict[str, set[str]]:
    """{module: the package's modules it imports} for every module of package `top` under `src`."""
    modules = {}
    for path in sorted((src / top).rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        modules[".".join(parts)] = (path, is_package)
    graph = {}
    for name, (path, is_package) in modules.items():
        deps = set()
        for imp in module_imports(path, name, is_package):
            while imp and imp not in modules:  # `from pkg.mod import name` names a module or a symbol in it
                imp = imp.rpartition(".")[0]
            if imp and imp != name:
                deps.add(imp)
        graph[name] = deps
    return graph


def layering_violations(graph: dict[str, set[str]], layers: list) -> list[str]:
    layer = {}
    for i, entry in enumerate(layers):
        for name in entry if isinstance(entry, tuple) else (entry,):
            layer[name] = i
    problems = []
    for mod, deps in sorted(graph.items()):
        parts = mod.split(".")
        if len(parts) == 1 or parts[1] in ("__main__",):
            continue  # the package root and `python -m` entry point
        for dep in sorted(deps):
            dparts = dep.split(".")
            if len(dparts) == 1 or parts[1] == dparts[1]:
                continue
            a, b = layer.get(parts[1]), layer.get(dparts[1])
            if a is None or b is None:
                problems.append(f"{mod} -> {dep}: {parts[1] if a is None else dparts[1]} is in no layer")
            elif b > a:
                problems.append(f"{mod} -> {dep}: imports upward ({parts[1]} is below {dparts[1]})")
            elif a == b:
                problems.append(f"{mod} -> {dep}: {parts[1]} and {dparts[1]} share a layer and must not import "
                                "each other")
    return problems


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every elementary cycle found by a depth-first search (one per back edge)."""
    cycles, state, stack = [], {}, []

    def visit(node: str) -> None:
        state[node] = "open"
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == "open":
                cycles.append(stack[stack.index(dep):] + [dep])
            elif dep not in state:
                visit(dep)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return cycles


def test_every_package_has_a_layer():
    packages = {p.stem if p.is_file() else p.name for p in (SRC / "steadydiff").iterdir()
                if (p.is_dir() and (p / "__init__.py").exists()) or (p.suffix == ".py" and p.stem != "__init__")}
    assert packages - {"__main__"} == set(_layer_of()), "place every package in LAYERS (and ARCHITECTURE.md)"


@pytest.mark.skipif(shutil.which("git") is None or not (SRC.parent / ".git").exists(), reason="not a git checkout")
def test_no_source_or_test_file_is_git_ignored():
    # A broad .gitignore pattern (once `runs/`) silently kept src/steadydiff/runs out of every commit; the tree
    # worked here and failed on a fresh clone.
    root = SRC.parent
    files = [str(p.relative_to(root)) for d in ("src", "tests") for p in (root / d).rglob("*.py")
             if "__pycache__" not in p.parts]
    ignored = subprocess.run(["git", "check-ignore", "--no-index", *files], cwd=root, capture_output=True,
                             text=True).stdout.split()
    assert not ignored, f"git ignores these source files: {ignored}"


def test_no_upward_or_sideways_imports():
    assert layering_violations(package_graph(SRC, "steadydiff"), LAYERS) == []


def test_no_import_cycles():
    assert import_cycles(package_graph(SRC, "steadydiff")) == []


def test_architecture_md_lists_the_layers_in_order():
    text = (SRC.parent / "ARCHITECTURE.md").read_text()
    positions = [text.index(f"`{name}`") for entry in LAYERS for name in (entry if isinstance(entry, tuple)
                                                                             else (entry,))]
    assert positions == sorted(positions)


def test_the_checker_finds_upward_imports_and_cycles(tmp_path):
    pkg = tmp_path / "toy"
    for rel, text in {
        "__init__.py": "",
        "low/__init__.py": "",
        "low/a.py": "from ..high import b\n",  # upward
        "low/c.py": "from . import d\n",  # cycle c -> d -> c
        "low/d.py": "def f():\n    from .c import g\n",
        "low/e.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..high import b\n",  # exempt
        "high/__init__.py": "",
        "high/b.py": "from ..low import e\n",  # downward: fine
        "side/__init__.py": "from ..high.b import x\n",  # same layer as high
    }.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(text)
    graph = package_graph(tmp_path, "toy")
    assert graph["toy.low.a"] == {"toy.high"} and graph["toy.low.d"] == {"toy.low.c"}
    assert graph["toy.low.e"] == set()
    problems = layering_violations(graph, ["low", ("high", "side")])
    assert any("toy.low.a -> toy.high: imports upward" in p for p in problems)
    assert any("toy.side -> toy.high.b" in p and "share a layer" in p for p in problems)
    assert not any("toy.high.b" == p.split(" ")[0] for p in problems)
    assert import_cycles(graph) == [["toy.low.c", "toy.low.d", "toy.low.c"]]


# ---------------------------------------------------------------------------------------------------------
# Config choices == registries


def _choices(section: type, name: str) -> tuple:
    tp = typing.get_type_hints(section)[name]
    while typing.get_origin(tp) is not typing.Literal:
        tp = typing.get_args(tp)[0]
    return typing.get_args(tp)


@pytest.mark.parametrize("field, module, registry", [
    ("model.skip_scaling", "steadydiff.nn", "SKIP_SCALING_METHODS"),
    ("data.name", "steadydiff.data", "DATASET_NAMES"),
    ("data.toy", "steadydiff.data", "TOY_KINDS"),
    ("diffusion.t_sampling", "steadydiff.diffusion.flow", "T_SAMPLINGS"),
    ("diffusion.weighting", "steadydiff.diffusion.vp", "WEIGHTINGS"),
])
def test_config_choices_equal_their_registry(field, module, registry):
    from steadydiff import config

    section, name = field.split(".")
    cls = typing.get_type_hints(config.Config)[section]
    assert set(_choices(cls, name)) == set(getattr(importlib.import_module(module), registry)), field


def test_resumable_fields_are_metadata_and_only_they_may_change_on_resume():
    from steadydiff.config import config_differences, load_config, resumable_keys

    keys = resumable_keys()
    assert {"train.steps", "train.eval_metrics", "debug.fault_steps", "model.grad_checkpointing",
            "diagnostics.probe_every", "diagnostics.tensorboard"} <= keys
    assert not keys & {"train.lr", "train.seed", "train.batch_size", "model.kappa", "data.name", "diffusion.kind"}
    a = load_config(None, ["train.steps=10"])
    b = load_config(None, ["train.steps=20", "diagnostics.probe_every=5", "train.compile=true", "train.lr=1e-3"])
    assert config_differences(a, b) == ["train.lr: 0.0002 -> 0.001"]
