"""The documentation's code runs: every ```python block of docs/**/*.md and README.md marked runnable is
executed, each in its own process, in an empty directory.

A block is runnable when an HTML comment that starts with ``<!-- run`` comes just before its fence
(invisible on the site and on GitHub). The comment may reduce a long example or give it what the page
leaves out, one instruction per line:

    <!-- run
    setup: import torch                      (a line of Python run before the block; indent kept)
    replace: max_steps=1000 => max_steps=4   (a text substitution in the block; the text must be there)
    after: assert trainer.global_step == 4   (a line of Python run after the block)
    exit: 138                                (the exit code it must end with; 0 by default)
    -->

A ``replace`` whose text is no longer in the block fails, so the page cannot drift from what runs.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import List, NamedTuple, Tuple

import pytest

from tests.helpers import procs

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted((ROOT / "docs").rglob("*.md")) + [ROOT / "README.md"]
MARK = re.compile(r"^<!-- run(?P<body>(?:(?!-->).)*)-->\s*\n```python\n(?P<code>.*?)^```", re.S | re.M)


class Block(NamedTuple):
    page: str
    line: int
    directives: str
    code: str


def runnable_blocks() -> List[Block]:
    blocks = []
    for page in PAGES:
        text = page.read_text()
        for match in MARK.finditer(text):
            line = text.count("\n", 0, match.start("code")) + 1
            blocks.append(Block(str(page.relative_to(ROOT)), line, match["body"], match["code"]))
        marks = text.count("<!-- run")
        found = sum(1 for b in blocks if b.page == str(page.relative_to(ROOT)))
        assert marks == found, f"{page}: a '<!-- run' comment that is not just before a ```python block"
    return blocks


def program(block: Block) -> Tuple[str, int]:
    code, before, after, exit_code = block.code, [], [], 0
    for raw in block.directives.strip().splitlines():
        kind, _, value = raw.strip().partition(":")
        value = value[1:].rstrip() if value.startswith(" ") else value.rstrip()  # keeps a setup line's indent
        if kind == "setup":
            before.append(value)
        elif kind == "after":
            after.append(value)
        elif kind == "exit":
            exit_code = int(value)
        elif kind == "replace":
            old, _, new = value.partition(" => ")
            assert old in code, f"{block.page}:{block.line}: 'replace: {old}' is not in the block any more"
            code = code.replace(old, new)
        else:
            raise AssertionError(f"{block.page}:{block.line}: unknown run directive {raw.strip()!r}")
    return "\n".join([*before, code, *after]) + "\n", exit_code


def distinct(blocks: List[Block]) -> List[Block]:
    """The guides are copies of the README's sections: a program shown twice runs once."""
    seen: dict = {}
    for block in blocks:
        seen.setdefault(program(block), block)
    return list(seen.values())


BLOCKS = runnable_blocks()
RUN = distinct(BLOCKS)


def test_the_getting_started_pages_have_runnable_examples():
    pages = {b.page for b in BLOCKS}
    for page in ("docs/guides/training-module.md", "docs/guides/accelerator.md"):
        assert page in pages, f"{page} has no runnable example"


def test_the_readme_examples_are_marked_as_in_the_guides():
    readme = [b for b in BLOCKS if b.page == "README.md"]
    assert len(readme) >= 8, [f"{b.page}:{b.line}" for b in readme]


@pytest.mark.parametrize("block", RUN, ids=[f"{b.page}:{b.line}" for b in RUN])
def test_code_block_runs(block, tmp_path):
    script = tmp_path / "example.py"
    code, exit_code = program(block)
    script.write_text(code)
    done = procs.run([sys.executable, script], cwd=tmp_path, timeout=120, check=False)
    assert done.returncode == exit_code, (
        f"{block.page}:{block.line} exited with {done.returncode}, not {exit_code} ({script}):\n{done.stdout[-4000:]}"
    )
