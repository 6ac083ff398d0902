"""The documentation's code runs: every fenced block of docs/**/*.md and README.md is either executed here
or says, in a marker the test checks, why it is not.

An HTML comment just before a fence (invisible on the site and on GitHub) says what a block is:

- ``<!-- run ... -->`` before a ```python or ```bash block: it is executed, in an empty directory of its
  own (a bash block's directory also holds links to the repository's top-level files, so that
  ``scripts/...`` and ``examples/...`` resolve). The comment may reduce a long example or give it what the
  page leaves out, one instruction per line::

      <!-- run
      setup: import torch                      (a line run before the block; indent kept)
      replace: max_steps=1000 => max_steps=4   (a text substitution in the block; the text must be there)
      after: assert trainer.global_step == 4   (a line run after the block)
      exit: 138                                (the exit code it must end with; 0 by default)
      name: model                              (names the block, for other blocks of its page)
      use: model                               (runs the named block's program first; a block
                                                that others use runs as their first part only)
      launch: 2                                (runs on 2 ranks, as `trainforge launch --nproc-per-node 2`)
      -->

  A ``replace`` whose text is no longer in the block fails, so the page cannot drift from what runs.
- ``<!-- output -->`` before a ```text block: the output of the run block just above it (an error
  message as users see it). The run's output must contain it: its lines in order, whitespace runs
  compared as one space, ``...`` standing for any text.
- ``<!-- not run: REASON -->``: a block that cannot run here (a GPU, several machines); the reason
  is required and is shown by ``pytest -rA`` through the test of the not-run blocks.
- a block with no marker that is, character for character, a run block of another page (the README's
  two commands are the quickstart's) is that block: it ran there.
- ```text blocks with no marker are not code (a diagram, a sample of a log); any other fence without a
  marker fails the test.

All blocks run in one child process (tests/helpers/docs_runner.py): torch and trainforge are imported
once there, and each python block runs in a forked child of it, so a block costs what its own code costs.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Dict, List, NamedTuple, Optional, Tuple

import pytest

from tests.helpers import procs

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted((ROOT / "docs").rglob("*.md")) + [ROOT / "README.md"]
FENCE = re.compile(r"^```(?P<lang>[\w-]*)[^\n]*\n(?P<code>.*?)^```[ \t]*$", re.S | re.M)
MARKER = re.compile(r"<!--(?P<body>(?:(?!-->).)*)-->\s*\Z", re.S)
RUNNABLE = ("python", "bash")
BLOCK_TIMEOUT = 120
# what a bash block's directory links to: the checkout, without what runs write into
NOT_LINKED = {".git", "build", "runs", "site", ".venv"}


class Block(NamedTuple):
    page: str
    line: int
    lang: str
    marker: Optional[str]  # the comment's text just before the fence, or None
    code: str

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def fenced_blocks() -> List[Block]:
    blocks = []
    for page in PAGES:
        text = page.read_text()
        for match in FENCE.finditer(text):
            line = text.count("\n", 0, match.start("code")) + 1
            marker = MARKER.search(text, 0, match.start())
            body = marker["body"] if marker else None
            blocks.append(Block(str(page.relative_to(ROOT)), line, match["lang"], body, match["code"]))
    return blocks


BLOCKS = fenced_blocks()


def kind(block: Block) -> str:
    """'run', 'output', 'not run', 'copy' or 'text'; anything else is an unmarked code block (an error)."""
    marker = (block.marker or "").strip()
    if marker == "run" or marker.startswith(("run\n", "run ")):
        return "run"
    if marker == "output":
        return "output"
    if marker.startswith("not run:"):
        return "not run"
    if block.lang == "text":
        return "text"
    return (
        "copy" if any(kind(b) == "run" and (b.lang, b.code) == (block.lang, block.code) for b in BLOCKS) else "unmarked"
    )


def directives(block: Block) -> List[Tuple[str, str]]:
    found = []
    for raw in block.marker.strip()[3:].strip().splitlines():
        directive, _, value = raw.strip().partition(":")
        found.append((directive, value[1:].rstrip() if value.startswith(" ") else value.rstrip()))  # keeps indents
    return found


def named(page: str, name: str) -> Block:
    for block in BLOCKS:
        if block.page == page and kind(block) == "run" and ("name", name) in directives(block):
            return block
    raise AssertionError(f"{page}: no run block has 'name: {name}'")


def program(block: Block) -> Tuple[str, int]:
    code, before, after, exit_code = block.code, [], [], 0
    for directive, value in directives(block):
        if directive == "setup":
            before.append(value)
        elif directive == "use":
            before.insert(0, program(named(block.page, value))[0])
        elif directive in ("name", "launch"):
            pass
        elif directive == "after":
            after.append(value)
        elif directive == "exit":
            exit_code = int(value)
        elif directive == "replace":
            old, _, new = value.partition(" =>")  # "=>" at the end of the line: replace with nothing
            new = new[1:] if new.startswith(" ") else new
            assert old in code, f"{block.id}: 'replace: {old}' is not in the block any more"
            code = code.replace(old, new)
        else:
            raise AssertionError(f"{block.id}: unknown run directive {directive!r}")
    return "\n".join([*before, code, *after]) + "\n", exit_code


def expected_outputs() -> Dict[str, str]:
    """The run block's id -> the ```text block shown as its output."""
    shown = {}
    for previous, block in zip(BLOCKS, BLOCKS[1:]):
        if kind(block) == "output":
            assert previous.page == block.page and kind(previous) == "run", (
                f"{block.id}: an <!-- output --> block must come just after a run block"
            )
            shown[previous.id] = block.code
    return shown


def contains(output: str, shown: str) -> bool:
    """``shown``'s lines in order in ``output``, whitespace runs as one space, ``...`` as any text."""
    flat = " ".join(output.split())
    pieces = [" ".join(p.split()) for p in re.split(r"\.\.\.", shown)]
    at = 0
    for piece in filter(None, pieces):
        at = flat.find(piece, at)
        if at < 0:
            return False
        at += len(piece)
    return True


def launched(block: Block) -> int:
    """The processes ``launch: N`` asks for; 0: the block runs as ``python example.py``."""
    return next((int(value) for directive, value in directives(block) if directive == "launch"), 0)


USED = {(b.page, value) for b in BLOCKS if kind(b) == "run" for directive, value in directives(b) if directive == "use"}
RUN: Dict[Tuple[str, str, int, int], Block] = {}  # a program shown twice (README and a guide) runs once
for _block in BLOCKS:
    if kind(_block) == "run" and not any((_block.page, v) in USED for d, v in directives(_block) if d == "name"):
        RUN.setdefault((_block.lang, *program(_block), launched(_block)), _block)
TO_RUN = list(RUN.values())
OUTPUTS = expected_outputs()


def test_every_code_block_is_run_or_says_why_not():
    unmarked = [f"{b.id} (```{b.lang})" for b in BLOCKS if kind(b) == "unmarked"]
    assert not unmarked, f"code blocks with no <!-- run --> or <!-- not run: reason --> marker: {unmarked}"
    wrong = [b.id for b in BLOCKS if kind(b) == "run" and b.lang not in RUNNABLE]
    assert not wrong, f"<!-- run --> before a block that is not ```python or ```bash: {wrong}"
    no_reason = [b.id for b in BLOCKS if kind(b) == "not run" and len(b.marker.split(":", 1)[1].strip()) < 10]
    assert not no_reason, f"<!-- not run: ... --> needs its reason: {no_reason}"
    stray = [b.id for b in BLOCKS if b.marker and b.marker.strip().startswith("run") and kind(b) != "run"]
    assert not stray, stray


def test_not_run_blocks_are_few_and_say_why():
    not_run = {b.id: b.marker.split(":", 1)[1].strip() for b in BLOCKS if kind(b) == "not run"}
    print("\n".join(f"not run: {where}: {why}" for where, why in not_run.items()))
    run = [b for b in BLOCKS if kind(b) == "run"]
    assert len(not_run) <= len(run) // 4, f"most blocks must run; not run: {not_run}"


def test_the_getting_started_pages_have_runnable_examples():
    pages = {b.page for b in BLOCKS if kind(b) == "run"}
    for page in ("README.md", "docs/guides/training-module.md", "docs/guides/accelerator.md"):
        assert page in pages, f"{page} has no runnable example"


TWO_COMMANDS = """bash scripts/install.sh && python3 -m trainforge launch --nproc-per-node 2 examples/char_gpt.py
bash scripts/install.sh && bash scripts/install-test-tools.sh && python3 -m pytest -q
"""


def test_the_readme_starts_with_the_two_commands_and_links_into_the_site():
    readme = (ROOT / "README.md").read_text()
    # the title, then the two commands: install and train on 2 processes; install and run the tests
    assert readme.startswith("# trainforge\n\n```bash\n" + TWO_COMMANDS + "```\n"), readme[:300]
    assert len(readme.splitlines()) <= 120, "the README is what a newcomer reads first: keep the rest in docs/"
    links = re.findall(r"\]\(((?:docs/)[^)#]*)", readme)
    missing = [link for link in links if not (ROOT / link).exists()]
    assert not missing, f"README links to pages that do not exist: {missing}"
    guides = {p.relative_to(ROOT).as_posix() for p in (ROOT / "docs/guides").glob("*.md")}
    assert not guides - set(links), f"guides the README does not link to: {sorted(guides - set(links))}"


def test_the_troubleshooting_page_shows_real_messages():
    shown = [block_id for block_id in OUTPUTS if block_id.startswith("docs/guides/troubleshooting.md")]
    assert len(shown) >= 8, shown


def test_output_matching():
    log = "Traceback (most recent call last):\n  ...\nConfigurationError: precision='fp17' is not\n one of: 32"
    assert contains(log, "ConfigurationError: precision='fp17' is not one of: 32")
    assert contains(log, "Traceback ...\nConfigurationError: ... one of")
    assert not contains(log, "one of: 32 ... precision")
    assert not contains(log, "precision='fp16'")


def _link_checkout(directory: Path) -> None:
    for entry in ROOT.iterdir():
        if entry.name not in NOT_LINKED and not entry.name.startswith(".pytest"):
            (directory / entry.name).symlink_to(entry, target_is_directory=entry.is_dir())


@pytest.fixture(scope="module")
def ran(request, tmp_path_factory) -> Dict[str, dict]:
    """The selected runnable blocks (all, unless -k chose some), run once by tests/helpers/docs_runner.py;
    block id -> result and output."""
    chosen = {
        item.callspec.params["block"].id
        for item in request.session.items
        if getattr(item, "callspec", None) is not None and "block" in item.callspec.params
    }
    base = tmp_path_factory.mktemp("docs_blocks")
    spec = []
    for number, block in enumerate(b for b in TO_RUN if b.id in chosen):
        directory = base / f"{number:02d}"
        directory.mkdir()
        code, _ = program(block)
        if block.lang == "bash":
            _link_checkout(directory)
        (directory / ("example.py" if block.lang == "python" else "example.sh")).write_text(code)
        spec.append(
            {
                "id": block.id,
                "kind": block.lang,
                "code": code,
                "dir": str(directory),
                "timeout": BLOCK_TIMEOUT,
                "launch": launched(block),
            }
        )
    (base / "spec.json").write_text(json.dumps(spec))
    results = base / "results.json"
    runner = [sys.executable, "-m", "tests.helpers.docs_runner", base / "spec.json", results]
    done = procs.run(runner, cwd=ROOT, timeout=BLOCK_TIMEOUT * len(spec) + 60, check=False)
    assert done.returncode == 0, done.stdout[-4000:]
    found = json.loads(results.read_text())
    for item in spec:
        found[item["id"]]["output"] = (Path(item["dir"]) / "output.txt").read_text(errors="replace")
        found[item["id"]]["dir"] = item["dir"]
    return found


# The first of these tests waits for all the blocks (the fixture): more than pytest-timeout's default on
# a loaded 2-core machine (about 90 s of blocks on an idle one).
@pytest.mark.timeout(900)
@pytest.mark.parametrize("block", TO_RUN, ids=[b.id for b in TO_RUN])
def test_code_block_runs(block, ran):
    result = ran[block.id]
    _, exit_code = program(block)
    where = f"{block.id} ({result['dir']}, {result['seconds']} s)"
    assert result["exit"] == exit_code, (
        f"{where} exited with {result['exit']}, not {exit_code}:\n{result['output'][-4000:]}"
    )
    shown = OUTPUTS.get(block.id)
    if shown is not None:
        assert contains(result["output"], shown), (
            f"{where}: the page shows an output that the block does not print.\nshown:\n{shown}\n"
            f"printed:\n{result['output'][-4000:]}"
        )
