"""Every hookspec has a test that exercises it (datasette's rule)."""

from __future__ import annotations

import inspect
from pathlib import Path

from torchbridge import hookspecs


def hookspec_names() -> list[str]:
    return [name for name, fn in inspect.getmembers(hookspecs, inspect.isfunction)
            if name.startswith("torchbridge_")]


def test_every_hookspec_is_exercised_by_a_test() -> None:
    names = hookspec_names()
    assert len(names) >= 10
    this_file = Path(__file__).resolve()
    sources = "\n".join(p.read_text() for p in Path(__file__).parent.glob("test_*.py")
                        if p.resolve() != this_file)
    missing = [name for name in names if name not in sources]
    assert not missing, f"hookspecs with no test: {missing}"


def test_every_hookspec_documents_itself() -> None:
    for name in hookspec_names():
        doc = inspect.getdoc(getattr(hookspecs, name)) or ""
        assert "None" in doc, f"{name} must say what None means"
