"""mkdocs hook: pages generated at build time from the code, so they cannot drift from it.

- The configuration reference: every field of TorchBridgeConfig, its sections and the
  shipped plugins' `hardware.<name>` sections, with type, default, bounds, description and
  the environment variable that sets it. Written from the pydantic models themselves.
- Simple SVG bar charts of the recorded prepare_model benchmarks (benchmarks/results/*.json),
  drawn without matplotlib.

Run as a script to print the configuration reference: `python docs/hooks/generated_pages.py`.
"""

from __future__ import annotations

import enum
import html
import json
import re
import types
import typing
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
CONFIG_MARKER = "<!-- generated: config-reference -->"
CHART_MARKER = re.compile(r"<!-- generated: chart (?P<file>[\w.-]+) (?P<model>\w+) -->")

# The sections of the plugins shipped in this repository, from their own hook functions
# (what a user gets with `pip install "torchbridge[all]"`). Third-party sections are not
# listed: they are whatever the user installs.
SHIPPED_SECTIONS = [
    ("torchbridge.builtin.cpu.plugin", "built in"),
    ("torchbridge_nvidia.plugin", "torchbridge-nvidia"),
    ("torchbridge_amd.plugin", "torchbridge-amd"),
    ("torchbridge_intel.plugin", "torchbridge-intel"),
    ("torchbridge_tpu.plugin", "torchbridge-tpu"),
]


def _type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in args)
    if origin is not None:
        inner = ", ".join(_type_name(a) for a in args)
        return f"{getattr(origin, '__name__', str(origin))}[{inner}]"
    if annotation is type(None):
        return "None"
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return " | ".join(repr(member.value) for member in annotation)
    return getattr(annotation, "__name__", str(annotation))


def _default(field: Any) -> str:
    value = field.get_default(call_default_factory=True)
    if isinstance(value, enum.Enum):
        value = value.value
    return repr(value)


def _bounds(field: Any) -> str:
    words = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}
    parts = []
    for item in field.metadata:
        for attr, sign in words.items():
            if getattr(item, attr, None) is not None:
                parts.append(f"{sign} {getattr(item, attr)}")
    return ", ".join(parts)


def _cell(text: str) -> str:
    """Prose for a table cell."""
    return html.escape(text, quote=False).replace("|", "\\|").replace("\n", " ")


def _code(text: str) -> str:
    """A code span for a table cell: the tables extension keeps pipes inside backticks."""
    return "`" + text.replace("`", "'").replace("\n", " ") + "`"


def _rows(model: Any, path: tuple[str, ...]) -> list[str]:
    from torchbridge.config import ConfigSection

    rows = []
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if name == "hardware":
            continue
        if isinstance(annotation, type) and issubclass(annotation, ConfigSection):
            continue  # a section: its own table
        key = ".".join((*path, name))
        env = "TORCHBRIDGE_" + "__".join((*path, name)).upper()
        description = field.description or "(no description in the model yet)"
        bounds = _bounds(field)
        if bounds:
            description += f" (bounds: {bounds})"
        aliases = getattr(field.validation_alias, "choices", None)
        if aliases:
            others = [a for a in aliases if a != name]
            if others:
                description += f" (also accepted as: {', '.join(others)})"
        rows.append(f"| {_code(key)} | {_code(_type_name(annotation))} | "
                    f"{_code(_default(field))} | {_cell(description)} | {_code(env)} |")
    return rows


def _table(title: str, intro: str, model: Any, path: tuple[str, ...]) -> list[str]:
    lines = [f"### {title}", ""]
    if intro:
        lines += [intro, ""]
    lines += ["| key | type | default | description | environment variable |",
              "| --- | --- | --- | --- | --- |", *_rows(model, path), ""]
    return lines


def config_reference_markdown() -> str:
    """The configuration reference, from the models the installed packages define."""
    import importlib

    from torchbridge.config import ConfigSection, TorchBridgeConfig

    lines = ["## Core settings", ""]
    lines += _table("Top level", "`TorchBridgeConfig` itself.", TorchBridgeConfig, ())
    for name, field in TorchBridgeConfig.model_fields.items():
        annotation = field.annotation
        if name != "hardware" and isinstance(annotation, type) and issubclass(
                annotation, ConfigSection):
            lines += _table(f"`{name}`", f"`{annotation.__name__}`.", annotation, (name,))
    lines += ["## Hardware sections", "",
              "One section per installed plugin, under `hardware.<name>`. These are the "
              "sections of the plugins in this repository; a third-party plugin adds its "
              "own (see `torchbridge doctor`).", ""]
    for module_name, distribution in SHIPPED_SECTIONS:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            # Only where the plugin is not installed; the docs session installs all six.
            lines += [f"### `hardware` of {distribution}", "",
                      f"(not installed where these docs were built: {module_name})", ""]
            continue
        section, model = module.torchbridge_config_section()
        lines += _table(f"`hardware.{section}`",
                        f"`{model.__name__}`, from {distribution}.", model,
                        ("hardware", section))
    return "\n".join(lines)


# --- SVG bar charts ---------------------------------------------------------------------


def bar_chart_svg(title: str, bars: list[tuple[str, float]], unit: str) -> str:
    """A horizontal bar chart: one bar per (label, value)."""
    width, label_w, bar_h, gap, top = 640, 190, 18, 6, 30
    height = top + len(bars) * (bar_h + gap) + 10
    largest = max((value for _, value in bars), default=1.0) or 1.0
    scale = (width - label_w - 90) / largest
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'role="img" aria-label="{html.escape(title)}" font-family="sans-serif" '
             f'font-size="12">',
             f'<text x="4" y="18" font-weight="bold">{html.escape(title)}</text>']
    for index, (label, value) in enumerate(bars):
        y = top + index * (bar_h + gap)
        length = max(1.0, value * scale)
        parts.append(f'<text x="{label_w - 6}" y="{y + 13}" text-anchor="end">'
                     f'{html.escape(label)}</text>')
        parts.append(f'<rect x="{label_w}" y="{y}" width="{length:.1f}" height="{bar_h}" '
                     f'fill="#5c6bc0"/>')
        parts.append(f'<text x="{label_w + length + 4:.1f}" y="{y + 13}">{value:.2f}{unit}'
                     f'</text>')
    parts.append("</svg>")
    return "".join(parts)


def chart_for(result_file: str, model: str) -> str:
    """Speed over eager of every variant of `model`, at each batch size, from a recorded
    benchmark's JSON."""
    data = json.loads((ROOT / "benchmarks" / "results" / result_file).read_text())
    bars = [(f"{row['variant']} (batch {row['batch']})", float(row["speedup_vs_eager"]))
            for row in data["rows"] if row["model"] == model]
    if not bars:
        raise ValueError(f"no rows for model {model!r} in benchmarks/results/{result_file}")
    return bar_chart_svg(f"{model}: speed over eager fp32 ({result_file})", bars, "x")


# --- mkdocs events ------------------------------------------------------------------------


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if CONFIG_MARKER in markdown:
        markdown = markdown.replace(CONFIG_MARKER, config_reference_markdown())
    return CHART_MARKER.sub(lambda m: chart_for(m["file"], m["model"]), markdown)


if __name__ == "__main__":
    print(config_reference_markdown())
