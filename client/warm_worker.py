"""The warm ClientApp runner's worker side: what runs in the processes ``client/warm_runner.py`` forks.

A worker serves the messages of one (run id, FAB hash): it installs and verifies the FAB as Flower
does (``install_from_fab``: the FAB's SHA-256 against the hash the SuperNode announced, and every
file against the FAB's manifest), loads the ClientApp once, and runs each message with Flower's
task-input, reply and task-output calls (``run_message``), as ``flwr-clientapp`` runs one. A
ClientApp that raises fails its message only (Flower's Error reply). ``answer_failed`` answers the
message of a worker that died, from a short-lived fork of the runner.

Loaded by the runner from this file, under a private name (``warm_runner.load_worker``), never as
part of the project's ``client`` package: the runner imports nothing of the project, so a fork
loads the FAB's ``client`` (and what it imports) as a fresh ``flwr-clientapp`` would. The heavy
imports (flwr, torch) happen here, once, in the runner: every fork starts warm (nothing of torch
runs in the runner, so the fork is clean).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from dataclasses import dataclass
from logging import ERROR, WARNING
from multiprocessing.connection import Connection

# Imported once, in the runner, so that every fork starts warm (nothing of torch runs in the runner).
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
from flwr.proto.runtime_pb2 import PullAppMessagesRequest, PullTaskInputRequest  # pylint: disable=E0611
from flwr.supercore import log
from flwr.supercore.fab import Fab
from flwr.supercore.heartbeat import HeartbeatSender, make_task_heartbeat_fn_http
from flwr.supercore.inflatable.inflatable_protobuf_utils import (
    make_confirm_message_received_fn_protobuf,
    make_pull_object_fn_protobuf,
)
from flwr.supercore.inflatable.inflatable_utils import pull_and_inflate_object_from_tree
from flwr.supercore.interceptors import (
    RuntimeTokenHttpInterceptor,
    RuntimeVersionHttpInterceptor,
    SuperExecAuthHttpInterceptor,
)
from flwr.supercore.retry import make_simple_http_retry_invoker
from flwr.supercore.run import Run
from flwr.supercore.runtime import RuntimeHttpClient
from flwr.supercore.task_identity import TaskIdentity
from flwr.supernode.runtime.run_clientapp import push_message, push_task_output


def mark(event: str, **fields: object) -> None:
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


class _LoadedApp:
    """The ClientApp of one FAB, installed, verified and loaded once."""

    def __init__(self, fab_hash: str, forget: str | None = None) -> None:
        self.fab_hash = fab_hash
        self.forget = forget  # the runner's own package, if it has one: dropped before the FAB's app loads
        self.app: ClientApp | None = None

    def get(self, run, fab) -> ClientApp:
        if fab.hash_str != self.fab_hash:
            raise LoadClientAppError(f"the task announced FAB {self.fab_hash[:12]}, the SuperNode sent "
                                     f"{fab.hash_str[:12]}: refused")
        if self.app is None:
            install_from_fab(fab.content, skip_prompt=True)  # Flower's verification: FAB hash and file hashes
            _forget_package(self.forget)
            load = get_load_client_app_fn(default_app_ref="", app_path=None, multi_app=True)
            self.app = load(run.fab_id, run.fab_version, fab.hash_str)
        return self.app


def _forget_package(own: str | None) -> None:
    """Started as ``python -m client.warm_runner``, the runner imported its own package, ``client``
    (``own``), from wherever it was installed: forget it, so that the FAB's ``client`` loads in its
    place. Nothing else is dropped: what the interpreter imported at its start (``sitecustomize``,
    say) stays, as in a fresh ``flwr-clientapp`` process."""
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
        mark("worker-start", run=run.run_id)
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
                mark("worker-pushed")
        except Exception as ex:  # noqa: BLE001 - reported as the task's failure
            log(ERROR, "Failed to push reply message", exc_info=ex)
            sub_status, details = SubStatus.FAILED, f"reply could not be pushed: {ex}"
        push_task_output(client, context, sub_status, details)
        if heartbeat.is_running:
            heartbeat.stop()
        client.close()
    return sub_status


def answer_failed(endpoint: Endpoint, token: str, message: Metadata | None, details: str) -> None:
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


def worker_main(conn: Connection, endpoint: Endpoint, fab_hash: str, threads: int | None,
                forget: str | None = None) -> None:
    """A worker's loop: a token from the runner, the message run, ("done", sub-status) back; it exits
    when the runner sends None or is gone (``forget``: the runner's package, see ``_forget_package``)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the runner handles Ctrl-C and stops its workers
    if threads:
        torch.set_num_threads(threads)
    runner = os.getppid()
    loaded = _LoadedApp(fab_hash, forget)
    while True:
        if not conn.poll(1.0):
            if os.getppid() != runner:  # the runner is gone
                return
            continue
        token = conn.recv()
        if token is None:
            return
        conn.send(("done", run_message(endpoint, token, loaded, lambda meta: conn.send(("message", meta)))))
