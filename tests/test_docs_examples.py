"""Every code block in the README, the docs site and the package READMEs runs as written.

Per file, the ```python blocks run in order in one fresh namespace (a page may build on an
earlier block), in a subprocess started in an empty folder. The `torchbridge ...` commands
of ```bash and ```console blocks run through the CLI, each in a subprocess, and must exit
0; other commands (pip, nox) are not run. A block that cannot run
on a CPU machine is preceded by a line `<!-- skip: REASON -->` and reported skipped with
that reason; one that needs an optional package is preceded by `<!-- requires: MODULE -->`
and skipped, naming it, only where that module is not installed (torchao is not, in the
torch 2.9 session). Output is shown in ```text blocks, which are not run. The time limits
only catch hangs.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HANG_LIMIT_S = 900  # a page's blocks; only to catch a hang, never a speed check

SKIP = re.compile(r"^<!--\s*skip:\s*(?P<reason>.+?)\s*-->$")
REQUIRES = re.compile(r"^<!--\s*requires:\s*(?P<modules>[\w., ]+?)\s*-->$")
FENCE = re.compile(r"^(?P<fence>```+)(?P<lang>[\w+-]*)\s*$")
RUN_LANGS = {"python", "bash", "console"}
# Languages a block may declare; a bare ``` is refused so that output is never mistaken
# for code (or code left unchecked as "output").
KNOWN_LANGS = RUN_LANGS | {"text", "toml", "json", "yaml", "ini"}


@dataclass(frozen=True)
class Block:
    path: str       # relative to the repository root
    line: int       # 1-based line of the first line of code
    lang: str
    code: str
    marked_skip: str | None
    requires: tuple[str, ...] = ()

    @property
    def skip(self) -> str | None:
        """Why this block is not run here, or None."""
        if self.marked_skip is not None:
            return self.marked_skip
        missing = [name for name in self.requires if importlib.util.find_spec(name) is None]
        return f"needs {', '.join(missing)}, not installed here" if missing else None


def documentation_files() -> list[Path]:
    files = [ROOT / "README.md", ROOT / "torchbridge-core" / "README.md",
             *sorted((ROOT / "plugins").glob("*/README.md")),
             *sorted((ROOT / "docs").rglob("*.md"))]
    return [path for path in files if path.is_file()]


def parse_blocks(path: Path) -> list[Block]:
    """The fenced code blocks of a Markdown file, with the skip marker before each."""
    relative = path.relative_to(ROOT).as_posix()
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks = []
    index = 0
    previous = ""  # the last non-blank line before the current one
    while index < len(lines):
        stripped = lines[index].strip()
        match = FENCE.match(stripped)
        if not match:
            if stripped:
                previous = stripped
            index += 1
            continue
        fence, lang = match["fence"], match["lang"].lower()
        body = []
        index += 1
        start = index + 1
        while index < len(lines) and lines[index].strip() != fence:
            body.append(lines[index])
            index += 1
        if index >= len(lines):
            raise AssertionError(f"{relative}:{start - 1}: code block is never closed")
        skip = SKIP.match(previous)
        requires = REQUIRES.match(previous)
        blocks.append(Block(relative, start, lang, "\n".join(body) + "\n",
                            skip["reason"] if skip else None,
                            tuple(name.strip() for name in requires["modules"].split(","))
                            if requires else ()))
        previous = ""
        index += 1
    return blocks


ALL_BLOCKS = [block for path in documentation_files() for block in parse_blocks(path)]


def cli_commands(block: Block) -> list[list[str]] | None:
    """The `torchbridge` commands of a shell block, each as its arguments; None when it has
    none. Other commands (pip install, nox) are left out: they are not run here."""
    text = block.code.replace("\\\n", " ")
    commands = []
    for raw in text.splitlines():
        line = raw.strip()
        if block.lang == "console":
            if not line.startswith("$ "):
                continue  # output
            line = line[2:]
        line = line.split(" #", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        words = shlex.split(line)
        if words and words[0] == "torchbridge":
            commands.append(words[1:])
    return commands or None


def _python_pages() -> list[str]:
    pages: list[str] = []
    for block in ALL_BLOCKS:
        if block.lang == "python" and block.skip is None and block.path not in pages:
            pages.append(block.path)
    return pages


def _cli_blocks() -> list[Block]:
    return [block for block in ALL_BLOCKS if block.lang in ("bash", "console")
            and block.skip is None and cli_commands(block) is not None]


def _skipped_blocks() -> list[Block]:
    return [block for block in ALL_BLOCKS if block.skip is not None]


# Runs in the subprocess: each block compiled with the page's name and its line numbers,
# so a traceback points at the page.
RUNNER = """
import json, sys
blocks = json.load(sys.stdin)
namespace = {"__name__": "__main__"}
for block in blocks:
    code = compile("\\n" * (block["line"] - 1) + block["code"], block["path"], "exec")
    print(f"--- {block['path']}:{block['line']}", flush=True)
    exec(code, namespace)
"""


@pytest.mark.parametrize("page", _python_pages())
def test_python_blocks_run(page: str, tmp_path: Path) -> None:
    blocks = [{"path": b.path, "line": b.line, "code": b.code} for b in ALL_BLOCKS
              if b.path == page and b.lang == "python" and b.skip is None]
    done = subprocess.run([sys.executable, "-c", RUNNER], input=json.dumps(blocks), cwd=tmp_path,
                          capture_output=True, text=True, timeout=HANG_LIMIT_S)
    assert done.returncode == 0, (f"a python block of {page} failed:\n{done.stdout[-3000:]}\n"
                                  f"{done.stderr[-6000:]}")


# The same command on several pages (`torchbridge doctor`) runs once per session.
_cli_results: dict[tuple[str, ...], subprocess.CompletedProcess[str]] = {}


def _run_cli(arguments: list[str], folder: Path) -> subprocess.CompletedProcess[str]:
    key = tuple(arguments)
    if key not in _cli_results:
        _cli_results[key] = subprocess.run(
            [sys.executable, "-m", "torchbridge", *arguments], cwd=folder,
            capture_output=True, text=True, timeout=HANG_LIMIT_S)
    return _cli_results[key]


@pytest.mark.parametrize("block", _cli_blocks(), ids=lambda b: f"{b.path}:{b.line}")
def test_cli_blocks_run(block: Block, tmp_path_factory: pytest.TempPathFactory) -> None:
    folder = tmp_path_factory.getbasetemp() / "cli"
    folder.mkdir(exist_ok=True)
    for arguments in cli_commands(block) or []:
        done = _run_cli(arguments, folder)
        assert done.returncode == 0, (f"{block.path}:{block.line}: torchbridge "
                                      f"{shlex.join(arguments)} exited {done.returncode}:\n"
                                      f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}")


@pytest.mark.parametrize("block", _skipped_blocks(), ids=lambda b: f"{b.path}:{b.line}")
def test_marked_blocks_are_skipped(block: Block) -> None:
    pytest.skip(f"{block.path}:{block.line}: {block.skip}")


def test_every_block_declares_a_known_language() -> None:
    unknown = [f"{b.path}:{b.line}: {b.lang or '(none)'}" for b in ALL_BLOCKS
               if b.lang not in KNOWN_LANGS]
    assert not unknown, "code blocks need a language (output is ```text):\n" + "\n".join(unknown)


def test_skip_markers_sit_on_runnable_blocks() -> None:
    """A skip marker on a block that would not run anyway hides nothing; one before prose
    is a typo that leaves a block unchecked."""
    misplaced = [f"{b.path}:{b.line}" for b in ALL_BLOCKS
                 if (b.marked_skip or b.requires) and b.lang not in RUN_LANGS]
    assert not misplaced, "skip markers on blocks that are never run:\n" + "\n".join(misplaced)


def test_readme_is_a_front_page() -> None:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines; the details go to docs/"


def test_parser_reads_markers_and_languages(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("text\n\n<!-- skip: needs an NVIDIA GPU -->\n```python\nx = 1\n```\n\n"
                    "```bash\ntorchbridge doctor --json  # for machines\npip install x\n```\n"
                    "```text\n$ out\n```\n<!-- requires: json, no_such_module_here -->\n"
                    "```python\ny = 2\n```\n", encoding="utf-8")
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        blocks = parse_blocks(page)
    finally:
        ROOT = saved
    assert [(b.lang, b.line, b.skip) for b in blocks] == [
        ("python", 5, "needs an NVIDIA GPU"), ("bash", 9, None), ("text", 13, None),
        ("python", 17, "needs no_such_module_here, not installed here")]
    assert cli_commands(blocks[1]) == [["doctor", "--json"]]  # pip install is not run
    assert cli_commands(Block("p.md", 1, "bash", "pip install torchbridge\n", None)) is None
    only_cli = Block("p.md", 1, "console", "$ torchbridge doctor --json\n{...}\n", None)
    assert cli_commands(only_cli) == [["doctor", "--json"]]
