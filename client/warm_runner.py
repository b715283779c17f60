"""A warm ClientApp runner for deployment: Flower's SuperExec role, from warm processes.

A SuperNode started with ``--isolation process`` (Flower's documented mode) serves its
Runtime API and leaves running each message's ClientApp to an external executor. Flower's
own, ``flower-superexec``, starts a new ``flwr-clientapp`` process per message: it installs
the FAB, imports flwr, torch and the app, builds the task's data and pays PyTorch's
first-step warm-up, every round (about 7 s of a message on a 2-core machine). This runner
does the same job, with Flower's own calls, from warm processes:

* the runner (this process) imports flwr and torch once and polls the Runtime API for work
  (``AcquireTask``, as ``flower-superexec`` does); it hands each message's token to the worker
  of the message's (run id, FAB hash);
* a worker is forked from the runner the first time a (run id, FAB hash) appears (the runner
  does no torch work, so the fork is clean). It installs and verifies the FAB as Flower does
  (``install_from_fab``: the FAB's SHA-256 against the hash the SuperNode announced, and
  every file against the FAB's manifest), loads the ClientApp once, and runs each message of
  the run with Flower's task-input, reply and task-output calls. What the app keeps at module
  level -- the task, its data and partitions, the model skeleton, the executor -- and
  PyTorch's warm state live on from message to message.

What is isolated, and what is not:

* **Runs are isolated by process.** A worker serves one (run id, FAB hash) and nothing
  else; a new run, or a new FAB, gets a fresh fork of the runner, which never imported an
  app (the runner imports nothing of the project; started as ``python -m client.warm_runner``
  it forgets its own package in the fork, so the FAB's ``client`` loads). At most ``--max-workers`` live at once (the
  least recently used is stopped first) and a worker idle for ``--idle-exit`` s exits, so
  memory stays bounded by the live runs, not by the rounds.
* **Messages of one run share a process.** An exception in the ClientApp fails that
  message only: Flower's Error reply goes to the server, as ``flwr-clientapp`` sends it, and
  the worker serves the next message. A worker that dies (a crash, ``os._exit``, a signal)
  fails its current message (the runner answers it with Flower's Error reply, naming the
  exit code, so the server records the node as failed at once), and the run's next message
  gets a new worker. A message can see what earlier messages of its own
  run left in the process -- the run's own code, one trust domain, as in Flower's
  simulation, where one Ray actor runs many messages -- never another run's.
* **Stopping.** SIGTERM or SIGINT stops the runner and every worker (SIGTERM, SIGKILL after
  5 s). The runner exits when the SuperNode (``--parent-pid``) is gone, a worker when the
  runner is.
* **Only this runner acquires the node's tasks.** With ``--superexec-auth-secret-file`` (the
  SuperNode's SuperExec secret: ``start_supernode.sh`` makes a fresh one per node, readable by its
  user only, and gives it to both) every ``AcquireTask`` is signed with it, and the SuperNode
  refuses the call from any other process of the host; a message's own calls carry its token.

This file is the runner (polling, dispatch, workers' lives, the CLI); what runs in a worker is
``client/warm_worker.py``, loaded from its file (``load_worker``), never as part of the
project's package. ``server/deploy/start_supernode.sh`` starts a SuperNode with this runner by
default (``--isolation subprocess``: Flower's stock path)::

    flower-supernode --isolation process --port 9094 --superexec-auth-secret-file S ... &
    python client/warm_runner.py --runtime-api-address 127.0.0.1:9094 --insecure --parent-pid $! \\
        --superexec-auth-secret-file S
"""

from __future__ import annotations

import argparse
import importlib.util
import multiprocessing
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from logging import DEBUG, ERROR, INFO, WARNING
from multiprocessing.connection import Connection
from pathlib import Path
from types import ModuleType

if __name__ == "__main__" and sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]  # run as a file: its folder (client/) is no package root of the app's

from flwr.app import Metadata
from flwr.proto.runtime_pb2 import AcquireTaskRequest  # pylint: disable=E0611
from flwr.supercore import log
from flwr.supercore.auth.superexec_secret import load_superexec_auth_secret
from flwr.supercore.constant import TaskType
from flwr.supercore.tls import validate_and_resolve_root_certificates

_FORK = multiprocessing.get_context("fork")
#: the package this runner was imported from (``python -m client.warm_runner``: ``client``), forgotten in a
#: worker before the FAB's app loads; None when it runs as a file
_OWN_PACKAGE = __spec__.parent if __spec__ is not None and __spec__.parent else None
#: the private name of the worker module in ``sys.modules`` (no package of the project, nor of an app)
WORKER_MODULE = "_celgc_warm_worker"


def load_worker() -> ModuleType:
    """``client/warm_worker.py`` (next to this file), loaded from its path under ``WORKER_MODULE``: the
    runner imports nothing of the project, whether run as a file or as ``python -m client.warm_runner``.
    Its imports (flwr, torch) happen here, once, so that every fork starts warm."""
    loaded = sys.modules.get(WORKER_MODULE)
    if loaded is not None:
        return loaded
    spec = importlib.util.spec_from_file_location(WORKER_MODULE, Path(__file__).resolve().with_name("warm_worker.py"))
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {Path(__file__).with_name('warm_worker.py')}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[WORKER_MODULE] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[WORKER_MODULE]
        raise
    return module


W = load_worker()


@dataclass
class _Worker:
    key: tuple[int, str]
    process: multiprocessing.process.BaseProcess
    conn: Connection
    busy: str | None = None  # the token of the message it runs
    message: Metadata | None = None  # that message's metadata, once the worker pulled it
    last: float = field(default_factory=time.monotonic)


class WarmRunner:
    """Acquire ClientApp tasks from a SuperNode's Runtime API and run them on warm workers."""

    def __init__(self, endpoint: W.Endpoint, *, poll_interval: float = 0.05, max_workers: int = 2,
                 idle_exit: float = 900.0, threads: int | None = None, parent_pid: int | None = None) -> None:
        self.endpoint, self.poll, self.max_workers = endpoint, poll_interval, max_workers
        self.idle_exit, self.threads, self.parent_pid = idle_exit, threads, parent_pid
        self.workers: dict[tuple[int, str], _Worker] = {}
        self.stopping = False

    def stop(self, *_: object) -> None:
        self.stopping = True

    def serve(self) -> None:
        client = self.endpoint.client(max_tries=1)  # this loop retries: a signal or a gone SuperNode is seen at once
        log(INFO, "Warm ClientApp runner: Runtime API %s, up to %d worker(s)", self.endpoint.address, self.max_workers)
        failing = False
        try:
            while not self.stopping:
                if self.parent_pid is not None and not _alive(self.parent_pid):
                    log(INFO, "Warm ClientApp runner: the SuperNode (pid %d) is gone", self.parent_pid)
                    break
                self._reap()
                try:
                    res = client.AcquireTask(AcquireTaskRequest(supported_task_types=[TaskType.CLIENT_APP]))
                except Exception as ex:  # noqa: BLE001 - the SuperNode may be starting or restarting; keep polling
                    if not failing:
                        log(WARNING, "Warm ClientApp runner: AcquireTask failed (%s); retrying every second", ex)
                    failing = True
                    time.sleep(1.0)
                    continue
                failing = False
                if res.HasField("task") and res.token:
                    W.mark("acquired", run=res.task.run_id)
                    self._dispatch(res.task, res.token)
                    continue
                time.sleep(self.poll)
        finally:
            client.close()
            self.close()

    def _dispatch(self, task, token: str) -> None:
        if task.type and task.type != TaskType.CLIENT_APP:
            log(WARNING, "Warm ClientApp runner: task %d is a %s task, not a ClientApp: left to expire", task.task_id,
                task.type)
            return
        key = (task.run_id, task.fab_hash)
        worker = self.workers.get(key)
        if worker is None or not worker.process.is_alive():
            worker = self._spawn(key)
        worker.busy, worker.last = token, time.monotonic()
        worker.conn.send(token)

    def _spawn(self, key: tuple[int, str]) -> _Worker:
        self._reap()
        while len(self.workers) >= self.max_workers:
            idle = [w for w in self.workers.values() if w.busy is None] or list(self.workers.values())
            self._retire(min(idle, key=lambda w: w.last))
        parent, child = _FORK.Pipe()
        proc = _FORK.Process(target=W.worker_main,
                             args=(child, self.endpoint, key[1], self.threads, _OWN_PACKAGE),
                             name=f"celgc-clientapp-run-{key[0]}", daemon=True)
        proc.start()
        child.close()
        log(INFO, "Warm ClientApp runner: worker %d for run %d (FAB %s)", proc.pid, key[0], key[1][:12])
        worker = self.workers[key] = _Worker(key, proc, parent)
        return worker

    def _reap(self) -> None:
        now = time.monotonic()
        for worker in list(self.workers.values()):
            try:
                while worker.conn.poll(0):
                    kind, value = worker.conn.recv()
                    if kind == "message":  # what the worker runs: answered for it if it dies
                        worker.message = value
                        continue
                    log(DEBUG, "Warm ClientApp runner: run %d message %s", worker.key[0], value)
                    worker.busy, worker.message, worker.last = None, None, now
            except (EOFError, OSError):
                pass
            if not worker.process.is_alive():
                if worker.busy is not None:
                    self._fail(worker.busy, worker.message,
                               f"the ClientApp's process died (exit code {worker.process.exitcode})")
                del self.workers[worker.key]
            elif worker.busy is None and now - worker.last > self.idle_exit:
                self._retire(worker)

    def _fail(self, token: str, message: Metadata | None, details: str) -> None:
        """Answer the message of a dead worker with Flower's Error reply, as ``flwr-clientapp``
        answers a ClientApp that raised: without a reply the SuperNode would wait for one
        forever (its push loop) and serve no further message. Done in a short-lived fork, so
        that the runner itself never starts the threads Flower's object pulls use."""
        log(ERROR, "Warm ClientApp runner: %s; the message fails", details)
        proc = _FORK.Process(target=W.answer_failed, args=(self.endpoint, token, message, details), daemon=True)
        proc.start()
        proc.join(60)
        if proc.is_alive():
            proc.kill()
            proc.join(5)

    def _retire(self, worker: _Worker, timeout: float = 5.0) -> None:
        self.workers.pop(worker.key, None)
        try:
            worker.conn.send(None)
        except (BrokenPipeError, OSError):
            pass
        worker.process.join(timeout)
        if worker.process.is_alive():
            worker.process.terminate()
            worker.process.join(timeout)
        if worker.process.is_alive():
            worker.process.kill()
            worker.process.join(timeout)
        worker.conn.close()

    def close(self) -> None:
        for worker in list(self.workers.values()):
            if worker.busy is not None:  # a message in flight: do not wait for it
                worker.process.terminate()
            self._retire(worker)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="client/warm_runner.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--runtime-api-address", required=True, help="the SuperNode's Runtime API, HOST:PORT")
    p.add_argument("--insecure", action="store_true", help="plain HTTP to the Runtime API (as flower-superexec "
                   "--insecure; the SuperNode's Runtime API is on loopback by default)")
    p.add_argument("--root-certificates", help="CA certificate of a Runtime API served with TLS")
    p.add_argument("--superexec-auth-secret-file", help="the SuperNode's SuperExec auth secret, if it has one")
    p.add_argument("--parent-pid", type=int, help="exit when this process (the SuperNode) is gone")
    p.add_argument("--poll-interval", type=float, default=0.05, help="seconds between AcquireTask polls (0.01-5)")
    p.add_argument("--max-workers", type=int, default=2, help="live runs kept warm at once (>= 1)")
    p.add_argument("--idle-exit", type=float, default=900.0, help="a worker idle this many seconds exits (> 0)")
    p.add_argument("--threads", type=int, default=0, help="torch threads of a worker (0: torch's default)")
    args = p.parse_args(argv)
    if not 0.01 <= args.poll_interval <= 5:
        p.error(f"--poll-interval must be in [0.01, 5] seconds, got {args.poll_interval}")
    if args.max_workers < 1:
        p.error(f"--max-workers must be an integer >= 1, got {args.max_workers}")
    if not args.idle_exit > 0:
        p.error(f"--idle-exit must be > 0 seconds, got {args.idle_exit}")
    if args.threads < 0:
        p.error(f"--threads must be an integer >= 0, got {args.threads}")
    if args.insecure and args.root_certificates:
        p.error("--insecure and --root-certificates exclude each other")
    try:
        secret = load_superexec_auth_secret(args.superexec_auth_secret_file)
    except ValueError as exc:
        p.error(str(exc))
    endpoint = W.Endpoint(args.runtime_api_address, args.insecure,
                        validate_and_resolve_root_certificates(args.root_certificates, args.insecure), secret)
    runner = WarmRunner(endpoint, poll_interval=args.poll_interval, max_workers=args.max_workers,
                        idle_exit=args.idle_exit, threads=args.threads or None, parent_pid=args.parent_pid)
    signal.signal(signal.SIGTERM, runner.stop)
    signal.signal(signal.SIGINT, runner.stop)
    runner.serve()
    log(INFO, "Warm ClientApp runner stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
