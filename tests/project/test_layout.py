"""The package layout: one `vllm_tiercache` namespace, three layers with imports only downward.

Why: the wheel used to install `shared`, `kvcache` and `eccache` at the top of site-packages, where a
`shared/` folder in the user's working directory (first on `sys.path` under `python -m`) shadowed the
plugin, and `shared` is another PyPI distribution's name. Layers: `shared` (store, records, keys,
eviction) <- `kvcache`, `eccache` (connectors) <- `tools` (CLI, jobs, benchmarks, demo).
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = "vllm_tiercache"
#: folder -> the `vllm_tiercache` subpackages its modules may import (besides their own folder).
ALLOWED = {
    "shared": set(),
    "kvcache": {"shared"},
    "eccache": {"shared"},
    "tools": {"shared", "kvcache", "eccache"},
}
#: the folders of the layers: packages only under `vllm_tiercache`, so `import shared` etc. is always wrong
FOLDER_NAMES = set(ALLOWED)


def _imports(path: Path) -> list[tuple[int, str]]:
    """Every module an import statement in ``path`` names (absolute names; relative ones resolved)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                raise AssertionError(f"{path}:{node.lineno}: use absolute `{PACKAGE}.` imports")
            base = node.module or ""
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


def test_each_layer_imports_only_the_layers_below() -> None:
    wrong = []
    for folder, allowed in ALLOWED.items():
        for path in sorted((REPO / folder).rglob("*.py")):
            for line, name in _imports(path):
                parts = name.split(".")
                if parts[0] in FOLDER_NAMES:
                    wrong.append(f"{path.relative_to(REPO)}:{line}: `{name}` is not a module once installed")
                elif parts[0] == PACKAGE and len(parts) > 1 and parts[1] != folder:
                    layer = parts[1]
                    if layer not in allowed and not (layer == "plugin" and folder == "tools"):
                        wrong.append(f"{path.relative_to(REPO)}:{line}: {folder} imports {name}")
    assert not wrong, "imports that run against the layers:\n" + "\n".join(wrong)


def test_tests_and_the_plugin_use_the_namespace_only() -> None:
    paths = [*sorted((REPO / "tests").rglob("*.py")), *sorted((REPO / PACKAGE).rglob("*.py"))]
    wrong = [f"{p.relative_to(REPO)}:{line}: {name}" for p in paths for line, name in _imports(p)
             if name.split(".")[0] in FOLDER_NAMES]
    assert not wrong, wrong


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel `pip` builds from a copy of the sources (setuptools writes `build/` beside them)."""
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("wheel")
    for name in ("pyproject.toml", "README.md", PACKAGE, *ALLOWED):
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(REPO / name, src / name)
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(src)],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (built,) = out.glob("vllm_tiercache-*.whl")
    return built


def test_the_wheel_installs_one_top_level_package_with_every_module(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    top = {name.split("/")[0] for name in names}
    assert {t for t in top if not t.endswith(".dist-info")} == {PACKAGE}, sorted(top)
    expected = {f"{PACKAGE}/{p.relative_to(REPO)}" for folder in ALLOWED for p in (REPO / folder).rglob("*.py")}
    expected |= {f"{PACKAGE}/{p.name}" for p in (REPO / PACKAGE).glob("*.py")}
    missing = sorted(expected - set(names))
    assert not missing, f"modules left out of the wheel (add their package to pyproject.toml): {missing}"
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "tiercache = vllm_tiercache.plugin:register" in text and "vllm_tiercache.tools.cli:main" in text


def test_a_working_directory_with_its_own_shared_folder_does_not_shadow_the_plugin(tmp_path: Path) -> None:
    """What `python -m vllm.entrypoints.openai.api_server` does from a user's project directory: load the
    plugins, resolve both connector names and our encoder cache manager, with `shared/`, `kvcache/` and
    `eccache/` folders of the user's own in the current directory (first on `sys.path`)."""
    for name in FOLDER_NAMES:
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"raise ImportError('the user project {name} was imported')\n")
    code = (
        "import sys, importlib\n"
        "from vllm.plugins import load_general_plugins\n"
        "from vllm.config import KVTransferConfig, ECTransferConfig\n"
        "from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory\n"
        "from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory\n"
        "load_general_plugins()\n"
        "kv = KVConnectorFactory.get_connector_class(KVTransferConfig(kv_connector='TieredKVConnector',"
        " kv_role='kv_both'))\n"
        "ec = ECConnectorFactory.get_connector_class(ECTransferConfig(ec_connector='TieredECConnector',"
        " ec_role='ec_both'))\n"
        "managers = importlib.import_module('vllm_tiercache.eccache.managers')\n"
        "print(kv.__module__, ec.__module__, managers.__name__)\n"
        "print(sys.modules['shared'].__file__ if 'shared' in sys.modules else 'no shared module')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[-2].split() == ["vllm_tiercache.kvcache.connector", "vllm_tiercache.eccache.connector",
                                 "vllm_tiercache.eccache.managers"], proc.stdout
    assert lines[-1] == "no shared module", proc.stdout


#: The most lines a product module and a product class may have: past these, a module holds several jobs
#: and its reader has to find the one a change is about (split by job, as the store's tiers are).
MAX_MODULE_LINES = 600
MAX_CLASS_LINES = 400


def test_product_modules_and_classes_stay_small() -> None:
    too_long: list[str] = []
    folders = [*FOLDER_NAMES, PACKAGE]
    for path in sorted(p for folder in folders for p in (REPO / folder).rglob("*.py")):
        text = path.read_text()
        lines = text.count("\n")
        if lines > MAX_MODULE_LINES:
            too_long.append(f"{path.relative_to(REPO)}: {lines} lines (at most {MAX_MODULE_LINES})")
        for node in ast.walk(ast.parse(text, filename=str(path))):
            if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
                size = node.end_lineno - node.lineno + 1
                if size > MAX_CLASS_LINES:
                    too_long.append(f"{path.relative_to(REPO)}: class {node.name} has {size} lines "
                                    f"(at most {MAX_CLASS_LINES})")
    assert not too_long, "split these by job:\n" + "\n".join(too_long)


# ------------------------------------------------------------------------------------------ rooms by name
#: The most modules one product folder may hold (its `__init__` not counted): past it, a reader scans a
#: list instead of finding a room by its name.
MAX_FOLDER_MODULES = 15
#: How many sibling modules may share a name prefix (the part before the first underscore) before that
#: prefix must be a folder: `redis_tier`, `redis_calls`, `redis_admin` are a `redis/` folder in disguise.
MAX_PREFIX_SIBLINGS = 2


def _product_folders(root: Path) -> list[Path]:
    """Every package folder of the product under ``root`` (the layers and the plugin package)."""
    folders = [root / name for name in [*sorted(FOLDER_NAMES), PACKAGE] if (root / name).is_dir()]
    return sorted({p.parent for folder in folders for p in folder.rglob("__init__.py")} | set(folders))


def _modules(folder: Path) -> list[str]:
    return sorted(p.stem for p in folder.glob("*.py") if p.name != "__init__.py")


def crowded_folders(root: Path) -> list[str]:
    """Product folders holding more than `MAX_FOLDER_MODULES` modules."""
    return [f"{folder.relative_to(root)}/ has {len(_modules(folder))} modules (at most {MAX_FOLDER_MODULES}): "
            f"group them into folders by what they serve"
            for folder in _product_folders(root) if len(_modules(folder)) > MAX_FOLDER_MODULES]


def prefix_families(root: Path) -> list[str]:
    """Groups of more than `MAX_PREFIX_SIBLINGS` sibling modules sharing a name prefix with no folder of its own."""
    found = []
    for folder in _product_folders(root):
        families: dict[str, list[str]] = {}
        for stem in _modules(folder):
            families.setdefault(stem.split("_", 1)[0], []).append(stem)
        for prefix, stems in sorted(families.items()):
            if len(stems) > MAX_PREFIX_SIBLINGS and not (folder / prefix / "__init__.py").is_file():
                found.append(f"{folder.relative_to(root)}/: {', '.join(stems)} share the prefix {prefix!r}: "
                             f"make it a folder, {folder.relative_to(root)}/{prefix}/")
    return found


def _module_names(root: Path) -> dict[str, Path]:
    """Installed dotted name -> file, for every product module under ``root`` (packages by their `__init__`)."""
    names = {}
    for folder in [*sorted(FOLDER_NAMES), PACKAGE]:
        for path in (root / folder).rglob("*.py"):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            names[".".join(parts if folder == PACKAGE else [PACKAGE, *parts])] = path
    return names


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the product modules it imports (`_imports`: every import statement, at the top, in a function
    or under `TYPE_CHECKING`, since a reader follows them all); ``from package import module`` counts as the
    module, not the package."""
    names = _module_names(root)
    graph: dict[str, set[str]] = {}
    for name, path in names.items():
        by_line: dict[int, set[str]] = {}
        for line, imported in _imports(path):
            by_line.setdefault(line, set()).add(imported)
        targets = set()
        for imported_here in by_line.values():
            for imported in imported_here:
                if any(other.startswith(imported + ".") and other in names for other in imported_here):
                    continue  # the package of a `from package import module`
                while imported and imported not in names:
                    imported = imported.rpartition(".")[0]
                if imported and imported != name:
                    targets.add(imported)
        graph[name] = targets
    return graph


def import_circles(root: Path) -> list[str]:
    """Each set of product modules that import one another in a circle (Tarjan's strongly connected
    components of `import_graph`), as one line naming the modules."""
    graph = import_graph(root)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[str] = []

    def visit(start: str) -> None:  # iterative: the graph may be deeper than the recursion limit allows
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    circles.append(" <-> ".join(sorted(component)))

    for name in sorted(graph):
        if name not in index:
            visit(name)
    return circles


def test_no_product_folder_is_crowded() -> None:
    crowded = crowded_folders(REPO)
    assert not crowded, "\n".join(crowded)


def test_no_name_prefix_is_a_folder_in_disguise() -> None:
    families = prefix_families(REPO)
    assert not families, "\n".join(families)


def test_the_product_has_no_import_circle() -> None:
    circles = import_circles(REPO)
    assert not circles, "modules that import each other (move what both need into a module of its own):\n" + \
        "\n".join(circles)


def _scratch_tree(root: Path, modules: dict[str, str]) -> Path:
    """A product tree of empty layer packages plus ``modules`` (relative path -> source)."""
    for folder in [*FOLDER_NAMES, PACKAGE]:
        (root / folder).mkdir(parents=True, exist_ok=True)
        (root / folder / "__init__.py").write_text("")
    for relative, source in modules.items():
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        (root / relative).write_text(source)
    return root


def test_the_rules_catch_what_they_are_for(tmp_path: Path) -> None:
    """Each rule fails on the change it exists to stop, and lets its near misses through."""
    crowded = _scratch_tree(tmp_path / "a", {f"shared/m{i}.py": "" for i in range(MAX_FOLDER_MODULES + 1)})
    assert [line.split(" ")[0] for line in crowded_folders(crowded)] == ["shared/"]
    full = _scratch_tree(tmp_path / "b", {f"shared/m{i}.py": "" for i in range(MAX_FOLDER_MODULES)})
    assert crowded_folders(full) == []

    family = _scratch_tree(tmp_path / "c", {"shared/store/__init__.py": "", "shared/store/foo_a.py": "",
                                            "shared/store/foo_b.py": "", "shared/store/foo.py": ""})
    assert len(prefix_families(family)) == 1 and "'foo'" in prefix_families(family)[0]
    pair = _scratch_tree(tmp_path / "d", {"shared/foo_a.py": "", "shared/foo_b.py": ""})
    housed = _scratch_tree(tmp_path / "e", {"shared/foo_a.py": "", "shared/foo_b.py": "", "shared/foo_c.py": "",
                                            "shared/foo/__init__.py": ""})
    assert prefix_families(pair) == [] and prefix_families(housed) == []

    circle = _scratch_tree(tmp_path / "f", {
        "kvcache/a.py": "from vllm_tiercache.kvcache.b import B\n",
        "kvcache/b.py": ("from typing import TYPE_CHECKING\n"
                         "if TYPE_CHECKING:\n    from vllm_tiercache.kvcache import a\n"),
        "kvcache/c.py": "def f():\n    from vllm_tiercache.kvcache.a import A\n",
    })
    assert import_circles(circle) == ["vllm_tiercache.kvcache.a <-> vllm_tiercache.kvcache.b"]
    chain = _scratch_tree(tmp_path / "g", {"kvcache/a.py": "from vllm_tiercache.kvcache.b import B\n",
                                           "kvcache/b.py": "import vllm_tiercache.shared\n"})
    assert import_circles(chain) == []
