"""The six distributions as declared in the source tree: one version, a LICENSE and a README
each, py.typed where there is code, the torch bound the test sessions run on, and Triton
only behind the opt-in `triton` extra. `nox -s build` checks the built sdists and wheels and
installs them; this is what can be checked without building, fast and offline."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
# Folder -> the import package it ships (the meta-distribution ships none).
FOLDERS = {".": None, "torchbridge-core": "torchbridge", "plugins/nvidia": "torchbridge_nvidia",
           "plugins/amd": "torchbridge_amd", "plugins/intel": "torchbridge_intel",
           "plugins/tpu": "torchbridge_tpu"}
OURS = {"torchbridge", "torchbridge-core", "torchbridge-nvidia", "torchbridge-amd",
        "torchbridge-intel", "torchbridge-tpu"}


def pyproject(folder: str) -> dict[str, Any]:
    with open(ROOT / folder / "pyproject.toml", "rb") as f:
        return tomllib.load(f)


def source_version() -> str:
    """_SOURCE_VERSION in torchbridge/__init__.py, read as setuptools reads it: statically."""
    tree = ast.parse((ROOT / "torchbridge-core/src/torchbridge/__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "_SOURCE_VERSION" for t in node.targets):
            assert isinstance(node.value, ast.Constant)
            return str(node.value.value)
    raise AssertionError("no _SOURCE_VERSION in torchbridge/__init__.py")


def requirements(project: dict[str, Any]) -> dict[str, list[Requirement]]:
    """Requirements by extra ("" for the dependencies)."""
    found = {"": [Requirement(r) for r in project.get("dependencies", [])]}
    for extra, listed in project.get("optional-dependencies", {}).items():
        found[extra] = [Requirement(r) for r in listed]
    return found


def test_the_core_reads_its_version_from_source_version() -> None:
    core = pyproject("torchbridge-core")
    assert "version" not in core["project"] and "version" in core["project"]["dynamic"]
    assert core["tool"]["setuptools"]["dynamic"]["version"] == {
        "attr": "torchbridge._SOURCE_VERSION"}


@pytest.mark.parametrize("folder", [f for f in FOLDERS if f != "torchbridge-core"])
def test_every_other_distribution_has_the_core_version_and_pins_it(folder: str) -> None:
    version = source_version()
    project = pyproject(folder)["project"]
    assert project["version"] == version, (
        f"{folder}/pyproject.toml says {project['version']}; the release is {version} "
        "(torchbridge-core/src/torchbridge/__init__.py, _SOURCE_VERSION)")
    for extra, listed in requirements(project).items():
        for requirement in listed:
            name = canonicalize_name(requirement.name)
            if name in OURS and name != project["name"]:
                assert requirement.specifier == SpecifierSet(f"=={version}"), (
                    f"{folder}: {requirement} (extra {extra!r}) should pin =={version}")


def test_the_installed_core_reports_the_source_version() -> None:
    import torchbridge

    assert torchbridge.__version__ == source_version()


@pytest.mark.parametrize("folder", FOLDERS)
def test_each_distribution_carries_the_apache_license_and_a_readme(folder: str) -> None:
    project = pyproject(folder)["project"]
    assert project["license"] == "Apache-2.0"
    assert project["license-files"] == ["LICENSE"]
    license_text = (ROOT / folder / "LICENSE").read_text()
    assert license_text == (ROOT / "LICENSE").read_text()
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
    assert "END OF TERMS AND CONDITIONS" in license_text  # the full text, not a notice
    readme = (ROOT / folder / project["readme"]).read_text()
    assert re.search(r"^#+ Install", readme, re.MULTILINE), f"{folder}: README has no Install"
    assert "pip install" in readme


@pytest.mark.parametrize("folder", [f for f, package in FOLDERS.items() if package])
def test_each_package_is_marked_typed(folder: str) -> None:
    package = FOLDERS[folder]
    assert (ROOT / folder / "src" / str(package) / "py.typed").is_file()
    assert "py.typed" in pyproject(folder)["tool"]["setuptools"]["package-data"][package]


def oldest_tested_torch() -> tuple[int, int]:
    """The oldest `torch==X.Y.Z` a nox session installs."""
    pins = re.findall(r'"torch==(\d+)\.(\d+)(?:\.\d+)?"', (ROOT / "noxfile.py").read_text())
    assert pins, "no torch==X.Y pin in noxfile.py"
    return min((int(major), int(minor)) for major, minor in pins)


@pytest.mark.parametrize("folder", FOLDERS)
def test_the_torch_lower_bound_is_the_oldest_torch_tested(folder: str) -> None:
    major, minor = oldest_tested_torch()
    for listed in requirements(pyproject(folder)["project"]).values():
        for requirement in listed:
            if requirement.name == "torch":
                assert str(requirement.specifier) == f">={major}.{minor}", (
                    f"{folder}: {requirement}; the oldest torch a session runs is "
                    f"{major}.{minor}")


def pulls(folder_of: dict[str, str], name: str, extras: frozenset[str],
          seen: set[tuple[str, frozenset[str]]] | None = None) -> set[str]:
    """Every third-party distribution installing `name[extras]` from this tree pulls in."""
    seen = set() if seen is None else seen
    if (name, extras) in seen:
        return set()
    seen.add((name, extras))
    found: set[str] = set()
    by_extra = requirements(pyproject(folder_of[name])["project"])
    for extra in {"", *extras}:
        for requirement in by_extra[extra]:
            required = canonicalize_name(requirement.name)
            if required in OURS:
                found |= pulls(folder_of, required, frozenset(requirement.extras), seen)
            else:
                found.add(required)
    return found


def test_only_the_triton_extras_pull_in_triton() -> None:
    folder_of = {canonicalize_name(pyproject(f)["project"]["name"]): f for f in FOLDERS}
    for name, folder in folder_of.items():
        extras = pyproject(folder)["project"].get("optional-dependencies", {})
        for extra in ["", *extras]:
            pulled = pulls(folder_of, name, frozenset({extra} - {""}))
            assert ("triton" in pulled) == (extra == "triton"), (
                f"{name}[{extra}] pulls in {sorted(pulled)}")
    # And the extras a user names: the vendors and `all` leave Triton out.
    assert "triton" not in pulls(folder_of, "torchbridge", frozenset({"all"}))
    assert "triton" in pulls(folder_of, "torchbridge", frozenset({"nvidia", "triton"}))
