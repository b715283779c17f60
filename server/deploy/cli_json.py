"""The one reader of the ``flwr ... --format json`` output (Flower 1.42), stdlib only.

Flower's CLI prints one JSON object, sometimes after banner lines (``Loading project
configuration...``) and with exit status 0 even on errors (``{"success": false,
"error-message": ...}``). ``parse_cli_json`` finds the object; ``field`` walks a dotted
path into it. Imported by ``simulations.flower`` and run as a script by ``submit.sh``::

    python3 cli_json.py FIELD [--last] < output     # prints the value ("" if absent)
"""

from __future__ import annotations

import json
import re
import sys
from typing import Any

_OBJECT_START = re.compile(r"(?m)^\{")


def parse_cli_json(text: str, *, last: bool = False) -> Any:
    """The JSON object in ``text``: all of it, else the first (``last``: the last) object
    that starts a line. ValueError if there is none."""
    stripped = text.strip()
    if not last:
        try:
            return json.loads(stripped)
        except json.JSONDecodeError:
            pass
    decoder = json.JSONDecoder()
    starts = [m.start() for m in _OBJECT_START.finditer(stripped)]
    for start in reversed(starts) if last else starts:
        try:
            obj, _ = decoder.raw_decode(stripped[start:])
        except json.JSONDecodeError:
            continue
        return obj
    raise ValueError("no JSON object in the flwr output")


def field(obj: Any, path: str) -> Any:
    """``field(obj, "runs.status")``: a list of one run (``flwr ls --run-id``) is entered;
    a missing key gives ""."""
    for key in path.split(".") if path else []:
        if isinstance(obj, list):
            obj = obj[0] if obj else {}
        obj = obj.get(key, "") if isinstance(obj, dict) else ""
    if isinstance(obj, list) and len(obj) == 1:
        obj = obj[0]
    return obj


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    try:
        obj = parse_cli_json(sys.stdin.read(), last="--last" in argv[1:])
    except ValueError:
        return 0  # no object: print nothing, the caller reports the CLI's own output
    value = field(obj, argv[0])
    print(json.dumps(value) if isinstance(value, (dict, list)) else value)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
