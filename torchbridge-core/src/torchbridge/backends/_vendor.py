"""Re-exporting a vendor plugin's API under torchbridge.backends.<vendor>."""

from __future__ import annotations

import importlib
from typing import Any


def reexport(namespace: dict[str, Any], plugin_module: str, extra: str) -> None:
    try:
        module = importlib.import_module(f"{plugin_module}.api")
    except ModuleNotFoundError as exc:
        if exc.name is not None and exc.name.split(".")[0] == plugin_module:
            raise ModuleNotFoundError(
                f"{namespace['__name__']} needs the {extra} plugin, which is not installed: "
                f"pip install torchbridge[{extra}]", name=plugin_module) from None
        raise
    names = getattr(module, "__all__", [n for n in vars(module) if not n.startswith("_")])
    namespace.update({name: getattr(module, name) for name in names})
    namespace["__all__"] = list(names)
