"""``python -m simulations.flower``: run a Flower App on a throw-away local SuperLink, or
stop the local SuperLink that ``flwr run .`` started for this FLWR_HOME.

    python -m simulations.flower APP_DIR [--run-config "k=v ..."] [--federation-config ...]
    python -m simulations.flower stop-local [--flwr-home DIR]

Exit status (run): 0 finished:completed, 1 another final status, 2 CLI or start error (a bad
argument, an unknown run-config key: before anything starts; for this project's app a bad
run-config value too: checked while the SuperLink starts, before the run is submitted), 130/143
stopped by Ctrl-C/SIGTERM (the local SuperLink stopped with the run; one line names the command
that resumes it).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..interrupt import Stopped, command_line, report, stoppable
from .cli import FlowerCliError, RunFailed, app_config, run_app, run_app_with_restarts, run_config_values
from .local import local_log_file, stop_local_superlink
from .processes import strip_ansi
from .superlink import ExistingSuperLink, LocalSuperLink, SuperLinkLike, SuperLinkStartError

PROG = "python -m simulations.flower"
PROJECT = Path(__file__).resolve().parents[2]  # this checkout: the app whose values ValueCheck knows


class ValueCheck(threading.Thread):
    """This project's app (``app`` is this checkout): its ``RunConfig`` checks the run-config values,
    in a thread while the SuperLink starts (``tasks.config`` imports torch: about 3 s); ``result()``
    raises a bad value's error. Any other app's values are its own ServerApp's to check."""

    def __init__(self, app: Path, overrides: Mapping[str, Any]) -> None:
        super().__init__(name="run-config values", daemon=True)
        self.app, self.overrides = app, dict(overrides)
        self.error: str | None = None

    def run(self) -> None:
        if self.app.expanduser().resolve() != PROJECT:
            return
        try:
            from tasks.config import RunConfig

            app = app_config(self.app)  # a table of a method of yours listed there is the app's
            RunConfig.from_mapping({**app, **self.overrides}, declared=app)
        except ValueError as exc:
            self.error = str(exc)
        except Exception:  # not a verdict on the values (an import failing, ...): the run reports it
            pass

    def result(self) -> None:
        self.join()
        if self.error is not None:
            raise ValueError(f"run-config: {self.error}")


def _run_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description="Run a Flower App on a throw-away local SuperLink and report its status. "
                               f"(`{PROG} stop-local --help`: stop the SuperLink `flwr run .` left running.)")
    parser.add_argument("app_dir")
    parser.add_argument("--run-config", "-c", action="append", default=[],
                        help="TOML 'k=v' overrides (repeatable), e.g. \"lr=0.1 task='digits'\"")
    parser.add_argument("--federation-config", action="append", default=[],
                        help="e.g. 'num-supernodes=8 client-resources-num-cpus=1'")
    parser.add_argument("--timeout", type=float, default=3600.0)
    parser.add_argument("--address", help="use this running SuperLink (host:port) instead")
    parser.add_argument("--deployment", action="store_true", help="start the local SuperLink without --simulation")
    parser.add_argument("--keep-home", action="store_true", help="keep FLWR_HOME (logs)")
    parser.add_argument("--quiet", action="store_true", help="do not print the run log")
    parser.add_argument("--restarts", type=int, default=0,
                        help="submit a run that failed again with resume=true, up to N times, on the same SuperLink "
                             "(needs a fixed run-name; the policy of server/deploy/submit.sh --restarts)")
    parser.add_argument("--restart-delay", type=float, default=10.0, help="seconds before a restart (default 10)")
    return parser


def run_main(argv: Sequence[str]) -> int:
    parser = _run_parser()
    ns = parser.parse_args(argv)
    if ns.restarts < 0 or ns.restart_delay < 0:
        parser.error(f"--restarts and --restart-delay must be >= 0, got {ns.restarts} and {ns.restart_delay}")
    try:  # the keys before anything starts, the values (this project's app) while the SuperLink starts
        overrides = run_config_values(Path(ns.app_dir).expanduser().resolve(), ns.run_config or None)
        if ns.restarts and not str(overrides.get("run-name") or ""):
            raise ValueError("--restarts needs a fixed run-name (--run-config \"run-name='NAME'\"): a restart resumes "
                             "that folder")
        values = ValueCheck(Path(ns.app_dir), overrides)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    values.start()

    def go(sl: SuperLinkLike) -> dict[str, Any]:
        values.result()
        if ns.restarts:
            return run_app_with_restarts(ns.app_dir, ns.run_config or None, ns.federation_config or None, ns.timeout,
                                         superlink=sl, restarts=ns.restarts, restart_delay=ns.restart_delay,
                                         say=lambda line: print(f"{PROG}: {line}", file=sys.stderr))
        return run_app(ns.app_dir, ns.run_config or None, ns.federation_config or None, ns.timeout, superlink=sl)

    try:
        with stoppable():
            if ns.address:
                with ExistingSuperLink(ns.address) as sl:
                    run = go(sl)
            else:
                with LocalSuperLink(simulation=not ns.deployment, keep_home=ns.keep_home) as sl:
                    if ns.keep_home:
                        print(f"FLWR_HOME={sl.home}", file=sys.stderr)
                    run = go(sl)
    except (KeyboardInterrupt, Stopped) as exc:
        if ns.address:
            return report(PROG, exc, f"stopped waiting; a run already submitted goes on on {ns.address} "
                                     "(flwr stop RUN_ID stops it)")
        again = command_line("simulations.flower", list(argv), "--run-config", "resume=true")
        return report(PROG, exc, "stopped the run with its local SuperLink; a run of this project's app keeps its rows and last "
                                 "checkpoint in its run folder (the ServerApp logged it): resume it with the same "
                                 f"run-name: {again}")
    except RunFailed as exc:
        print(exc, file=sys.stderr)
        if exc.cause:  # again after the log's tail: the line a reader sees last
            print(f"error: {exc.cause}", file=sys.stderr)
        print(json.dumps({"run-id": str(exc.run_id), "status": exc.status}))
        return 1
    except (FlowerCliError, SuperLinkStartError, ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not ns.quiet:
        print(strip_ansi(run.get("logs", "")), file=sys.stderr)
    print(json.dumps({k: v for k, v in run.items() if k != "logs"}))
    return 0


def stop_local_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog=f"{PROG} stop-local",
        description="Stop the SuperLink that `flwr run .` started for one FLWR_HOME (found by its "
                    "--log-file FLWR_HOME/local-superlink/superlink.log), with its children; SuperLinks of "
                    "other FLWR_HOMEs and other users are left alone.")
    parser.add_argument("--flwr-home", help="default: $FLWR_HOME, else ~/.flwr (as flwr decides)")
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds between SIGTERM and SIGKILL")
    ns = parser.parse_args(argv)
    log_file = local_log_file(ns.flwr_home)
    try:
        stopped = stop_local_superlink(ns.flwr_home, ns.timeout)
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if not stopped:
        print(f"no local SuperLink of this user logs to {log_file}")
    for pid in sorted(stopped):
        print(f"stopped local SuperLink pid {pid} (log {log_file})")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["stop-local"]:  # an app folder of that name: pass ./stop-local
        return stop_local_main(args[1:])
    return run_main(args)


if __name__ == "__main__":
    sys.exit(main())
