"""``python -m simulations.engine`` (also under ``torchrun ... -m simulations.engine``).

A run that cannot start (a bad key or value, a run folder that holds another run, a
checkpoint of another config, a missing file) ends with one line, ``error: ...``, and exit
status 2; other failures keep their traceback."""

import sys

from tasks.runs.checkpoint import CheckpointError
from tasks.runs.run_folder import RunFolderError

from .run import main

if __name__ == "__main__":
    try:
        main()
    except (ValueError, FileNotFoundError, RunFolderError, CheckpointError) as exc:
        print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
        sys.exit(2)
