"""The fenced blocks of README.md and docs/**/*.md, what their annotations say, and how a block runs.

A block is run or explained according to the HTML comment on the line right above its fence
(invisible on the rendered page)::

    <!-- docs-test: realproc; shrink num-rounds=2 -->
    ```bash
    flwr run . --stream
    ```

Items, separated by ``;``:

* ``skip: REASON`` -- not run; the reason is printed (several hosts, a GPU, hours of compute, an
  install that CI's ``.ci/run`` performs, data that cannot be fetched here);
* ``realproc`` -- a long real-process block: the fast suite (``-m "not realproc"``) leaves it out;
* ``shrink KEY=VALUE ...`` -- run at a reduced size: each ``KEY=...`` in the commands takes the new
  value, and a command that runs the app (``flwr run``, ``python -m simulations.flower``, the
  engine, ``torchrun``, the runner) without the key gets it as an override; ``--option=VALUE``
  replaces or adds a command-line option;
* ``cwd=PATH`` -- run in that folder of the repository copy;
* ``file=PATH`` -- the block is that file: written there before later blocks run (Python: then run);
* ``check=NAME`` -- a Python block: after it ran, ``CHECKS[NAME]`` exercises what it defined;
* ``requires=PROGRAM`` -- skipped, naming the program, where it is not installed;
* ``timeout=SECONDS``.

Languages: ``python`` and ``bash`` run; ``toml`` is parsed (and written where ``file=`` says);
``text`` (or none) is shown, not run: a diagram, a file tree, output. ``--8<-- "path"`` lines
(pymdownx.snippets, as the site build expands them) stand for the repository file.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
RUN_LANGUAGES = {"python", "bash", "sh", "shell"}
SHOWN_LANGUAGES = {"", "text"}
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<lang>[\w+-]*)[^\n]*$")
NOTE = re.compile(r"^[ \t]*<!--\s*docs-test:\s*(?P<body>.*?)\s*-->[ \t]*$")
SNIPPET = re.compile(r'^[ \t]*--8<--\s+"(?P<path>[^"]+)"[ \t]*$')
#: commands that take run-config keys: (how a command line starts, how a key is added to it)
RUN_CONFIG_COMMANDS = [
    (re.compile(r"(^|[\s;&|(])flwr\s+run\b"), '--run-config "{kv}"'),
    (re.compile(r"-m\s+simulations\.flower(\.deploy)?\b"), '--run-config "{kv}"'),
    (re.compile(r"-m\s+simulations\.engine\b"), '--run-config "{kv}"'),
    (re.compile(r"-m\s+simulations\.runner\b"), "--set {kv}"),
]
#: not copied into a page's sandbox: the repository's own outputs and caches (top level), caches anywhere
TOP_LEVEL_IGNORED = {".git", ".venv", "site", "results", "runs", "data", "figures", ".flwr-home", ".ci-flwr-home",
                     "build", "dist", "certs", "gpu-out"}
IGNORED_ANYWHERE = shutil.ignore_patterns("__pycache__", "*.egg-info", ".pytest_cache", ".hypothesis", ".ruff_cache")


def _ignored(folder: str, names: list[str]) -> set[str]:
    top = TOP_LEVEL_IGNORED if Path(folder) == ROOT else set()
    return (top & set(names)) | set(IGNORED_ANYWHERE(folder, names))


def markdown_files() -> list[Path]:
    """README.md and every page of docs/ (the tools' tables under docs/figures/ hold no commands)."""
    pages = sorted(p for p in (ROOT / "docs").rglob("*.md") if "figures" not in p.relative_to(ROOT / "docs").parts)
    return [ROOT / "README.md", *pages]


@dataclass
class Block:
    page: str  # relative to the repository root
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    note: dict[str, str] = field(default_factory=dict)

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def realproc(self) -> bool:
        return "realproc" in self.note

    @property
    def skip_reason(self) -> str | None:
        return self.note.get("skip")

    @property
    def kind(self) -> str:
        if self.skip_reason is not None:
            return "skipped"
        if self.lang in RUN_LANGUAGES:
            return "run"
        if self.lang == "toml":
            return "parsed"
        return "shown"


def parse_note(body: str, where: str) -> dict[str, str]:
    note: dict[str, str] = {}
    items = [body[body.index("skip:"):]] if body.startswith("skip:") else [i.strip() for i in body.split(";") if i.strip()]
    for item in items:
        if item.startswith("skip:"):
            note["skip"] = item[len("skip:"):].strip()
        elif item == "realproc":
            note["realproc"] = ""
        elif item.startswith("shrink "):
            note["shrink"] = item[len("shrink "):].strip()
        elif (m := re.fullmatch(r"(cwd|file|check|requires|timeout)=(\S+)", item)):
            note[m.group(1)] = m.group(2)
        else:
            raise ValueError(f"{where}: unknown docs-test item {item!r}")
    if "skip" in note and not note["skip"]:
        raise ValueError(f"{where}: a skipped block needs its reason")
    return note


def expand_snippets(code: str, where: str) -> str:
    out = []
    for line in code.split("\n"):
        m = SNIPPET.match(line)
        if m:
            path = ROOT / m.group("path")
            if not path.is_file():
                raise FileNotFoundError(f"{where}: snippet {m.group('path')} does not exist")
            out.append(path.read_text().rstrip("\n"))
        else:
            out.append(line)
    return "\n".join(out)


def blocks(path: Path) -> list[Block]:
    """Every fenced block of a markdown file, its code (snippets expanded, indentation removed), its note."""
    lines = path.read_text().split("\n")
    rel = path.relative_to(ROOT).as_posix()
    found, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            if NOTE.match(lines[i]) and not (i + 1 < len(lines) and FENCE.match(lines[i + 1])):
                raise ValueError(f"{rel}:{i + 1}: a docs-test note must be the line right above a fence")
            i += 1
            continue
        indent, fence, lang = m.group("indent"), m.group("fence"), m.group("lang").lower()
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == fence), None)
        if end is None:
            raise ValueError(f"{rel}:{i + 1}: unclosed fence")
        body = [line[len(indent):] if line.startswith(indent) else line.lstrip() for line in lines[i + 1:end]]
        note_match = NOTE.match(lines[i - 1]) if i else None
        where = f"{rel}:{i + 1}"
        note = parse_note(note_match.group("body"), where) if note_match else {}
        found.append(Block(rel, i + 1, lang, expand_snippets("\n".join(body), where) + "\n", note))
        i = end + 1
    return found


def all_blocks() -> list[Block]:
    return [b for path in markdown_files() for b in blocks(path)]


# --- shrinking a command ------------------------------------------------------------------------
def _logical_lines(code: str) -> list[str]:
    """Shell lines with their ``\\`` continuations joined."""
    out, cur = [], ""
    for line in code.split("\n"):
        if line.rstrip().endswith("\\"):
            cur += line.rstrip()[:-1] + " "
        else:
            out.append(cur + line)
            cur = ""
    if cur:
        out.append(cur)
    return out


def _split_comment(line: str) -> tuple[str, str]:
    """(command, trailing ``# comment``) -- a ``#`` outside quotes after a space starts a comment."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip(), " " + line[i:]
    return line, ""


def shrink(code: str, spec: str) -> str:
    """The shell code at a reduced size (the module docstring says how)."""
    items = shlex.split(spec)
    lines = []
    for line in _logical_lines(code):
        command, comment = _split_comment(line)
        for item in items:
            key, _, value = item.partition("=")
            if key.startswith("--"):
                if not re.search(r"(^|\s)python\s+-m\s+simulations\.", command) and "torchrun" not in command:
                    continue
                pattern = re.compile(rf"(\s{re.escape(key)})(?:=|\s+)\S+")
                if pattern.search(command):
                    command = pattern.sub(lambda m, v=value: f"{m.group(1)} {v}", command)
                else:
                    command = f"{command} {key} {value}"
                continue
            pattern = re.compile(rf"(?<![\w-]){re.escape(key)}=[^\s\"']+")
            if pattern.search(command):
                command = pattern.sub(f"{key}={value}", command)
                continue
            for starts, add in RUN_CONFIG_COMMANDS:
                if starts.search(command):
                    command = f"{command} {add.format(kv=f'{key}={value}')}"
                    break
        lines.append(command + comment)
    return "\n".join(lines)


# --- where a page's blocks run ------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: long commands that passed in this session (shell code as run, cwd) -> the block that ran it
PASSED: dict[tuple[str, str], str] = {}


class Sandbox:
    """A copy of the repository in which one page's blocks run in order, with a private Flower home."""

    def __init__(self, where: Path):
        self.root = where / "repo"
        shutil.copytree(ROOT, self.root, ignore=_ignored)
        self.flwr_home = self.root / ".flwr-home"
        self.env = {
            **os.environ,
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
            "PYTHONPATH": os.pathsep.join([str(self.root), *filter(None, [os.environ.get("PYTHONPATH")])]),
            "FLWR_HOME": str(self.flwr_home),
            "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(free_port()),
            # the quickstart says to set it: Flower then runs the app in this environment
            "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
            "XDG_CONFIG_HOME": str(self.root / ".config"),  # server/deploy/make_certs.sh writes its keys there
            "MPLBACKEND": "Agg",
        }

    def cwd(self, block: Block) -> Path:
        return self.root / block.note.get("cwd", ".")

    def run(self, block: Block) -> str:
        """Run (or parse) a block; raises AssertionError with the output when it fails. The page's
        earlier ``file=`` blocks are written first, so that a block also runs when a marker
        (``-m realproc`` or ``-m "not realproc"``) left out the one that wrote its file."""
        for earlier in blocks(ROOT / block.page):
            if earlier.line < block.line and "file" in earlier.note and earlier.kind != "skipped":
                self._write(earlier, self.cwd(earlier))
        timeout = float(block.note.get("timeout", 600))
        cwd = self.cwd(block)
        if block.lang == "toml":
            import tomllib

            tomllib.loads(block.code)
            self._write(block, cwd)
            return ""
        if block.lang == "python":
            target = self._write(block, cwd) or cwd / f".docs-block-{block.line}.py"
            target.write_text(block.code)
            if "check" in block.note:
                code = (f"import runpy, sys; sys.path.insert(1, {str(TESTS)!r}); import docs_support; "
                        f"docs_support.CHECKS[{block.note['check']!r}](runpy.run_path({str(target)!r}))")
                return self._process([sys.executable, "-c", code], cwd, timeout, block)
            return self._process([sys.executable, str(target)], cwd, timeout, block)
        code = shrink(block.code, block.note["shrink"]) if "shrink" in block.note else block.code
        same = (code, block.note.get("cwd", "."))
        if block.realproc and same in PASSED:  # a long command that another page shows too: run once
            return f"the same command as {PASSED[same]}, which passed"
        out = self._process(["bash", "-e", "-o", "pipefail", "-c", code], cwd, timeout, block)
        self.check_flower_runs(block, timeout)
        PASSED[same] = block.id
        return out

    def _write(self, block: Block, cwd: Path) -> Path | None:
        if "file" not in block.note:
            return None
        target = cwd / block.note["file"]
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(block.code)
        return target

    def _process(self, cmd: list[str], cwd: Path, timeout: float, block: Block) -> str:
        proc = subprocess.Popen(cmd, cwd=cwd, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            raise AssertionError(f"{block.id}: still running after {timeout:.0f} s\n{out[-4000:]}") from None
        assert proc.returncode == 0, f"{block.id}: exit status {proc.returncode}\n{out[-6000:]}"
        return out

    # --- plain `flwr run` exits 0 for a failed run: the runs' statuses decide --------------------
    def local_superlink(self) -> bool:
        return (self.flwr_home / "local-superlink").exists()

    def flower_runs(self) -> list[dict[str, Any]]:
        from server.deploy.cli_json import parse_cli_json

        out = subprocess.run(["flwr", "ls", "--format", "json"], cwd=self.root, env=self.env, capture_output=True,
                             text=True, timeout=120)
        data = parse_cli_json(out.stdout)
        assert data.get("success"), f"flwr ls failed: {out.stdout[-2000:]} {out.stderr[-2000:]}"
        return data["runs"]

    def check_flower_runs(self, block: Block, timeout: float) -> None:
        """Every run the local SuperLink holds has finished and completed (waiting for a run that
        ``flwr run`` without ``--stream`` left running)."""
        if not self.local_superlink():
            return
        deadline = time.monotonic() + timeout
        while True:
            runs = self.flower_runs()
            if all(r["status"].startswith("finished") for r in runs) or time.monotonic() > deadline:
                break
            time.sleep(2.0)
        bad = [f"run {r['run-id']}: {r['status']} {r.get('status-details', '')}" for r in runs
               if r["status"] != "finished:completed"]
        assert not bad, f"{block.id}: Flower runs that did not complete: {bad}"

    def close(self) -> None:
        if self.local_superlink():
            subprocess.run([sys.executable, "-m", "simulations.flower", "stop-local", "--flwr-home", str(self.flwr_home)],
                           cwd=self.root, env=self.env, capture_output=True, timeout=120)


# --- checks of what a Python block defined ---------------------------------------------------------
def _quickstart_client_app():
    """The example app's ClientApp and task module, imported from examples/quickstart-celgc (its
    ``client`` and ``task`` modules shadow this project's ``client`` package in this process)."""
    import importlib

    example = next(p for p in (Path.cwd(), Path.cwd() / "examples" / "quickstart-celgc") if (p / "task.py").is_file())
    sys.path.insert(0, str(example))
    for name in ("client", "task"):
        sys.modules.pop(name, None)
    try:
        return importlib.import_module("client").app, importlib.import_module("task")
    finally:
        sys.path.remove(str(example))


def check_strategy_starts(ns: dict[str, Any]) -> None:
    """The README's strategy object trains two rounds with the example app's clients (in process)."""
    from flwr.app import ArrayRecord

    from simulations.loopback import LoopbackGrid

    client_app, task = _quickstart_client_app()
    grid = LoopbackGrid(client_app, {"results-file": ""}, 2)
    result = ns["strategy"].start(grid=grid, initial_arrays=ArrayRecord(task.Net().state_dict()), num_rounds=2)
    metrics = result.train_metrics_clientapp
    assert sorted(metrics) == [1, 2], metrics
    assert all(m["replies"] == 2 and m["num-steps"] == 16 for m in metrics.values()), metrics


def check_task_factory(ns: dict[str, Any]) -> None:
    """The task the block's factory returns is a task: every member, a model, the data split."""
    import torch

    from tasks.config import RunConfig
    from tasks.protocol import check_task

    task = check_task(ns["make_task"](RunConfig()), "make_task")
    assert task.train_size == 455 and len(task.labels) == 455
    model = task.build_model()
    assert model(torch.zeros(3, 30)).shape == (3, 2)


def check_quickstart_app(ns: dict[str, Any]) -> None:
    """The example's server.py with its client.py: ten rounds in process, from chance to a trained model."""
    import tempfile

    from simulations.loopback import LoopbackGrid, run_server_app

    client_app, _ = _quickstart_client_app()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "results.json"
        config = {"num-server-rounds": 3, "local-steps": 8, "batch-size": 32, "lr": 1.0, "clip": 0.3,
                  "results-file": str(out)}
        run_server_app(ns["app"], LoopbackGrid(client_app, config, 2))
        results = json.loads(out.read_text())
    assert sorted(map(int, results["train"])) == [1, 2, 3]
    assert results["test"]["3"]["test-accuracy"] > results["test"]["0"]["test-accuracy"] + 0.3


def check_dp_wrapper_app(ns: dict[str, Any]) -> None:
    """The block's ServerApp (this project's rounds inside Flower's DP wrapper) runs two rounds in process."""
    import tempfile

    from client.app import app as client_app
    from simulations.loopback import LoopbackGrid, run_server_app
    from tasks.config import RunConfig
    from tasks.runs.results import read_results

    with tempfile.TemporaryDirectory() as tmp:
        values = {**RunConfig().to_mapping(), "num-clients": 3, "num-rounds": 2, "local-steps": 2, "batch-size": 16,
                  "device": "cpu", "node-wait": 2.0, "results-dir": tmp, "run-name": "wrapped"}
        run_server_app(ns["app"], LoopbackGrid(client_app, values, 3))
        _, rows = read_results(Path(tmp) / "wrapped" / "results.jsonl")
    assert [r["round"] for r in rows] == [0, 1, 2] and rows[-1]["replies"] == 3


CHECKS = {
    "strategy_starts": check_strategy_starts,
    "task_factory": check_task_factory,
    "quickstart_app": check_quickstart_app,
    "dp_wrapper_app": check_dp_wrapper_app,
}
