"""An install from the built wheels, as a user gets it, for `nox -s build` (not a pytest
module). Run with the Python of a venv that has torch and `torchbridge[EXTRA]` installed
from the wheels, from a folder outside the repository:

    python smoke.py --version 0.3.0 --plugins amd [--levels O1,O2] [--also tqdm,torchao]

Checks that torchbridge and each plugin import from the venv (never the source tree), that
exactly the TorchBridge distributions of that extra are installed, each with LICENSE and
py.typed, that Triton was not pulled in, that `torchbridge doctor --json` loads each plugin
and lists its backend, and that prepare_model at each level gives the eager model's output.
Exits non-zero with every problem found.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import json
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

# Each plugin's distribution, import package, backend, and its `torchbridge.backends` module.
PLUGINS = {
    "nvidia": ("torchbridge-nvidia", "torchbridge_nvidia", "cuda", "NVIDIABackend"),
    "amd": ("torchbridge-amd", "torchbridge_amd", "rocm", "AMDBackend"),
    "intel": ("torchbridge-intel", "torchbridge_intel", "xpu", "IntelBackend"),
    "tpu": ("torchbridge-tpu", "torchbridge_tpu", "tpu", "TPUBackend"),
}


def _installed_here(module_file: str | None) -> bool:
    site = Path(sysconfig.get_paths()["purelib"]).resolve()
    return module_file is not None and Path(module_file).resolve().is_relative_to(site)


def check_install(version: str, plugins: list[str], also: list[str]) -> list[str]:
    problems = []
    import torchbridge

    if not _installed_here(torchbridge.__file__):
        problems.append(f"torchbridge imported from {torchbridge.__file__}, not the venv")
    if torchbridge.__version__ != version:
        problems.append(f"torchbridge.__version__ is {torchbridge.__version__}, not {version}")
    expected = {"torchbridge", "torchbridge-core", *(PLUGINS[p][0] for p in plugins)}
    installed = {d.metadata["Name"]: d for d in importlib.metadata.distributions()
                 if d.metadata["Name"].startswith("torchbridge")}
    if set(installed) != expected:
        problems.append(f"installed {sorted(installed)}, expected {sorted(expected)}")
    for name, dist in sorted(installed.items()):
        files = [str(f) for f in dist.files or []]
        if dist.version != version:
            problems.append(f"{name} is {dist.version}, not {version}")
        if not any(f.endswith("LICENSE") for f in files):
            problems.append(f"{name} installed no LICENSE")
        if name != "torchbridge" and not any(f.endswith("/py.typed") for f in files):
            problems.append(f"{name} installed no py.typed")
    for plugin in plugins:
        _, package, _, backend_class = PLUGINS[plugin]
        module = importlib.import_module(package)
        if not _installed_here(module.__file__):
            problems.append(f"{package} imported from {module.__file__}, not the venv")
        api = importlib.import_module(f"torchbridge.backends.{plugin}")
        if not hasattr(api, backend_class):
            problems.append(f"torchbridge.backends.{plugin} has no {backend_class}")
    if importlib.util.find_spec("triton") is not None:
        problems.append("triton is installed: only the opt-in 'triton' extra may pull it in")
    for module_name in also:
        importlib.import_module(module_name)
    print(f"installed: {', '.join(f'{n} {d.version}' for n, d in sorted(installed.items()))}")
    return problems


def check_doctor(plugins: list[str]) -> list[str]:
    command = shutil.which("torchbridge", path=str(Path(sys.executable).parent))
    if command is None:
        return ["no torchbridge command in the venv"]
    done = subprocess.run([command, "doctor", "--json"], capture_output=True, text=True,
                          timeout=600)
    if done.returncode != 0:
        return [f"torchbridge doctor --json exited {done.returncode}: {done.stderr[-2000:]}"]
    report = json.loads(done.stdout)
    problems = []
    status = {p["name"]: p["status"] for p in report["plugins"]}
    backends = {b["name"]: b for b in report["backends"]}
    for plugin, (_, _, backend_name, _) in PLUGINS.items():
        backend = backends.get(backend_name, {})
        if plugin in plugins:
            if status.get(plugin) != "loaded":
                problems.append(f"doctor: plugin {plugin} is {status.get(plugin, 'missing')}")
            if backend.get("plugin") != plugin:
                problems.append(f"doctor: backend {backend_name} is {backend}, not the "
                                f"{plugin} plugin's")
            sections = report["contributions"].get(plugin, {}).get("config_sections", [])
            if f"hardware.{plugin}" not in sections:
                problems.append(f"doctor: plugin {plugin} contributes {sections}, not "
                                f"hardware.{plugin}")
        elif f"torchbridge[{plugin}]" not in str(backend.get("install_hint")):
            # A plugin that is not installed: its backend says what to install.
            problems.append(f"doctor: backend {backend_name} without its plugin is {backend}")
    if report["selected"]["name"] != "cpu":
        problems.append(f"doctor selected {report['selected']['name']} on a CPU machine")
    print(f"doctor: plugins {sorted(status)}; backends "
          f"{ {name: b['plugin'] for name, b in backends.items()} }")
    return problems


def check_prepare_model(levels: list[str]) -> list[str]:
    import torch
    import torchbridge
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 16)).eval()
    x = torch.randn(32, 64)
    with torch.no_grad():
        expected = model(x)
    backend = torchbridge.get_backend()
    problems = []
    for level in levels:
        prepared = backend.prepare_model(model, level, sample_input=x)
        report = torchbridge.optimization_result(prepared)
        with torch.no_grad():
            out = prepared(backend.to_device(x)).float().cpu()
        # O1 keeps float32; O2 may run autocast to bfloat16 (8 mantissa bits).
        tolerance = 1e-5 if level == "O1" else 3e-2
        try:
            torch.testing.assert_close(out, expected, rtol=tolerance, atol=tolerance)
        except AssertionError as error:
            problems.append(f"prepare_model at {level}: output differs from eager: {error}")
        print(f"prepare_model {level} on {backend.name}: applied "
              f"{report.optimizations_applied}, max rel drift {report.max_rel_diff}")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--version", required=True)
    parser.add_argument("--plugins", default="", help="comma-separated: nvidia,amd,intel,tpu")
    parser.add_argument("--levels", default="O1")
    parser.add_argument("--also", default="", help="comma-separated modules the extras add")
    args = parser.parse_args()
    plugins = [p for p in args.plugins.split(",") if p]
    problems = check_install(args.version, plugins, [m for m in args.also.split(",") if m])
    problems += check_doctor(plugins)
    problems += check_prepare_model(args.levels.split(","))
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
