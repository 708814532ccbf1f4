"""Every code example in README.md and docs/*.md runs, found by its marker.

A fenced code block is tested when the last non-blank line before it is a marker:

    <!-- test: NAME -->
    <!-- test: NAME, needs=checkpoint, after=OTHER -->

NAME is unique within its file. Options:

  needs=checkpoint  a tiny Hugging Face checkpoint (`save_hf`, and a character-level
                    tokenizer of 32 characters, a-z and " .,!?\n") is first written to
                    `<tmp>/checkpoint`; "path/to/" in the block stands for `<tmp>/`.
  needs=torch       skipped, saying why, without torch (the peers extra).
  devices=N         runs in a fresh Python process that sees N simulated CPU devices
                    (JAX fixes its device count when it starts).
  after=OTHER       runs in the namespace that block OTHER of the same file leaves
                    (OTHER, and what it follows, run first).

Python blocks (```python) run with `exec`, each in a fresh temporary working directory,
so relative paths such as run directories land there. A python block without a marker
fails `test_every_python_block_has_a_marker`: no example goes untested.

Shell blocks (```bash) are commands to read, not run, unless they carry a marker; a
marked shell block must be cheap (`--help`) and runs line by line from the repository
root: a line `python -m MODULE ARGS` through MODULE's `main(argv)` in this process (what
the shell's python runs, less a new interpreter and JAX's import), a line that starts with
a console script an installed package declares (`jaxformer-report`) through the function
its entry point names, in this process too, any other line in a shell. Plain ``` blocks
are printed output and are never run.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_main

ROOT = Path(__file__).resolve().parents[1]
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^```([\w+-]*)[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)
MARKER = re.compile(r"^<!--\s*test:\s*([\w.-]+)\s*((?:,\s*[\w-]+=[\w.-]+\s*)*)-->$")
ANY_MARKER = re.compile(r"<!--\s*test:")
OPTIONS = {"needs", "devices", "after"}
NEEDS = {"checkpoint", "torch"}


@dataclasses.dataclass(frozen=True)
class Block:
    file: str  # relative to the repository root
    line: int  # of the opening fence
    language: str
    code: str
    name: str | None
    options: tuple[tuple[str, str], ...]

    @property
    def id(self) -> str:
        return f"{self.file}::{self.name}"

    def option(self, key: str) -> str | None:
        return dict(self.options).get(key)


def _marker_before(text: str, start: int) -> str | None:
    before = text[:start].rstrip().rsplit("\n", 1)[-1].strip()
    return before if ANY_MARKER.match(before) else None


def parse(path: Path) -> list[Block]:
    text = path.read_text()
    blocks = []
    for match in FENCE.finditer(text):
        marker = _marker_before(text, match.start())
        name, options = None, ()
        if marker is not None:
            parsed = MARKER.match(marker)
            if not parsed:
                raise ValueError(f"{path.name}: malformed marker {marker!r}")
            name = parsed.group(1)
            options = tuple(tuple(part.split("=", 1)) for part in
                            (p.strip() for p in parsed.group(2).split(",")) if part)
        blocks.append(Block(str(path.relative_to(ROOT)), text.count("\n", 0, match.start()) + 1,
                            match.group(1), match.group(2), name, options))
    return blocks


BLOCKS = [block for path in DOC_FILES for block in parse(path)]
TESTED = [block for block in BLOCKS if block.name is not None]
BY_ID = {block.id: block for block in TESTED}


def test_docs_exist():
    assert (ROOT / "docs").is_dir() and len(DOC_FILES) > 1


def test_every_python_block_has_a_marker():
    untested = [f"{b.file}:{b.line}" for b in BLOCKS if b.language == "python" and b.name is None]
    assert not untested, f"python blocks without a <!-- test: NAME --> marker: {untested}"


def test_parse_finds_markers_and_unmarked_blocks(tmp_path, monkeypatch):
    page = tmp_path / "page.md"
    page.write_text("<!-- test: a, needs=torch -->\n```python\nx = 1\n```\n\n```python\ny = 2\n```\n"
                    "```bash\nls\n```\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    marked, unmarked, shell = parse(page)
    assert (marked.name, marked.option("needs"), marked.code) == ("a", "torch", "x = 1\n")
    assert unmarked.language == "python" and unmarked.name is None  # would fail the test above
    assert shell.language == "bash" and shell.name is None


def test_markers_are_well_formed():
    problems = []
    names = [block.id for block in TESTED]
    problems += [f"{name} is used twice" for name in sorted({n for n in names if names.count(n) > 1})]
    for block in TESTED:
        for key, value in block.options:
            if key not in OPTIONS:
                problems.append(f"{block.id}: unknown option {key}")
            elif key == "needs" and value not in NEEDS:
                problems.append(f"{block.id}: unknown needs={value}")
            elif key == "devices" and not value.isdigit():
                problems.append(f"{block.id}: devices={value} is not a count")
            elif key == "after" and f"{block.file}::{value}" not in BY_ID:
                problems.append(f"{block.id}: after={value} names no block of {block.file}")
        if block.language not in ("python", "bash"):
            problems.append(f"{block.id}: a marker on a ```{block.language} block (only python and bash run)")
    for path in DOC_FILES:  # every marker sits right above a code block
        text = path.read_text()
        marked = sum(1 for line in text.splitlines() if ANY_MARKER.match(line.strip()))
        assert marked == sum(1 for b in TESTED if b.file == str(path.relative_to(ROOT))), \
            f"{path.name}: a marker that is not directly above a code block"
    assert not problems, problems


def heading_anchors(page: str) -> set[str]:
    """The `#fragment`s GitHub gives the headings of markdown `page`: the heading's text as
    rendered (code spans' backticks, links' targets and HTML tags gone), lowercased, every
    character but letters, digits, spaces, `-` and `_` dropped, spaces turned to `-`; a
    repeated anchor is suffixed `-1`, `-2`, ... in order. Lines in code blocks are no headings."""
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    for line in FENCE.sub("", page).splitlines():
        heading = re.match(r"#{1,6}[ \t]+(.*?)(?:[ \t]+#+)?[ \t]*$", line)
        if heading is None:
            continue
        text = re.sub(r"<[^>]+>", "", re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.group(1)))
        slug = re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def test_heading_anchors_are_githubs():
    page = ("# Fine-tuning a checkpoint: `jaxformer-finetune`\n## Notes\n```bash\n# Notes\n```\n"
            "## Notes\n### See [the model](docs/x.md) & *more*, 2.0_b\n## Notes\n")
    assert heading_anchors(page) == {"fine-tuning-a-checkpoint-jaxformer-finetune", "notes", "notes-1", "notes-2",
                                     "see-the-model--more-20_b"}


def test_links_resolve():
    """Relative links between the pages (and to files of the repository) point at something,
    and a link's `#fragment` at a heading of the page it names (or of its own page)."""
    missing = []
    for path in DOC_FILES:
        for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
            if re.match(r"[a-z]+:", target):
                continue
            file, _, fragment = target.partition("#")
            page = path.parent / file if file else path
            if not page.exists():
                missing.append(f"{path.name} -> {target}")
            elif fragment and page.suffix == ".md" and fragment not in heading_anchors(page.read_text()):
                missing.append(f"{path.name} -> {target} (no such heading)")
    assert not missing, missing


def test_self_contained():
    """The pages cite nothing outside the repository."""
    outside = re.compile(r"REFERENCE\.md|shared/|seeds/")
    hits = [f"{path.name}: {line.strip()}" for path in DOC_FILES for line in path.read_text().splitlines()
            if outside.search(line)]
    assert not hits, hits


def layout_paths(page: str) -> set[str]:
    """The files named in the tree of `page`'s "## Layout" section, as repository paths.

    The tree is the section's first code block: a folder is a name ending in `/`, its
    entries are indented two spaces more, and a line whose first word is neither a folder
    nor a `.py` file continues the description above it.
    """
    section = re.split(r"^## Layout[ \t]*$", page, flags=re.M)
    assert len(section) == 2, "architecture.md has no single '## Layout' section"
    tree = FENCE.search(section[1])
    assert tree is not None, "the Layout section has no code block"
    folders: list[str] = []  # the folders enclosing the current line, outermost first
    paths = set()
    for line in tree.group(2).splitlines():
        if not line.strip():
            continue
        depth, name = (len(line) - len(line.lstrip(" "))) // 2, line.split()[0]
        if name.endswith("/") and depth <= len(folders):
            folders[depth:] = [name]
        elif name.endswith(".py") and depth <= len(folders):
            del folders[depth:]
            paths.add("".join(folders) + name)
    return paths


def test_layout_parses_folders_and_continuations():
    page = ("## Layout\n\n```\npkg/\n  a.py         one\n               b.py is a continuation\n"
            "  sub/\n    c.py       two\n  d.py       three\ntop.py       four\n```\n")
    assert layout_paths(page) == {"pkg/a.py", "pkg/sub/c.py", "pkg/d.py", "top.py"}


def test_layout_names_every_module():
    """docs/architecture.md's Layout lists every file of the package, and no file that is gone."""
    listed = layout_paths((ROOT / "docs" / "architecture.md").read_text())
    package = {str(path.relative_to(ROOT)) for path in (ROOT / "jaxformer").rglob("*.py")}
    missing = sorted(package - listed)
    assert not missing, f"docs/architecture.md's Layout does not name {missing}"
    gone = sorted(path for path in listed if not (ROOT / path).is_file())
    assert not gone, f"docs/architecture.md's Layout names files that do not exist: {gone}"


def _chain(block: Block) -> list[Block]:
    """The blocks to run, in order: what `block` comes after, then `block`."""
    chain, seen = [block], {block.id}
    while (after := chain[0].option("after")) is not None:
        previous = BY_ID[f"{block.file}::{after}"]
        assert previous.id not in seen, f"{block.id}: after= forms a cycle"
        chain.insert(0, previous)
        seen.add(previous.id)
    return chain


def _write_checkpoint(folder: Path) -> None:
    import jax
    import jax.numpy as jnp

    import jaxformer as jf
    from jaxformer.convert import save_hf
    from jaxformer.text import char_tokenizer, save_tokenizer

    config = jf.DecoderConfig(vocab_size=32, n_layer=1, n_head=2, n_kv_head=1, d_model=16, max_seq_len=64)
    # (Jitted: one compile, where the eager init compiles each of its operations.)
    params = jax.jit(jf.Decoder(config).init)(jax.random.key(0), jnp.zeros((1, 1), jnp.int32))["params"]
    save_hf(config, params, str(folder))
    save_tokenizer(char_tokenizer("abcdefghijklmnopqrstuvwxyz .,!?\n"), str(folder))  # 32 characters


PYTHON = [b for b in TESTED if b.language == "python"]
SHELL = [b for b in TESTED if b.language == "bash"]


_NAMESPACES: dict[str, dict] = {}  # what a block that others follow left behind


def _run(block: Block, substitute, namespace: dict) -> None:
    source = substitute(block.code)
    exec(compile(source, f"{block.file}::{block.name} (line {block.line})", "exec"), namespace)


def _namespace_after(block: Block, substitute) -> dict:
    """A copy of the namespace `block` leaves, running it (after its own `after=`) once."""
    if block.id not in _NAMESPACES:
        after = block.option("after")
        namespace = (_namespace_after(BY_ID[f"{block.file}::{after}"], substitute) if after
                     else {"__name__": "__docs__"})
        _run(block, substitute, namespace)
        _NAMESPACES[block.id] = namespace
    return dict(_NAMESPACES[block.id])


_FRESH_PROCESS_RESULTS: dict[str, str | None] = {}  # block id -> None (ran) or what failed


def _run_in_fresh_process(block: Block, chain: list[Block], substitute, devices: int, folder: Path) -> str | None:
    """Runs `chain` in a new Python process that sees `devices` CPU devices (JAX fixes its
    device count when it starts). One process also runs the blocks that follow `block`,
    and their results are kept for their own tests."""
    if block.id not in _FRESH_PROCESS_RESULTS:
        longest = max((_chain(b) for b in TESTED if block in _chain(b)), key=len)
        lines = ["namespace = {'__name__': '__docs__'}"]
        for b in longest:
            where = f"{b.file}::{b.name} (line {b.line})"
            lines += [f"exec(compile({substitute(b.code)!r}, {where!r}, 'exec'), namespace)",
                      f"print({'@@ran ' + b.id!r}, flush=True)"]
        xla_flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}"
        env = dict(os.environ, XLA_FLAGS=xla_flags,
                   PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        done = subprocess.run([sys.executable, "-c", "\n".join(lines)], env=env, capture_output=True, text=True,
                              timeout=600, cwd=folder)
        ran = set(re.findall(r"^@@ran (\S+)$", done.stdout, re.M))
        output = done.stdout[-4000:] + done.stderr[-6000:]
        for b in longest:
            _FRESH_PROCESS_RESULTS.setdefault(b.id, None if b.id in ran else output)
    return _FRESH_PROCESS_RESULTS[block.id]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """The tiny checkpoint, written once for the blocks that need one (each gets a copy)."""
    folder = tmp_path_factory.mktemp("docs") / "checkpoint"
    _write_checkpoint(folder)
    return folder


@pytest.mark.parametrize("block", PYTHON, ids=[b.id for b in PYTHON])
def test_python_block_runs(block, tmp_path, monkeypatch, request):
    chain = _chain(block)
    needs = {b.option("needs") for b in chain} - {None}
    if "torch" in needs:
        from conftest import torch_peer
        torch_peer()
    substitute = lambda source: source  # noqa: E731
    if "checkpoint" in needs:
        shutil.copytree(request.getfixturevalue("checkpoint"), tmp_path / "checkpoint")
        substitute = lambda source: source.replace("path/to/", f"{tmp_path}/")  # noqa: E731
    monkeypatch.chdir(tmp_path)
    devices = next((b.option("devices") for b in chain if b.option("devices")), None)
    if devices is not None:
        failure = _run_in_fresh_process(block, chain, substitute, int(devices), tmp_path)
        assert failure is None, failure
        return
    if block.id in _NAMESPACES:  # it already ran, first of a block that follows it
        return
    after = block.option("after")
    namespace = _namespace_after(BY_ID[f"{block.file}::{after}"], substitute) if after else {"__name__": "__docs__"}
    _run(block, substitute, namespace)
    if any(b.option("after") == block.name and b.file == block.file for b in TESTED):
        _NAMESPACES[block.id] = namespace


def _run_shell_line(command: str) -> subprocess.CompletedProcess:
    words = shlex.split(command)
    if words[:2] == ["python", "-m"] and len(words) > 2:
        return run_main(importlib.import_module(words[2]).main, words[3:])
    scripts = importlib.metadata.entry_points(group="console_scripts", name=words[0]) if words else ()
    if scripts:  # the function the script the shell would find calls (the commands' `main(argv)`)
        return run_main(next(iter(scripts)).load(), words[1:])
    return subprocess.run(command, shell=True, cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("block", SHELL, ids=[b.id for b in SHELL])
def test_shell_block_runs(block, monkeypatch):
    monkeypatch.chdir(ROOT)
    for line in block.code.splitlines():
        command = line.split("#", 1)[0].strip()
        if command:
            done = _run_shell_line(command)
            assert done.returncode == 0, f"{command}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
