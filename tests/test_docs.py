"""The documentation site (mkdocs.yml, docs/): it builds with ``mkdocs build --strict``, a reference to a
name that does not exist fails the build naming it, and every public name is in the API reference."""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
API = ROOT / "docs" / "api"
# PENDING: public names another change is adding right now (not committed when this file was); missing
# from the reference they are reported, not failing. Once the change lands, add the name's `:::` line
# to docs/api/ and empty the set.
PENDING: set = set()

pytest.importorskip("mkdocs", reason="mkdocs is not installed (requirements/ci.txt pins it)")
pytest.importorskip("mkdocstrings", reason="mkdocstrings is not installed (requirements/ci.txt pins it)")
pytest.importorskip("material", reason="mkdocs-material is not installed (requirements/ci.txt pins it)")
yaml = pytest.importorskip("yaml")


def mkdocs_build(config: Path, site: Path) -> subprocess.CompletedProcess:
    # NO_MKDOCS_2_WARNING: mkdocs-material's end-of-life banner, printed at every build
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)


def test_site_builds_strict(tmp_path):
    done = mkdocs_build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert done.returncode == 0, done.stdout + done.stderr
    # the API reference was rendered from the docstrings, and the CLI page holds every subcommand's --help
    assert 'id="trainforge.Trainer"' in (tmp_path / "site/api/trainforge/index.html").read_text()
    cli = (tmp_path / "site/guides/cli/index.html").read_text()
    assert "usage: trainforge launch" in cli and "usage: trainforge merge-weights" in cli


def test_reference_to_a_missing_name_fails_naming_it(tmp_path):
    # the project's configuration, with one page that names what does not exist
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs/index.md").write_text("# Reference\n\n::: trainforge.NoSuchName\n")
    config.update(docs_dir=str(tmp_path / "docs"), nav=["index.md"])
    config["hooks"] = [str(ROOT / hook) for hook in config["hooks"]]
    python = next(p["mkdocstrings"] for p in config["plugins"] if isinstance(p, dict) and "mkdocstrings" in p)
    python["handlers"]["python"]["paths"] = [str(ROOT / p) for p in python["handlers"]["python"]["paths"]]
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(config))
    done = mkdocs_build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert done.returncode != 0
    assert "trainforge.NoSuchName" in done.stdout + done.stderr


def documented() -> set:
    return {m for page in API.glob("*.md") for m in re.findall(r"^::: ([\w.]+)", page.read_text(), re.M)}


@pytest.mark.parametrize("package", ["trainforge", "trainforge.callbacks", "trainforge.strategies", "trainforge.utils"])
def test_every_public_name_is_in_the_api_reference(package):
    module = importlib.import_module(package)
    names = documented()
    missing = []
    for name in module.__all__:
        if name.startswith("__"):
            continue
        home = getattr(getattr(module, name), "__module__", None)  # a lazily exported callback or strategy
        if f"{package}.{name}" not in names and f"{home}.{name}" not in names:
            missing.append(f"::: {package}.{name}")
    pending = [m for m in missing if m[4:] in PENDING]
    if pending:
        print(f"pending (another change is adding them): {pending}")
    missing = [m for m in missing if m not in pending]
    assert not missing, f"public names missing from the API reference ({API.relative_to(ROOT)}/*.md): add {missing}"
