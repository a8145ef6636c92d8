"""The built distributions as pip sees them, for `nox -s build` (not a pytest module).

    python tests/packaging/dists.py check DIST
        DIST holds exactly the six sdists and wheels of one release; each carries LICENSE
        and its README; the core and the plugins carry py.typed; every version and every pin
        between them is the core's; only an extra named "triton" requires triton.
    python tests/packaging/dists.py requirements DIST "torchbridge[amd]"
        The third-party requirements (one a line, markers resolved for this interpreter)
        that installing that requirement from DIST pulls in, so that the session can
        install them from the index first and then TorchBridge from DIST alone
        (`pip install --no-index --find-links DIST`): pip never picks a TorchBridge
        distribution from anywhere else.

Runs in the build session's venv, which has `packaging` (a dependency of `build`).
"""

from __future__ import annotations

import sys
import tarfile
import zipfile
from dataclasses import dataclass, field
from email.message import Message
from email.parser import Parser
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

META = "torchbridge"
CORE = "torchbridge-core"
PLUGINS = ("torchbridge-nvidia", "torchbridge-amd", "torchbridge-intel", "torchbridge-tpu")
DISTRIBUTIONS = (META, CORE, *PLUGINS)
# The import package of each distribution that ships code; the meta-distribution ships none.
PACKAGES = {CORE: "torchbridge", **{name: name.replace("-", "_") for name in PLUGINS}}


@dataclass
class Built:
    name: str
    version: str
    requires: list[Requirement] = field(default_factory=list)
    extras: set[str] = field(default_factory=set)
    files: dict[str, list[str]] = field(default_factory=dict)  # artifact file name -> members


def _metadata(text: str) -> Message:
    return Parser().parsestr(text)


def read(dist: Path) -> dict[str, Built]:
    """Every sdist and wheel in `dist`, by canonical distribution name."""
    built: dict[str, Built] = {}
    for path in sorted(dist.iterdir()):
        if path.suffix == ".whl":
            with zipfile.ZipFile(path) as wheel:
                members = wheel.namelist()
                meta = next(m for m in members if m.endswith(".dist-info/METADATA"))
                message = _metadata(wheel.read(meta).decode())
        elif path.name.endswith(".tar.gz"):
            with tarfile.open(path) as sdist:
                members = [m.split("/", 1)[1] for m in sdist.getnames() if "/" in m]
                top = sdist.getnames()[0].split("/")[0]
                extracted = sdist.extractfile(f"{top}/PKG-INFO")
                assert extracted is not None, f"{path.name} has no PKG-INFO"
                message = _metadata(extracted.read().decode())
        else:
            raise SystemExit(f"{dist}: unexpected file {path.name}")
        name = canonicalize_name(message["Name"])
        entry = built.setdefault(name, Built(name, message["Version"]))
        if entry.version != message["Version"]:
            raise SystemExit(f"{name}: versions {entry.version} and {message['Version']} in {dist}")
        entry.requires = [Requirement(r) for r in message.get_all("Requires-Dist") or []]
        entry.extras = set(message.get_all("Provides-Extra") or [])
        entry.files[path.name] = members
    return built


def _applies(requirement: Requirement, extras: set[str]) -> set[str]:
    """Those of `extras` under which `requirement` applies on this interpreter (the empty
    string stands for no extra)."""
    marker = requirement.marker
    return {e for e in extras if marker is None or marker.evaluate({"extra": e})}


def check(dist: Path) -> list[str]:
    """What is wrong with the release in `dist` (empty: nothing); prints what was checked."""
    built = read(dist)
    problems = []
    if sorted(built) != sorted(DISTRIBUTIONS):
        problems.append(f"distributions {sorted(built)}, expected {sorted(DISTRIBUTIONS)}")
    version = built[CORE].version if CORE in built else "?"
    for name, entry in sorted(built.items()):
        if entry.version != version:
            problems.append(f"{name} is {entry.version}, torchbridge-core {version}")
        kinds = sorted("wheel" if f.endswith(".whl") else "sdist" for f in entry.files)
        if kinds != ["sdist", "wheel"]:
            problems.append(f"{name}: built {kinds}, expected one sdist and one wheel")
        for artifact, members in entry.files.items():
            wheel = artifact.endswith(".whl")
            if not any(m.endswith("LICENSE") for m in members):
                problems.append(f"{artifact} carries no LICENSE")
            if not wheel and "README.md" not in members:
                problems.append(f"{artifact} carries no README.md")
            package = PACKAGES.get(name)
            if package and not any(m.endswith(f"{package}/py.typed") for m in members):
                problems.append(f"{artifact} carries no {package}/py.typed")
            if name == META and any(m.endswith(".py") for m in members):
                problems.append(f"{artifact} (the meta-distribution) carries Python files: "
                                f"{[m for m in members if m.endswith('.py')]}")
        for requirement in entry.requires:
            required = canonicalize_name(requirement.name)
            self_reference = required == name  # torchbridge[all] = torchbridge[nvidia,...]
            if (required in DISTRIBUTIONS and not self_reference
                    and str(requirement.specifier) != f"=={version}"):
                problems.append(f"{name} requires {requirement}: expected =={version}")
            pulls_triton = required == "triton" or (required == CORE
                                                    and "triton" in requirement.extras)
            if pulls_triton and _applies(requirement, {""} | entry.extras) != {"triton"}:
                problems.append(f"{name} requires {requirement}: triton outside the opt-in "
                                f"'triton' extra")
        print(f"  {name} {entry.version}: {', '.join(sorted(entry.files))}")
    return problems


def requirements(dist: Path, spec: str) -> list[str]:
    """The third-party requirements pulled in by installing `spec` from `dist`."""
    built = read(dist)
    found: list[str] = []
    todo = [Requirement(spec)]
    seen: set[tuple[str, frozenset[str]]] = set()
    while todo:
        wanted = todo.pop()
        key = (canonicalize_name(wanted.name), frozenset(wanted.extras))
        if key in seen:
            continue
        seen.add(key)
        for requirement in built[key[0]].requires:
            if not _applies(requirement, {""} | set(key[1])):
                continue
            if canonicalize_name(requirement.name) in DISTRIBUTIONS:
                if canonicalize_name(requirement.name) not in built:
                    raise SystemExit(f"{requirement} is not built in {dist}")
                todo.append(requirement)
                continue
            # The marker held here: drop it (an `extra == ...` clause would not hold for pip).
            extras = f"[{','.join(sorted(requirement.extras))}]" if requirement.extras else ""
            line = f"{requirement.name}{extras}{requirement.specifier}"
            if line not in found:
                found.append(line)
    return found


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "check":
        problems = check(Path(argv[1]))
        for problem in problems:
            print(f"error: {problem}", file=sys.stderr)
        return 1 if problems else 0
    if len(argv) == 3 and argv[0] == "requirements":
        print("\n".join(requirements(Path(argv[1]), argv[2])))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
