"""Ctrl-C and SIGTERM for the command lines (the engine, the runner, the Flower wrapper): the run
stops where it is, one line says where and how to go on, and the exit status is the shell's
(130 for SIGINT, 143 for SIGTERM), without a traceback.

``stoppable()`` makes SIGTERM raise ``Stopped`` in the main thread, as SIGINT raises
``KeyboardInterrupt``; both unwind through the run's ``finally`` blocks (the run folder's lock,
the progress display, a local SuperLink's stop). Rows already written and the last checkpoint
are kept (``tasks.runs``: rows are flushed a round at a time, checkpoints written atomically),
so ``resume=true`` continues bit-identically.
"""

from __future__ import annotations

import shlex
import signal
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from types import FrameType


class Stopped(BaseException):
    """SIGTERM arrived (a BaseException, like KeyboardInterrupt: no ``except Exception`` swallows it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise(signum: int, frame: FrameType | None) -> None:
    raise Stopped(signum)


@contextmanager
def stoppable() -> Iterator[None]:
    """SIGTERM raises ``Stopped`` inside the block (the previous handler restored after)."""
    before = signal.signal(signal.SIGTERM, _raise)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


def interruption(exc: BaseException) -> tuple[str, int] | None:
    """(the signal's name, the exit status) of a KeyboardInterrupt or ``Stopped``; None for anything else."""
    if isinstance(exc, Stopped):
        return signal.Signals(exc.signum).name, 128 + exc.signum
    if isinstance(exc, KeyboardInterrupt):
        return "SIGINT", 128 + signal.SIGINT
    return None


def command_line(module: str, args: Sequence[str], *extra: str) -> str:
    """``python -m module args... extra...``, quoted for a POSIX shell."""
    return shlex.join(["python", "-m", module, *args, *extra])


def report(prog: str, exc: BaseException, where: str) -> int:
    """Print ``prog: SIGINT: where`` on stderr; the exit status for ``exc``."""
    name, code = interruption(exc) or ("interrupted", 1)
    print(f"{prog}: {name}: {where}", file=sys.stderr, flush=True)
    return code
