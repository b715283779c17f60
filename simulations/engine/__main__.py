"""``python -m simulations.engine`` (also under ``torchrun ... -m simulations.engine``).

A run that cannot start (a bad key or value, a task path that does not import, a run folder that holds another run, a
checkpoint of another config, a missing file) ends with one line, ``error: ...``, and exit
status 2; Ctrl-C (SIGINT) or SIGTERM stops the run with one line saying where it stopped and
the command that resumes it, exit status 130 or 143 (``simulations.interrupt``); other
failures keep their traceback."""

import json
import logging
import os
import shlex
import sys
from pathlib import Path

from tasks.runs.checkpoint import CheckpointError
from tasks.runs.run_folder import RunFolderError, stopped_at

from ..interrupt import Stopped, command_line, interruption, report, stoppable
from .run import parse, run_engine

PROG = "python -m simulations.engine"


def _main(args: list[str]) -> int:
    cfg = None
    with stoppable():
        try:
            cfg, options, quiet = parse(args)
            logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
            run_engine(cfg, options, show_progress=not quiet)
        except (ValueError, ImportError, FileNotFoundError, RunFolderError, CheckpointError) as exc:
            print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
            return 2
        except (KeyboardInterrupt, Stopped) as exc:
            name, code = interruption(exc)  # type: ignore[misc]
            if os.environ.get("RANK", "0") != "0":  # torchrun: process 0 speaks for the run
                return code
            if cfg is None:
                return report(PROG, exc, "stopped before the run started")
            keys = f"run-name={json.dumps(cfg.run_name)} resume=true"
            resume = command_line("simulations.engine", args, "--run-config", keys)
            if "WORLD_SIZE" in os.environ:
                resume = f"the same torchrun command with --run-config {shlex.quote(keys)}"
            return report(PROG, exc, stopped_at(Path(cfg.results_dir).resolve() / cfg.run_name, resume))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
