"""Flower tooling: drive the real Flower CLI (flwr 1.42) from Python.

``processes``  process trees: tag, find, the one SIGTERM -> SIGKILL ``stop``, ``free_port``
``superlink``  ``LocalSuperLink`` (private, free port, isolated FLWR_HOME), ``ExistingSuperLink``
``cli``        ``flwr`` wrappers: submit_run, run_status, wait_for_run, fetch_logs, stop_run, run_app
``local``      find / stop the SuperLink that ``flwr run .`` started for one FLWR_HOME
``deploy``     a secure deployment on this machine from server/deploy/*.sh (``netns``: as hosts)
``__main__``   ``python -m simulations.flower APP_DIR ...`` and ``... stop-local``

Stdlib only at import time (no torch, no flwr): Flower is reached through its console scripts.
"""

from .cli import (
    STATUS_COMPLETED,
    STATUS_FAILED,
    STATUS_STOPPED,
    FlowerCliError,
    RunFailed,
    RunTimeout,
    fetch_logs,
    flwr_json,
    format_overrides,
    is_finished,
    parse_cli_json,
    run_app,
    run_status,
    stop_run,
    submit_run,
    wait_for_run,
)
from .processes import free_port
from .superlink import ExistingSuperLink, LocalSuperLink, SuperLinkStartError

__all__ = ["STATUS_COMPLETED", "STATUS_FAILED", "STATUS_STOPPED", "ExistingSuperLink", "FlowerCliError",
           "LocalSuperLink", "RunFailed", "RunTimeout", "SuperLinkStartError", "fetch_logs", "flwr_json",
           "format_overrides", "free_port", "is_finished", "parse_cli_json", "run_app", "run_status", "stop_run",
           "submit_run", "wait_for_run"]
