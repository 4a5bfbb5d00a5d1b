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
UPSTREAM_ROOM = "rollout/engine/upstream/"  # the one room for transformers' private continuous-batching code


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


def test_only_the_engines_upstream_room_imports_transformers_continuous_batching():
    offenders = [path for path, tree in sources().items() if not path.startswith(UPSTREAM_ROOM)
                 and any(m.startswith(ENGINE_ONLY) for m in imported_modules(tree))]
    assert offenders == []


def test_only_the_engines_upstream_room_touches_private_attributes_of_other_code():
    trees = sources()
    ours = own_private_names(trees)
    offenders = []
    for path, tree in trees.items():
        if path.startswith(UPSTREAM_ROOM):
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") or node.attr.startswith("__"):
                continue
            if node.attr in ours or (node.attr == ATTENTION_FIELD and path.startswith("rollout/scoring/")):
                continue
            if node.attr == "_timeout" and path == "rollout/fleet/collective.py":  # torch.distributed's, not transformers'
                continue
            if node.attr in ("_linear_pointwise", "_reorder_linear_weight", "_version") and \
                    path == "rollout/engine/kernels/onednn.py":  # torch's oneDNN linear op, its weight packing, the tensor
                continue  # version counter: pinned by tests/test_onednn.py (test_the_private_op_*, test_a_packed_*)
            if node.attr == "_scaled_dot_product_flash_attention_for_cpu" and \
                    path == "rollout/engine/attention/paged.py":  # torch's CPU flash kernel (HOOKS lists it)
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


# Every arrow between rollout's folders (a package may import itself and what is listed; "(top)" is rollout/__init__).
# base <- moe <- engine <- model <- worker <- fleet; scoring, metrics, envs and the collector beside; server, cli on top.
ALLOWED = {
    "base": set(),
    "moe": {"base"},
    "engine": {"base", "moe"},
    "model": {"base", "engine"},  # engine.streams: the counter-based hash the fingerprint shares
    "metrics": {"base"},
    "envs": {"base"},
    "scoring": {"base", "moe", "model"},
    "collector": {"base", "model"},  # a worker or a fleet only through the Rollouts contract
    "worker": {"base", "moe", "engine", "model", "metrics", "scoring"},
    "fleet": {"base", "moe", "model", "metrics", "worker", "scoring"},  # never the engine's internals
    "server": {"base", "model"},  # any Rollouts, worker or fleet, through the contract
    "cli": {"(top)", "base", "model", "metrics", "scoring", "worker", "fleet", "server"},
    "testing": set(),
    "(top)": {"base", "moe", "model", "worker", "fleet", "collector", "envs", "server", "scoring"},
}
MAX_TOP_LEVEL_MODULES = 8


def runtime_imports(tree: ast.Module) -> list[ast.ImportFrom]:
    """The ImportFrom nodes of a module, less those under `if TYPE_CHECKING:` (a type named, no runtime arrow)."""
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            skipped.update(id(n) for child in node.body for n in ast.walk(child))
    return [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and id(n) not in skipped]


def room_arrows(package: Path, top: str, with_top: bool) -> dict[tuple[str, str], set[str]]:
    """(importing room, imported room) -> the files that import across, for every import inside `package` (a folder
    of rollout/): a room is a subfolder of it, `top` names its top-level modules (whose own imports are counted only
    `with_top`)."""
    prefix = list(package.relative_to(ROOT.parent).parts)  # ["rollout"], ["rollout", "engine"], ...
    arrows: dict[tuple[str, str], set[str]] = {}
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package).parts
        room = rel[0] if len(rel) > 1 else top
        if room == top and not with_top:
            continue
        here = prefix + list(rel[:-1])
        for node in runtime_imports(ast.parse(path.read_text(), str(path))):
            if node.level:
                target = here[: len(here) - node.level + 1] + (node.module.split(".") if node.module else [])
            elif node.module:
                target = node.module.split(".")
            else:
                continue
            if target[: len(prefix)] != prefix:
                continue
            names = [target[len(prefix)]] if len(target) > len(prefix) else [a.name for a in node.names]
            for name in names:
                kind = name if (package / name).is_dir() else top
                if kind != room:
                    arrows.setdefault((room, kind), set()).add(str(path.relative_to(ROOT.parent)))
    return arrows


def package_arrows() -> dict[tuple[str, str], set[str]]:
    """(importing folder, imported folder) -> the files that import across, for every import inside rollout/."""
    return room_arrows(ROOT, "(top)", with_top=True)


def test_every_import_between_folders_is_an_allowed_arrow():
    arrows = package_arrows()
    assert set(ALLOWED) >= {folder for folder, _ in arrows}, "a new folder needs its row in ALLOWED"
    offenders = {f"{a} -> {b}": sorted(files) for (a, b), files in arrows.items() if b not in ALLOWED[a]}
    assert offenders == {}


def test_the_allowed_arrows_point_one_way():
    """No cycle between folders: each layer is usable without those above it."""
    done, visiting = set(), set()

    def visit(folder: str, path: tuple[str, ...]) -> None:
        assert folder not in visiting, f"cycle: {' -> '.join(path)}"
        if folder in done:
            return
        visiting.add(folder)
        for below in ALLOWED[folder]:
            visit(below, path + (below,))
        visiting.discard(folder)
        done.add(folder)

    for folder in ALLOWED:
        visit(folder, (folder,))


def test_the_top_level_holds_few_modules_and_every_folder_is_a_package():
    modules = sorted(p.name for p in ROOT.glob("*.py"))
    assert len(modules) <= MAX_TOP_LEVEL_MODULES, modules
    folders = sorted(p.name for p in ROOT.iterdir() if p.is_dir() and p.name != "__pycache__")
    assert set(folders) == set(ALLOWED) - {"(top)"}
    for folder in folders:
        assert (ROOT / folder / "__init__.py").exists(), folder


def test_trainers_import_only_public_rollout_names():
    """trainers_integration uses rollout as a user would: names in `__all__` of rollout, rollout.base or
    rollout.testing."""
    public = {m: set(importlib.import_module(m).__all__) for m in ("rollout", "rollout.base", "rollout.testing")}
    offenders = []
    for path in sorted((ROOT.parent / "trainers_integration").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                offenders += [f"{path.name}: import {a.name}" for a in node.names
                              if a.name.split(".")[0] == "rollout" and a.name not in public]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and \
                    node.module.split(".")[0] == "rollout":
                names = public.get(node.module)
                offenders += [f"{path.name}: from {node.module} import {a.name}" for a in node.names
                              if names is None or a.name not in names]
    assert offenders == []


def test_the_public_names_still_import_from_the_top():
    rollout = importlib.import_module("rollout")
    for name in rollout.__all__:
        assert getattr(rollout, name) is not None, name


def test_every_subpackage_says_what_it_owns_and_may_import():
    for package in sorted(set(ALLOWED) - {"(top)"}):
        doc = ast.get_docstring(ast.parse((ROOT / package / "__init__.py").read_text()))
        assert doc and "import" in doc, package


# The engine's rooms (rollout/engine/<room>/) and what each may import of the others; the engine's top-level modules
# (engine.py, supervisor.py, fence.py, ...) wire the rooms together and no room imports them. Imports under
# `if TYPE_CHECKING:` name a type only and are not arrows.
ENGINE = ROOT / "engine"
ENGINE_ROOMS = {
    "upstream": set(),  # subclasses and hooks of transformers; what it runs of the engine's is handed in
    "kernels": set(),
    "device": {"upstream"},
    "attention": {"upstream", "kernels", "device"},
    "sampling": {"upstream"},
    "observe": {"upstream"},
    "requests": {"sampling", "upstream"},
    "episodes": {"requests", "sampling", "observe"},
    "speculation": {"sampling", "upstream"},
}
MAX_ENGINE_TOP_LEVEL_MODULES = 10


def engine_arrows() -> dict[tuple[str, str], set[str]]:
    """(room, imported room or "(engine top)") -> files, for every import between the engine's rooms."""
    return room_arrows(ENGINE, "(engine top)", with_top=False)


def test_the_engine_is_rooms_with_one_way_arrows():
    rooms = sorted(p.name for p in ENGINE.iterdir() if p.is_dir() and p.name != "__pycache__")
    assert set(rooms) == set(ENGINE_ROOMS), "a new room needs its row in ENGINE_ROOMS"
    offenders = {f"{a} -> {b}": sorted(files) for (a, b), files in engine_arrows().items()
                 if b not in ENGINE_ROOMS[a]}
    assert offenders == {}


def test_the_engine_rooms_point_one_way_and_say_what_they_own():
    done: set[str] = set()

    def visit(room: str, path: tuple[str, ...]) -> None:
        assert room not in path[:-1], f"cycle: {' -> '.join(path)}"
        if room in done:
            return
        for below in ENGINE_ROOMS[room]:
            visit(below, path + (below,))
        done.add(room)

    for room in ENGINE_ROOMS:
        visit(room, (room,))
        doc = ast.get_docstring(ast.parse((ENGINE / room / "__init__.py").read_text()))
        assert doc and "import" in doc, room


def test_the_engine_top_level_holds_at_most_10_modules():
    modules = sorted(p.name for p in ENGINE.glob("*.py"))
    assert len(modules) <= MAX_ENGINE_TOP_LEVEL_MODULES, modules


def test_upstream_imports_nothing_of_the_engine_outside_it():
    """What a hook runs that is the engine's own is handed in at construction, never imported from upstream/."""
    offenders = sorted(f"{a} -> {b}: {sorted(files)}" for (a, b), files in engine_arrows().items() if a == "upstream")
    assert offenders == []


def test_only_upstream_install_changes_process_wide_state():
    """torch's and transformers' module state (a class's method, a module's function) is assigned only in
    rollout/engine/upstream/patches.py (and upstream's registries, through its `install`)."""
    offenders = []
    for path, tree in sources().items():
        if path == "rollout/engine/upstream/patches.py":
            continue
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] \
                if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            for target in targets:
                if isinstance(target, ast.Attribute) and ast.unparse(target).startswith(("torch.", "transformers.")):
                    offenders.append(f"{path}:{node.lineno} {ast.unparse(target)}")
                if isinstance(target, ast.Attribute) and target.attr in ("forward", "apply_rotary_pos_emb") and \
                        isinstance(target.value, ast.Name) and target.value.id in ("cls", "module"):
                    offenders.append(f"{path}:{node.lineno} {ast.unparse(target)}")
    assert offenders == []


def test_no_error_is_swallowed_whole():
    """No `suppress(BaseException)` (it eats Ctrl-C and SystemExit) anywhere under rollout/."""
    offenders = []
    for path, tree in sources().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and ast.unparse(node.func).endswith("suppress") and \
                    any(ast.unparse(a) == "BaseException" for a in node.args):
                offenders.append(f"{path}:{node.lineno}")
    assert offenders == []


MAX_TEST_REACHES_INTO_THE_ENGINE = 10


def test_tests_read_the_engine_through_its_inspection_api():
    """Tests reach into the engine's private state (`engine._x`, `worker.engine._x`) at most 10 times: what they read
    is the engine's inspection API (`Engine.in_flight()`, `Engine.manager`, ...)."""
    reaches = []
    for path in sorted((ROOT.parent / "tests").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                owner = node.value
                name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
                if name == "engine":
                    reaches.append(f"{path.name}:{node.lineno} .{node.attr}")
    assert len(reaches) <= MAX_TEST_REACHES_INTO_THE_ENGINE, reaches


# The server's own layers, by the API each serves: a subpackage may import itself and what is listed; "(top)" is the
# server's top modules (`__init__`, `app`, `server`), which may import every subpackage and which none imports.
SERVER = ROOT / "server"
SERVER_ALLOWED = {
    "transport": set(),
    "rollouts": set(),
    "completions": {"transport", "rollouts"},
    "responses": {"transport", "rollouts", "completions"},
    "admin": {"transport"},
    "sglang": {"transport", "rollouts", "completions"},
}
MAX_SERVER_TOP_LEVEL_MODULES = 8


def server_arrows() -> dict[tuple[str, str], set[str]]:
    """(importing subpackage, imported subpackage or "(top)") -> the files that import across, inside rollout/server."""
    return room_arrows(SERVER, "(top)", with_top=False)


def test_the_server_top_level_holds_at_most_8_modules():
    modules = sorted(p.name for p in SERVER.glob("*.py"))
    assert len(modules) <= MAX_SERVER_TOP_LEVEL_MODULES, modules


def test_each_server_subpackage_imports_only_its_allowed_siblings():
    folders = {p.name for p in SERVER.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders == set(SERVER_ALLOWED), "a new server subpackage needs its row in SERVER_ALLOWED"
    for folder in folders:
        doc = ast.get_docstring(ast.parse((SERVER / folder / "__init__.py").read_text()))
        assert doc and "import" in doc, folder
    offenders = {f"{a} -> {b}": sorted(files) for (a, b), files in server_arrows().items()
                 if b not in SERVER_ALLOWED[a]}
    assert offenders == {}


def test_a_test_module_imports_helpers_from_conftest_never_from_another_test_module():
    offenders = []
    for path in sorted(Path(__file__).resolve().parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
            offenders += [f"{path.name}: {name}" for name in names if name.split(".")[0].startswith("test_")]
    assert offenders == []


def test_the_readme_layout_table_names_every_module():
    """README.md's "Layout" table names every module under rollout/ (its file name, in its folder's row)."""
    readme = (ROOT.parent / "README.md").read_text()
    layout = readme[readme.index("## Layout"):]
    missing = [str(p.relative_to(ROOT.parent)) for p in sorted(ROOT.rglob("*.py"))
               if p.name != "__init__.py" and p.name not in layout]
    assert missing == [], "name each module in README.md's Layout table"
