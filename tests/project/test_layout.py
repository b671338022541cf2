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
