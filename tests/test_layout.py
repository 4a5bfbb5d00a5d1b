"""The package's layering rules, checked on the source (see each subpackage's `__init__` docstring)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "rollout"
ENGINE_ONLY = "transformers.generation.continuous_batching"
# transformers keeps the attention implementation on a private config field with no public getter; scoring may read
# and set it (the attention interface), everything else goes through the engine
ATTENTION_FIELD = "_attn_implementation"


def sources() -> dict[str, ast.Module]:
    return {str(p.relative_to(ROOT.parent)): ast.parse(p.read_text(), str(p)) for p in sorted(ROOT.rglob("*.py"))}


def imported_modules(tree: ast.Module) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def own_private_names(trees: dict[str, ast.Module]) -> set[str]:
    """Every `_name` rollout itself defines (functions, classes, attributes it assigns, module globals)."""
    names = set()
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
    return {n for n in names if n.startswith("_")}


def test_only_the_engine_imports_transformers_continuous_batching():
    offenders = [path for path, tree in sources().items() if not path.startswith("rollout/engine/")
                 and any(m.startswith(ENGINE_ONLY) for m in imported_modules(tree))]
    assert offenders == []


def test_only_the_engine_touches_private_attributes_of_other_code():
    trees = sources()
    ours = own_private_names(trees)
    offenders = []
    for path, tree in trees.items():
        if path.startswith("rollout/engine/"):
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") or node.attr.startswith("__"):
                continue
            if node.attr in ours or (node.attr == ATTENTION_FIELD and path.startswith("rollout/scoring/")):
                continue
            if node.attr == "_timeout" and path == "rollout/fleet/collective.py":  # torch.distributed's, not transformers'
                continue
            offenders.append(f"{path}:{node.lineno} .{node.attr}")
    assert offenders == []


def test_only_the_fleet_imports_ray():
    offenders = [path for path, tree in sources().items() if not path.startswith("rollout/fleet/")
                 and any(m == "ray" or m.startswith("ray.") for m in imported_modules(tree))]
    assert offenders == []


def test_nothing_under_rollout_imports_the_trainers():
    offenders = [path for path, tree in sources().items()
                 if any(m.split(".")[0] == "trainers_integration" for m in imported_modules(tree))]
    assert offenders == []


def test_relative_imports_never_climb_from_a_lower_layer_to_a_higher_one():
    """engine <- worker <- fleet; scoring, cli and testing sit beside. The engine imports only leaf modules."""
    leaves = {"params", "config", "batch", "errors", "env", "moe"}
    for path, tree in sources().items():
        if not path.startswith("rollout/engine/"):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 2:
                assert (node.module or "").split(".")[0] in leaves, f"{path} imports rollout.{node.module}"


def test_the_public_names_still_import_from_the_top():
    rollout = importlib.import_module("rollout")
    for name in ("RolloutWorker", "RolloutFleet", "WorkerConfig", "SamplingParams", "RolloutBatch", "score",
                 "FleetResources"):
        assert getattr(rollout, name) is not None, name


def test_every_subpackage_says_what_it_owns_and_may_import():
    for package in ("engine", "fleet", "scoring", "cli", "testing"):
        doc = ast.get_docstring(ast.parse((ROOT / package / "__init__.py").read_text()))
        assert doc and "import" in doc, package
