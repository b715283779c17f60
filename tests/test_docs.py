"""Every fenced block of README.md and docs/**/*.md runs, or the docs say why not.

Python blocks run; shell blocks run (at a reduced size where the block's note says
``shrink ...``), each page's blocks in order in a copy of the repository with a private Flower
home; a plain ``flwr run`` passes only when every run of its local SuperLink completed (it
exits 0 for a failed run). TOML blocks are parsed; text blocks are shown. A block that cannot
run here (several hosts, a GPU, hours of compute, an install) carries its reason, and
``test_the_skipped_blocks_are_few_and_printed`` prints the list. A long command shown on two
pages (the README's and the quickstart's first simulation) runs once. How notes are written:
``tests/docs_support.py``.
"""

from __future__ import annotations

import re

import pytest
from docs_support import ROOT, Block, Sandbox, all_blocks, blocks, markdown_files, shrink

BLOCKS = all_blocks()
#: at most this many blocks may be skipped: the list must stay short (the long sweeps and benchmarks whose
#: figures the docs show: measurements, not checks)
MAX_SKIPPED = 31


@pytest.fixture(scope="session")
def sandboxes(tmp_path_factory):
    made: dict[str, Sandbox] = {}

    def get(page: str) -> Sandbox:
        if page not in made:
            made[page] = Sandbox(tmp_path_factory.mktemp(re.sub(r"\W+", "-", page)))
        return made[page]

    yield get
    for box in made.values():
        box.close()


def _param(block: Block):
    marks = [pytest.mark.realproc] if block.realproc else []
    return pytest.param(block, id=block.id, marks=marks)


@pytest.mark.parametrize("block", [_param(b) for b in BLOCKS if b.kind in ("run", "parsed")])
def test_block_runs(block: Block, sandboxes):
    program = block.note.get("requires")
    if program and not (shutil_which(program) or (ROOT.root / "usr" / "sbin" / program).exists()):
        pytest.skip(f"{block.id}: needs {program} (CI installs it; Debian: apt-get install {program})")
    sandboxes(block.page).run(block)


def shutil_which(program: str) -> str | None:
    import shutil

    return shutil.which(program)


def test_every_block_is_run_parsed_shown_or_explained():
    kinds = {b.kind for b in BLOCKS}
    assert kinds <= {"run", "parsed", "shown", "skipped"}
    unknown = [b.id for b in BLOCKS if b.kind == "shown" and b.lang not in ("", "text")]
    assert not unknown, f"blocks in a language the test neither runs nor shows: {unknown}"
    assert sum(b.kind == "run" for b in BLOCKS) >= 30  # the docs' commands, not a handful


def test_the_skipped_blocks_are_few_and_printed(capsys):
    skipped = [b for b in BLOCKS if b.kind == "skipped"]
    with capsys.disabled():
        print(f"\n{len(skipped)} of {len(BLOCKS)} fenced blocks of README.md and docs/ are not run:")
        for b in skipped:
            print(f"  {b.id}: {b.skip_reason}")
    assert len(skipped) <= MAX_SKIPPED
    assert all(len(b.skip_reason) >= 20 for b in skipped)  # a reason, not a word


def test_the_long_blocks_are_marked_realproc():
    """Flower runs and deployments take tens of seconds: the fast suite leaves them out."""
    long = re.compile(r"(^|[\s;&|(])flwr\s+run\b|simulations\.flower|simulations\.demo|simulations\.runner|torchrun")
    unmarked = [b.id for b in BLOCKS if b.kind == "run" and b.lang != "python" and long.search(b.code) and not b.realproc]
    assert not unmarked, f"long blocks without realproc: {unmarked}"


def test_shrink_replaces_or_adds_keys():
    assert shrink('flwr run . --run-config "num-rounds=20 lr=0.1"', "num-rounds=2") == \
        'flwr run . --run-config "num-rounds=2 lr=0.1"'
    assert shrink("FLWR_X=1 flwr run . --stream", "num-rounds=2") == 'FLWR_X=1 flwr run . --stream --run-config "num-rounds=2"'
    assert shrink("python -m simulations.runner a.toml \\\n    --backend engine  # note", "num-rounds=1") == \
        "python -m simulations.runner a.toml      --backend engine --set num-rounds=1 # note"
    assert shrink("python -m simulations.demo  # figures", "--rounds-scale=0.1") == \
        "python -m simulations.demo --rounds-scale 0.1 # figures"
    assert shrink("ls results", "num-rounds=2") == "ls results"


def test_notes_sit_on_fences_and_name_known_items(tmp_path):
    bad = tmp_path / "bad.md"
    for text, message in [("<!-- docs-test: realproc -->\ntext\n", "right above a fence"),
                          ("<!-- docs-test: shrinkk a=1 -->\n```bash\nls\n```\n", "unknown docs-test item"),
                          ("<!-- docs-test: skip: -->\n```bash\nls\n```\n", "needs its reason")]:
        bad.write_text(text)
        with pytest.raises(ValueError, match=message):
            blocks_of(bad)


def blocks_of(path):
    import docs_support

    saved = docs_support.ROOT
    docs_support.ROOT = path.parent
    try:
        return blocks(path)
    finally:
        docs_support.ROOT = saved


def test_readme_is_short_and_its_links_resolve():
    text = (ROOT / "README.md").read_text()
    assert len(text.split("\n")) <= 200
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://", target):
            continue
        path = target.split("#")[0]
        assert (ROOT / path).exists(), f"README.md links to {target}, which does not exist"


def test_every_page_is_found():
    pages = [p.relative_to(ROOT).as_posix() for p in markdown_files()]
    assert "README.md" in pages and "docs/quickstart.md" in pages and "docs/message-path.md" in pages
