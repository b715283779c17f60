"""Run a list of experiment files and collect their results into one table.

    python -m simulations.runner simulations/experiments/cifar10/*.toml [--backend flower]
    python -m simulations.runner simulations/experiments/digits/*.toml --backend inprocess
    python -m simulations.runner --summarize results/

An experiment file is a TOML file of run-config keys (the same keys as
``[tool.flwr.app.config]``; a method's own as ``fedavgm.server-lr = 0.5`` or its table
``[fedavgm]``), so it also works as ``flwr run . --run-config FILE.toml``
(flwr 1.42 reads a single ``.toml`` argument as the overrides). For each file the runner:

1. reads and validates it (``RunConfig``; ``--set key=value`` overrides win), makes
   ``data-dir`` absolute (relative paths are relative to where you run the runner) and sets
   ``results-dir`` (``--results-dir``, absolute) and ``run-name`` (the file's, else
   ``<folder>-<file stem>``), so the run's folder is known in advance;
2. runs it on a backend:

   ``flower`` (default)
       The real Flower CLI: a private local SuperLink, ``flwr run`` with the file's keys
       and ``num-supernodes = num-clients`` (plus ``--federation-config``, e.g.
       ``"client-resources-num-gpus=0.125"``), the run's status checked
       (``simulations.flower.run_app``); the run's log is kept as ``flower.log``.
   ``inprocess``
       The same ServerApp and ClientApp objects on an in-process grid
       (``simulations.loopback``): clients one after another, no SuperLink or Ray; one node a
       client, or ``--federation-config "num-supernodes=K"`` nodes serving several each.
   ``engine``
       The fast engine, ``python -m simulations.engine --run-config ...``.

3. reads the run's ``results.jsonl`` and adds a line to the summary (method, rounds,
   global epochs, final/best test accuracy or validation perplexity, bytes, wall-clock).

A failed run is reported and the next one runs (``--fail-fast`` stops); the table is
printed and written to ``<results-dir>/summary.json``; the exit status is 1 if a run failed.

Results depend on (seed, config, code) alone: every run gets ``--threads`` torch threads
(default 1) whatever ``--jobs`` is, in this process, in a pool worker, in the engine's or
Flower's processes (``OMP_NUM_THREADS``); the results header records the count and the code
(``tasks.runs.results.source``). A sweep point whose folder holds a run made by other code
(another commit, a modified tree, another thread count, or code that recorded none) is not
reused: it is refused with the command that reruns it (``--stale rerun``: the old folder is
kept aside as ``<name>.stale-<time>`` and the point runs again).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import math
import multiprocessing
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomllib

from tasks.config import RunConfig
from tasks.overrides import flatten, parse_overrides
from tasks.runs.results import other_producer, read_results
from tasks.runs.run_folder import stopped_at

from .interrupt import Stopped, command_line, report, stoppable
from .network import NETWORK_HELP, parse_links
from .summary import find_runs, load_run, print_table, summarize
from .sweep import Point, Sweep, diverged, finished, parse_sweep, select_point, tuning_scores, write_manifest

APP_DIR = Path(__file__).resolve().parents[1]  # the Flower app: the folder of pyproject.toml
BACKENDS = ("flower", "inprocess", "engine")
STALE = ("refuse", "rerun")  # what a sweep does with a point's run made by other code
DEFAULT_THREADS = 1  # torch threads of a run, whatever --jobs is: results must not depend on it


class StaleRun(RuntimeError):
    """A sweep point's folder holds a run made by other code; it is not reused silently."""


@contextmanager
def pinned_threads(threads: int) -> Iterator[None]:
    """This process's torch threads, and ``OMP_NUM_THREADS`` of the processes it starts, set to ``threads``
    for the block (both restored after)."""
    import torch

    before, env = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    torch.set_num_threads(threads)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)
        if env is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = env


def read_experiment(path: str | Path) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(run-config keys, flat: ``<name>.<key>`` for a method's own; the ``[sweep]`` table or None) of an experiment file."""
    path = Path(path)
    data = tomllib.loads(path.read_text())
    sweep = data.pop("sweep", None)
    if sweep is not None and not isinstance(sweep, dict):
        raise ValueError(f"{path}: 'sweep' must be a [sweep] table (simulations/sweep.py), got {sweep!r}")
    nested = [f"{k}.{inner}" for k, v in data.items() if isinstance(v, dict)
              for inner, w in v.items() if isinstance(w, dict)]
    if nested:
        raise ValueError(f"{path}: an experiment file is flat run-config keys, a method's own keys (its table "
                         f"[fedavgm], or fedavgm.server-lr = ...) and an optional [sweep] table, found the nested "
                         f"table(s) {nested}")
    return flatten(data), sweep  # a method's table as <name>.<key>


def load_experiment(path: str | Path, overrides: dict[str, Any] | None = None,
                    results_dir: str | Path | None = None) -> dict[str, Any]:
    """The run-config keys of an experiment file, validated, with absolute paths (a sweep file's
    shared keys: its points are ``load_plan``'s)."""
    path = Path(path)
    data, _ = read_experiment(path)
    values = {**data, **(overrides or {})}
    try:
        cfg = RunConfig.from_mapping(values)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
    values["data-dir"] = str(Path(cfg.data_dir).expanduser().resolve())
    values["results-dir"] = str(Path(results_dir or cfg.results_dir).expanduser().resolve())
    values["run-name"] = cfg.run_name or f"{path.parent.name}-{path.stem}"
    return values


def load_plan(path: str | Path, overrides: dict[str, Any] | None = None,
              results_dir: str | Path | None = None) -> dict[str, Any] | Sweep:
    """One run's keys, or the ``Sweep`` of a file with a ``[sweep]`` table (every point checked)."""
    values = load_experiment(path, overrides, results_dir)
    _, table = read_experiment(path)
    return values if table is None else parse_sweep(Path(path), values, table)


def run_experiment(values: dict[str, Any], backend: str = "flower", federation: dict[str, Any] | None = None,
                   timeout: float = math.inf) -> Path:
    """Run one experiment on ``backend``; returns its results folder (raises on failure). The processes it
    starts inherit ``OMP_NUM_THREADS`` (``pinned_threads``)."""
    folder = Path(values["results-dir"]) / values["run-name"]
    if backend == "inprocess":
        from .loopback import run_in_process

        run_in_process(values, (federation or {}).get("num-supernodes"))  # default: one node a client
    elif backend == "flower":
        from .flower import run_app

        fed = {"num-supernodes": RunConfig.from_mapping(values).with_clients(None).num_clients, **(federation or {})}
        run = run_app(APP_DIR, run_config=values, federation_config=fed, timeout=timeout)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "flower.log").write_text(run.get("logs", ""))
    elif backend == "engine":
        if importlib.util.find_spec("simulations.engine.__main__") is None:
            raise RuntimeError("the engine backend (python -m simulations.engine) is not available in this checkout")
        from .flower import format_overrides

        cmd = [sys.executable, "-m", "simulations.engine", "--run-config", " ".join(format_overrides(values))]
        subprocess.run(cmd, cwd=APP_DIR, check=True, timeout=None if math.isinf(timeout) else timeout)
    else:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if not (folder / "results.jsonl").is_file():
        raise RuntimeError(f"the run finished but wrote no results in {folder}")
    return folder


@dataclass
class Job:
    """One run to do: its keys, and the sweep point it is (None: a plain experiment file)."""

    file: Path
    values: dict[str, Any]
    sweep: Sweep | None = None
    point: Point | None = None


def auto_jobs(backend: str) -> int:
    """Parallel runs sized to the machine: one per GPU where runs use CUDA, else one per CPU core;
    the Flower backend runs one at a time (each run starts a SuperLink of its own)."""
    if backend == "flower":
        return 1
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else (os.cpu_count() or 1)


def _worker_init(threads: int, gpus: int, counter: Any) -> None:
    """A pool worker: ``threads`` torch threads (its own and its children's), and its own GPU when there are several."""
    with counter.get_lock():
        index = counter.value
        counter.value += 1
    if gpus > 1:
        os.environ["CUDA_VISIBLE_DEVICES"] = str(index % gpus)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the parent stops the pool
    import torch

    torch.set_num_threads(threads)
    logging.getLogger("simulations.engine").setLevel(logging.WARNING)


def _run_job(values: dict[str, Any], backend: str, federation: dict[str, Any] | None, timeout: float) -> float:
    """One run in a pool worker (the engine in this process: no start-up per run); its seconds."""
    t0 = time.monotonic()
    if backend == "engine":
        from .engine.run import run_engine

        run_engine(RunConfig.from_mapping(values), show_progress=False)
    else:
        run_experiment(values, backend, federation, timeout)
    return time.monotonic() - t0


def run_all(files: Sequence[str | Path], backend: str = "flower", overrides: dict[str, Any] | None = None,
            results_dir: str | Path | None = None, federation: dict[str, Any] | None = None,
            timeout: float = math.inf, fail_fast: bool = False, jobs: int = 1,
            progress: bool = False, threads: int = DEFAULT_THREADS, stale: str = "refuse") -> list[dict[str, Any]]:
    """Run every file (a sweep file: its points); the summary lines (``status``, ``elapsed``, ``error``).

    Plain files and every sweep's tuning points run first, ``jobs`` at a time, each with ``threads``
    torch threads; then each sweep's selected point runs on its remaining seeds. A sweep point whose
    folder holds its finished run made by this code with as many threads is skipped (``status =
    "skipped"``); an unfinished one resumes from its checkpoint; one made by other code fails
    (``StaleRun``) unless ``stale = "rerun"``, which keeps it aside and runs the point again."""
    plans = [(Path(f), load_plan(f, overrides, results_dir)) for f in files]  # all valid first
    return run_plans(plans, backend, federation, timeout, fail_fast, jobs, progress, threads, stale)


def run_plans(plans: Sequence[tuple[Path, dict[str, Any] | Sweep]], backend: str, federation: dict[str, Any] | None,
              timeout: float, fail_fast: bool, jobs: int, progress: bool, threads: int = DEFAULT_THREADS,
              stale: str = "refuse", command: str | None = None) -> list[dict[str, Any]]:
    """``run_all`` on files already read (``load_plan``); ``command``: the command line that reruns stale
    points (named in their refusal)."""
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads must be an integer >= 1, got {threads!r}")
    if stale not in STALE:
        raise ValueError(f"stale must be one of {', '.join(STALE)}, got {stale!r}")
    how = Policy(threads, stale, command or "the same call with stale='rerun'")
    sweeps = [plan for _, plan in plans if isinstance(plan, Sweep)]
    first = [Job(path, plan) for path, plan in plans if not isinstance(plan, Sweep)]
    first += [Job(sw.file, sw.values_for(p), sw, p) for sw in sweeps for p in sw.points]
    total = len(first) + sum(sw.second_stage_runs for sw in sweeps)
    jobs = max(1, jobs or auto_jobs(backend))
    elapsed: dict[str, float] = {}
    with SweepProgress(total, enabled=progress) as bar:
        lines = _execute(first, backend, federation, timeout, fail_fast, jobs, bar, elapsed, how)
        second, chosen = [], {}
        for sw in sweeps:
            ok = all(line["status"] != "failed" for line in lines if line.get("sweep") == sw.name)
            chosen[sw.name] = select_point(sw.grid, sw.select, tuning_scores(sw)) if ok else None
            write_manifest(sw, elapsed, chosen[sw.name], _outcomes(lines))
            if chosen[sw.name] is not None:
                second += [Job(sw.file, sw.values_for(p), sw, p) for p in sw.final(chosen[sw.name])]
            else:
                bar.advance(sw.second_stage_runs)
        if second and not (fail_fast and any(line["status"] == "failed" for line in lines)):
            lines += _execute(second, backend, federation, timeout, fail_fast, jobs, bar, elapsed, how)
            for sw in sweeps:
                write_manifest(sw, elapsed, chosen[sw.name], _outcomes(lines))
    return lines


def _outcomes(lines: Sequence[dict[str, Any]]) -> dict[str, str]:
    """The runs that ran to an outcome (finished or diverged), for the manifests."""
    return {line["run"]: line["status"] for line in lines if line["status"] in ("ok", "diverged")}


def _selected(sweep: Sweep) -> tuple[tuple[str, Any], ...] | None:
    from .sweep import read_manifest

    data = read_manifest(sweep.manifest)
    return None if data.get("selected") is None else tuple(data["selected"].items())


@dataclass(frozen=True)
class Policy:
    """How runs are made: torch threads a run, what to do with a stale sweep point, the command that reruns it."""

    threads: int
    stale: str
    command: str


def _stale(folder: Path, threads: int) -> str | None:
    """Why the run in ``folder`` was made by other code (or threads) than a run started now; None: it was not."""
    return other_producer(*read_results(folder / "results.jsonl"), threads)


def _execute(todo: list[Job], backend: str, federation: dict[str, Any] | None, timeout: float, fail_fast: bool,
             jobs: int, bar: SweepProgress, elapsed: dict[str, float], how: Policy) -> list[dict[str, Any]]:
    lines: list[dict[str, Any] | None] = [None] * len(todo)
    pending: list[int] = []
    recorded = {job.sweep.name: _recorded(job.sweep) for job in todo if job.sweep is not None}  # one read a sweep
    for i, job in enumerate(todo):
        name = job.values["run-name"]
        folder = Path(job.values["results-dir"]) / name
        if job.sweep is not None:
            try:
                was_diverged = recorded[job.sweep.name].get(name) == "diverged" and (folder / "results.jsonl").is_file()
                done_before = was_diverged or finished(folder, job.values)
                why = _stale(folder, how.threads) if (folder / "results.jsonl").is_file() else None
                if why is not None and how.stale != "rerun":
                    raise StaleRun(f"{folder} holds a{' finished' if done_before else 'n unfinished'} run made by "
                                   f"other code: {why}; it is not reused. Rerun it (the old folder is kept aside as "
                                   f"{name}.stale-<time>) with: {how.command}")
                if why is not None:
                    folder.rename(folder.with_name(f"{name}.stale-{time.strftime('%Y%m%d-%H%M%S')}"))
                elif done_before:  # the same outcome again: skipped
                    lines[i] = _line(job, "skipped", 0.0, folder)
                    bar.advance(1, name)
                    continue
            except Exception as exc:  # another config, or other code, in the folder: reported, never overwritten
                lines[i] = _line(job, "failed", 0.0, error=exc)
                bar.advance(1, name)
                continue
            if (folder / "results.jsonl").is_file():  # an interrupted point
                if (folder / "checkpoint.pt").is_file() and not job.values.get("average-iterates"):
                    job.values = {**job.values, "resume": True}  # on from its checkpoint
                else:  # nothing to resume from: its partial folder is kept aside, the point starts again
                    folder.rename(folder.with_name(f"{name}.interrupted-{time.strftime('%Y%m%d-%H%M%S')}"))
        pending.append(i)

    def done(i: int, seconds: float | None, exc: BaseException | None) -> bool:
        job = todo[i]
        name = job.values["run-name"]
        # a diverged sweep point is an outcome of its point (scored the worst), not a failure
        status = "ok" if exc is None else "diverged" if job.sweep is not None and diverged(exc) else "failed"
        if status != "failed":
            elapsed[name] = seconds or 0.0
        folder = Path(job.values["results-dir"]) / name if status == "ok" else None
        lines[i] = _line(job, status, seconds or 0.0, folder, error=exc)
        bar.advance(1, name)
        return status == "failed" and fail_fast

    if jobs == 1 or len(pending) <= 1:
        for i in pending:
            t0 = time.monotonic()
            try:
                with pinned_threads(how.threads):
                    if todo[i].sweep is not None and backend == "engine":
                        _run_job(todo[i].values, backend, federation, timeout)  # in this process: no start-up per run
                    else:
                        run_experiment(todo[i].values, backend, federation, timeout)
                stop = done(i, time.monotonic() - t0, None)
            except Exception as exc:  # report and go on with the next run
                stop = done(i, time.monotonic() - t0, exc)
            if stop:
                break
    else:
        gpus = auto_jobs(backend) if backend != "flower" and _cuda() else 0
        ctx = multiprocessing.get_context("spawn")  # fork after torch has run can deadlock
        counter = ctx.Value("i", 0)
        with ProcessPoolExecutor(jobs, mp_context=ctx, initializer=_worker_init,
                                 initargs=(how.threads, gpus, counter)) as pool:
            futures = {pool.submit(_run_job, todo[i].values, backend, federation, timeout): i for i in pending}
            try:
                for future in as_completed(futures):
                    exc = future.exception()
                    if done(futures[future], None if exc else future.result(), exc):
                        for f in futures:
                            f.cancel()
                        break
            except BaseException:  # Ctrl-C or SIGTERM: the runs stop where they are (rows and checkpoints kept)
                for f in futures:
                    f.cancel()
                for process in list(getattr(pool, "_processes", {}).values()):
                    process.terminate()
                raise
    return [line for line in lines if line is not None]


def _recorded(sweep: Sweep) -> dict[str, str]:
    """The outcome each run of ``sweep`` had when its manifest was last written (none before the first)."""
    from .sweep import read_manifest

    if not sweep.manifest.is_file():
        return {}
    return {name: entry.get("status") for name, entry in read_manifest(sweep.manifest)["runs"].items()}


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _line(job: Job, status: str, seconds: float, folder: Path | None = None,
          error: BaseException | None = None) -> dict[str, Any]:
    line: dict[str, Any] = {"status": status, "run": job.values["run-name"]}
    if folder is not None and status != "failed":
        line.update(summarize(load_run(folder)))
    if error is not None:
        line["error"] = f"{type(error).__name__}: {error}"[:2000]
    if job.sweep is not None:
        line["sweep"] = job.sweep.name
    return {**line, "file": str(job.file), "elapsed": seconds}


class SweepProgress:
    """One bar over every run of the command (rich, on stderr); a no-op when disabled."""

    def __init__(self, total: int, enabled: bool = True) -> None:
        self.total, self.enabled = total, enabled and total > 1
        self._progress: Any = None

    def __enter__(self) -> SweepProgress:
        if self.enabled:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

            self._progress = Progress(TextColumn("[bold]runs[/]"), MofNCompleteColumn(), BarColumn(),
                                      TimeElapsedColumn(), TimeRemainingColumn(), TextColumn("{task.fields[last]}"),
                                      console=Console(stderr=True))
            self._progress.__enter__()
            self._task = self._progress.add_task("runs", total=self.total, last="")
        return self

    def advance(self, n: int, last: str = "") -> None:
        if self._progress is not None:
            self._progress.update(self._task, advance=n, last=last)

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.__exit__(*exc)


def _stopped_where(read: Sequence[tuple[Path, dict[str, Any] | Sweep]], args: list[str], files: list[str]) -> str:
    """Where a stopped command is, and the commands that go on: the same command for sweeps (finished
    points are skipped, an interrupted one resumes), a plain file's own resume command."""
    if not read:
        return "stopped before any run started"
    others = list(args)
    for f in files:
        others.remove(f)
    parts = []
    sweeps = [plan for _, plan in read if isinstance(plan, Sweep)]
    if sweeps:
        parts.append(f"sweep(s) {', '.join(sw.name for sw in sweeps)}: finished points are kept and an interrupted "
                     f"one resumes from its checkpoint when the same command runs again: "
                     f"{command_line('simulations.runner', [str(sw.file) for sw in sweeps] + others)}")
    for path, plan in read:
        if not isinstance(plan, Sweep):
            folder = Path(plan["results-dir"]) / plan["run-name"]
            again = command_line("simulations.runner", [str(path), *others, "--set", "resume=true"])
            parts.append(f"{path}: " + ("finished" if (folder / "model.pt").is_file() else stopped_at(folder, again)))
    return " | ".join(parts)


def _without_stale(args: list[str]) -> list[str]:
    """The command line without its ``--stale`` option (the rerun command adds its own)."""
    out, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg == "--stale":
            skip = True
        elif not arg.startswith("--stale="):
            out.append(arg)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m simulations.runner", description=__doc__.split("\n\n")[0])
    parser.add_argument("experiments", nargs="*", help="experiment files (flat TOML run-config keys, optional [sweep])")
    parser.add_argument("--backend", choices=BACKENDS, default="flower")
    parser.add_argument("--results-dir", help="where run folders go (default: each file's results-dir, 'results')")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override keys of every file, e.g. --set num-rounds=3 --set device=cpu")
    parser.add_argument("--federation-config", action="append", default=[],
                        help="Flower simulation settings, e.g. 'client-resources-num-gpus=0.125'")
    parser.add_argument("--timeout", type=float, default=0.0, help="seconds per run (0: no limit)")
    parser.add_argument("--fail-fast", action="store_true", help="stop at the first failed run")
    parser.add_argument("--jobs", type=int, default=0,
                        help="runs at a time (0: with sweeps one per CPU core, or per GPU; else 1; flower: 1)")
    parser.add_argument("--threads", type=int, default=DEFAULT_THREADS,
                        help="torch threads of every run, at any --jobs (default 1: results do not depend on --jobs)")
    parser.add_argument("--stale", choices=STALE, default="refuse",
                        help="a sweep point's run made by other code (another commit, a modified tree, another "
                             "--threads): refuse it (default, naming the command that reruns it) or rerun it "
                             "(the old folder is kept aside)")
    parser.add_argument("--compare", metavar="OUT", help="then select on validation and write the comparison "
                        "(table, figures with bands: simulations.compare) of the results-dir into OUT")
    parser.add_argument("--target", type=float, help="the level of rounds/bytes-to-target in --compare")
    parser.add_argument("--network", metavar="LINKS", help="--compare's " + NETWORK_HELP)
    parser.add_argument("--summarize", nargs="+", metavar="RESULTS", help="only print the table of existing results")
    ns = parser.parse_args(argv)
    if ns.summarize:
        print_table([summarize(r) for r in find_runs(ns.summarize)], title="Results")
        return 0
    if not ns.experiments:
        parser.error("give experiment files (or --summarize RESULTS)")
    if ns.jobs < 0:
        parser.error(f"--jobs must be >= 0, got {ns.jobs}")
    if ns.threads < 1:
        parser.error(f"--threads must be >= 1, got {ns.threads}")
    if ns.network is not None and not ns.compare:
        parser.error("--network is an option of --compare: give --compare OUT too")
    args = list(sys.argv[1:] if argv is None else argv)
    rerun = shlex.join(["python", "-m", "simulations.runner", *_without_stale(args), "--stale", "rerun"])
    overrides = parse_overrides(ns.set)
    read: list[tuple[Path, dict[str, Any] | Sweep]] = []
    try:
        with stoppable():
            links = parse_links(ns.network)  # checked before any run starts
            read = [(Path(f), load_plan(f, overrides, ns.results_dir)) for f in ns.experiments]  # all valid first
            plans = [plan for _, plan in read]
            if any((p.base if isinstance(p, Sweep) else p).get("tensorboard") for p in plans):
                from tasks.runs.live_scalars import require

                require()  # the package, before any run: else every run would stop at its start
            any_sweep = any(isinstance(p, Sweep) for p in plans)
            jobs = 1 if ns.backend == "flower" else ns.jobs or (auto_jobs(ns.backend) if any_sweep else 1)
            lines = run_plans(read, ns.backend, parse_overrides(ns.federation_config), ns.timeout or math.inf,
                              ns.fail_fast, jobs, any_sweep, ns.threads, ns.stale, rerun)
    except (ValueError, FileNotFoundError, tomllib.TOMLDecodeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, Stopped) as exc:
        return report("python -m simulations.runner", exc, _stopped_where(read, args, ns.experiments))
    shown = [line for line in lines if "sweep" not in line or line["status"] in ("failed", "diverged")]
    if shown:
        print_table(shown, title=f"Experiments ({ns.backend})")
    for plan in plans:
        if isinstance(plan, Sweep):
            mine = [line for line in lines if line.get("sweep") == plan.name]
            counts = {s: sum(line["status"] == s for line in mine) for s in ("ok", "skipped", "diverged", "failed")}
            chosen = _selected(plan)
            print(f"sweep {plan.name}: {counts['ok']} run, {counts['skipped']} skipped (finished before), "
                  f"{counts['diverged']} diverged, {counts['failed']} failed; selected on {plan.select}: "
                  + (", ".join(f"{k}={v}" for k, v in chosen) if chosen else "-") + f"  ({plan.manifest})")
    out = Path(load_experiment(ns.experiments[0], overrides, ns.results_dir)["results-dir"])
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(lines, indent=1, default=str) + "\n")
    if ns.compare:
        from .compare import compare

        compare([out], ns.compare, target=ns.target, links=links)
    return 1 if any(line["status"] == "failed" for line in lines) else 0


if __name__ == "__main__":
    sys.exit(main())
