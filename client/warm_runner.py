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

``server/deploy/start_supernode.sh`` starts a SuperNode with this runner by default
(``--isolation subprocess``: Flower's stock path)::

    flower-supernode --isolation process --port 9094 ... &
    python client/warm_runner.py --runtime-api-address 127.0.0.1:9094 --insecure --parent-pid $!
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from logging import DEBUG, ERROR, INFO, WARNING
from multiprocessing.connection import Connection

if __name__ == "__main__" and sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]  # run as a file: its folder (client/) is no package root of the app's

# Imported once, here, so that every fork starts warm (nothing of torch runs in the runner).
import torch  # noqa: F401
from flwr.app import Context, Message, Metadata, RecordDict
from flwr.app.error import Error
from flwr.app.message import make_message
from flwr.cli.install import install_from_fab
from flwr.clientapp.client_app import ClientApp, LoadClientAppError
from flwr.clientapp.utils import get_load_client_app_fn
from flwr.common.constant import ErrorCode, SubStatus
from flwr.common.serde import context_from_proto, fab_from_proto, run_from_proto
from flwr.proto.node_pb2 import Node  # pylint: disable=E0611
from flwr.proto.runtime_pb2 import (  # pylint: disable=E0611
    AcquireTaskRequest,
    PullAppMessagesRequest,
    PullTaskInputRequest,
)
from flwr.supercore import log
from flwr.supercore.auth.superexec_secret import load_superexec_auth_secret
from flwr.supercore.constant import TaskType
from flwr.supercore.heartbeat import HeartbeatSender, make_task_heartbeat_fn_http
from flwr.supercore.interceptors import (
    RuntimeTokenHttpInterceptor,
    RuntimeVersionHttpInterceptor,
    SuperExecAuthHttpInterceptor,
)
from flwr.supercore.retry import make_simple_http_retry_invoker
from flwr.supercore.runtime import RuntimeHttpClient
from flwr.supercore.tls import validate_and_resolve_root_certificates
from flwr.supercore.fab import Fab
from flwr.supercore.inflatable.inflatable_protobuf_utils import (
    make_confirm_message_received_fn_protobuf,
    make_pull_object_fn_protobuf,
)
from flwr.supercore.inflatable.inflatable_utils import pull_and_inflate_object_from_tree
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity
from flwr.supernode.runtime.run_clientapp import push_message, push_task_output

_FORK = multiprocessing.get_context("fork")


def _mark(event: str, **fields: object) -> None:
    """``tasks.runs.stamps.mark``'s line, written here: the runner imports nothing of the project,
    so a worker loads the app, and what it imports, as a fresh ``flwr-clientapp`` would."""
    path = os.environ.get("CELGC_STAMPS")
    if path:
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps({"event": event, "t": time.time(), "pid": os.getpid(), **fields}) + "\n")
#: seconds before a message's object that is not stored yet is asked for again (doubling up to
#: ``PULL_BACKOFF_CAP``: the SuperNode stores a message's objects only once it pulled them all, so
#: a worker that acquired the task early waits for them; with Flower's 1 s cap up to 1 s too long);
#: ``PULL_TRIES``: about as long as Flower's own bound (500 tries at its backoff)
PULL_BACKOFF = 0.02
PULL_BACKOFF_CAP = 0.1
PULL_TRIES = 5000


@dataclass(frozen=True)
class Endpoint:
    """How to reach the SuperNode's Runtime API."""

    address: str
    insecure: bool
    certificates: bytes | None
    secret: bytes | None = None

    def client(self, *, token: str | None = None, max_tries: int | None = None) -> RuntimeHttpClient:
        """A Runtime API client: the runner's own (SuperExec auth) or one message's (its token)."""
        interceptors: list = [RuntimeVersionHttpInterceptor(component_name="flwr-clientapp" if token else "SuperExec")]
        if token is not None:
            interceptors.append(RuntimeTokenHttpInterceptor(token))
        elif self.secret:
            interceptors.append(SuperExecAuthHttpInterceptor(master_secret=self.secret,
                                                             protected_methods=frozenset({"/flwr.proto.Runtime/AcquireTask"})))
        retry = make_simple_http_retry_invoker()
        if max_tries is not None:
            retry.max_tries = max_tries
        return RuntimeHttpClient.from_server_address(server_address=self.address, insecure=self.insecure,
                                                     root_certificates=self.certificates, interceptors=interceptors,
                                                     retry_invoker=retry)


# --- the worker: one (run, FAB), many messages ------------------------------------------------------------------
class _LoadedApp:
    """The ClientApp of one FAB, installed, verified and loaded once."""

    def __init__(self, fab_hash: str) -> None:
        self.fab_hash = fab_hash
        self.app: ClientApp | None = None

    def get(self, run, fab) -> ClientApp:
        if fab.hash_str != self.fab_hash:
            raise LoadClientAppError(f"the task announced FAB {self.fab_hash[:12]}, the SuperNode sent "
                                     f"{fab.hash_str[:12]}: refused")
        if self.app is None:
            install_from_fab(fab.content, skip_prompt=True)  # Flower's verification: FAB hash and file hashes
            _forget_runner_package()
            load = get_load_client_app_fn(default_app_ref="", app_path=None, multi_app=True)
            self.app = load(run.fab_id, run.fab_version, fab.hash_str)
        return self.app


def _forget_runner_package() -> None:
    """Started as ``python -m client.warm_runner``, the runner imported its own package, ``client``,
    from wherever it was installed: forget it, so that the FAB's ``client`` loads in its place.
    Nothing else is dropped: what the interpreter imported at its start (``sitecustomize``, say)
    stays, as in a fresh ``flwr-clientapp`` process."""
    own = __spec__.parent if __spec__ is not None and __spec__.parent else None
    if own:
        for name in [m for m in sys.modules if m == own or m.startswith(own + ".")]:
            del sys.modules[name]


def pull_input(client: RuntimeHttpClient) -> tuple[Message, Context, Run, Fab]:
    """The message, context, run and FAB of a task, as Flower's ``pull_task_input`` pulls them,
    with one difference: the message's objects are retried after ``PULL_BACKOFF`` s, not Flower's
    1 s (a warm worker asks for them while the SuperNode is still storing them; measured: 0.9 s of
    every deployed message waited in Flower's first backoff)."""
    res = client.PullTaskInput(PullTaskInputRequest())
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = res.task_id, res.run.run_id, res.context.node_id
    context, run, fab = context_from_proto(res.context), run_from_proto(res.run), fab_from_proto(res.fab)
    pulled = client.PullMessages(PullAppMessagesRequest())
    if not pulled.messages_list:
        raise RuntimeError("No messages received from Runtime API")
    node = Node(node_id=context.node_id)
    tree = pulled.message_object_trees[0]
    message = pull_and_inflate_object_from_tree(
        tree, make_pull_object_fn_protobuf(client.PullObject, node, context.run_id),
        make_confirm_message_received_fn_protobuf(client.ConfirmMessageReceived, node, context.run_id),
        return_type=Message, initial_backoff=PULL_BACKOFF, backoff_cap=PULL_BACKOFF_CAP, max_tries_per_object=PULL_TRIES)
    message.metadata.__dict__["_message_id"] = tree.object_id  # as Flower: the deflated message lacks its id
    return message, context, run, fab


def run_message(endpoint: Endpoint, token: str, loaded: _LoadedApp, started=None) -> str:
    """One message, as ``flwr-clientapp`` runs it: task input, the app, reply, task output.
    ``started(metadata)`` is told the message before the app runs. Returns the sub-status
    (completed / failed)."""
    client = endpoint.client(token=token)
    heartbeat = HeartbeatSender(make_task_heartbeat_fn_http(client))
    message = context = reply = None
    sub_status, details = SubStatus.FAILED, "ClientApp task failed due to unknown reason"
    try:
        heartbeat.start()
        message, context, run, fab = pull_input(client)
        if started is not None:
            started(message.metadata)
        app = loaded.get(run, fab)
        _mark("worker-start", run=run.run_id)
        reply = app(message=message, context=context)
        sub_status, details = SubStatus.COMPLETED, ""
    except Exception as ex:  # the message fails, the worker lives on (as flwr-clientapp's Error reply)
        code = ErrorCode.LOAD_CLIENT_APP_EXCEPTION if isinstance(ex, LoadClientAppError) else \
            ErrorCode.CLIENT_APP_RAISED_EXCEPTION
        details = f"{type(ex)}:<'{ex}'>"
        log(ERROR, "ClientApp raised an exception", exc_info=ex)
        if message is not None:
            reply = Message(Error(code=code, reason=details), reply_to=message)
    finally:
        try:
            if reply is not None and context is not None:
                push_message(client, reply, context)
                _mark("worker-pushed")
        except Exception as ex:  # noqa: BLE001 - reported as the task's failure
            log(ERROR, "Failed to push reply message", exc_info=ex)
            sub_status, details = SubStatus.FAILED, f"reply could not be pushed: {ex}"
        push_task_output(client, context, sub_status, details)
        if heartbeat.is_running:
            heartbeat.stop()
        client.close()
    return sub_status


def _answer_failed(endpoint: Endpoint, token: str, message: Metadata | None, details: str) -> None:
    """The Error reply to the message (``message``: its metadata, as the dead worker reported it)
    and the task's failed status; without the message (it died before pulling it) the status."""
    client = endpoint.client(token=token, max_tries=3)
    try:
        if message is not None:
            reply = Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=details),
                            reply_to=make_message(metadata=message, content=RecordDict()))
            context = Context(run_id=message.run_id, node_id=message.dst_node_id, node_config={},
                              state=RecordDict(), run_config={})
            push_message(client, reply, context)
    except Exception as ex:  # noqa: BLE001 - the token may have expired: the server's round-timeout applies
        log(WARNING, "Warm ClientApp runner: could not answer the failed message (%s)", ex)
    finally:
        push_task_output(client, None, SubStatus.FAILED, details)  # the node's kept Context stays as it was
        client.close()


def _worker_main(conn: Connection, endpoint: Endpoint, fab_hash: str, threads: int | None) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the runner handles Ctrl-C and stops its workers
    if threads:
        torch.set_num_threads(threads)
    runner = os.getppid()
    loaded = _LoadedApp(fab_hash)
    while True:
        if not conn.poll(1.0):
            if os.getppid() != runner:  # the runner is gone
                return
            continue
        token = conn.recv()
        if token is None:
            return
        conn.send(("done", run_message(endpoint, token, loaded, lambda meta: conn.send(("message", meta)))))


@dataclass
class _Worker:
    key: tuple[int, str]
    process: multiprocessing.process.BaseProcess
    conn: Connection
    busy: str | None = None  # the token of the message it runs
    message: Metadata | None = None  # that message's metadata, once the worker pulled it
    last: float = field(default_factory=time.monotonic)


# --- the runner ---------------------------------------------------------------------------------------------------
class WarmRunner:
    """Acquire ClientApp tasks from a SuperNode's Runtime API and run them on warm workers."""

    def __init__(self, endpoint: Endpoint, *, poll_interval: float = 0.05, max_workers: int = 2,
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
                    _mark("acquired", run=res.task.run_id)
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
        proc = _FORK.Process(target=_worker_main, args=(child, self.endpoint, key[1], self.threads),
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
        proc = _FORK.Process(target=_answer_failed, args=(self.endpoint, token, message, details), daemon=True)
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
    endpoint = Endpoint(args.runtime_api_address, args.insecure,
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
