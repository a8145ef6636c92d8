"""Every test starts from a clean environment: no TORCHBRIDGE_* variables, no config file in
the working directory, and plugins loaded as installed."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torchbridge


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: os.PathLike[str]) -> None:
    for var in list(os.environ):
        if var.startswith("TORCHBRIDGE_"):
            monkeypatch.delenv(var)
    monkeypatch.chdir(tmp_path)


@pytest.fixture
def reload_plugins(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """For tests that change plugin loading (env lists, entry points): undo the patches,
    then reload, so later tests see the plugins as installed."""
    yield
    monkeypatch.undo()
    torchbridge.reload_plugins()
