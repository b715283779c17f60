"""Packed messages: all arrays of a Message as one byte vector, with its layout.

Flower 1.42 stores and sends each array of a message as its own object (one authenticated
request per array between SuperNode, SuperLink and ServerApp); a multi-client node's reply
of the digits CNN holds 4 x 16 of them. ``pack`` turns all ArrayRecords of a RecordDict into
ONE ArrayRecord, ``PACKED``, holding ONE uint8 array: a header, the layout (record names,
keys, dtypes and shapes as UTF-8 JSON) and every array's bytes. Config and metric records are
left as they are. ``unpack`` restores the ArrayRecords exactly (same names, keys, order,
dtypes, shapes and bytes), so every check of a reply runs on what the client sent, as for an
unpacked one. A malformed layout is a reason to reject, never an exception that ends a run.

Both sides of this project speak it: the ServerApp packs its train messages (``packed=True``
on the strategy), this project's ClientApp unpacks them and answers a packed message packed
(a plain one plain); the strategy unpacks any reply that is packed and reads any other as before, so a foreign
ClientApp that sends Flower's usual ArrayRecord of a state dict works unchanged, and a user's
ServerApp with the strategy's default (``packed=False``) sends plain messages.
"""

from __future__ import annotations

import json
import math

import numpy as np
from flwr.app import Array, ArrayRecord, RecordDict

#: the name of the one ArrayRecord of a packed RecordDict; it holds ONE uint8 array, ``PAYLOAD``:
#: ``MAGIC``, the layout's length (8 bytes, little-endian), the layout (UTF-8 JSON:
#: ``[[record name, [[key, dtype, shape], ...]], ...]``), then every array's bytes in that order
PACKED = "celgc-packed"
PAYLOAD = "payload"
MAGIC = b"CELGCPK1"
#: layout limits: a reply beyond them is rejected before anything is allocated
MAX_LAYOUT_BYTES = 4 << 20
MAX_ARRAYS = 100_000
#: dtypes a packed message may carry (numpy names; little-endian on the wire)
DTYPES = {name: np.dtype(name).newbyteorder("<") for name in
          ("float32", "float64", "float16", "int64", "int32", "int16", "int8", "uint8", "bool")}


def is_packed(content: RecordDict) -> bool:
    return PACKED in content.array_records


def pack(content: RecordDict) -> RecordDict:
    """``content`` with all its ArrayRecords in one (``PACKED``); other records as they are."""
    layout, chunks = [], []
    for name, record in content.array_records.items():
        entries = []
        for key, array in record.items():
            a = array.numpy()
            if a.dtype.name not in DTYPES:
                raise TypeError(f"pack: array {name}/{key} has dtype {a.dtype.name}, not one of {sorted(DTYPES)}")
            chunks.append(np.ascontiguousarray(a, dtype=DTYPES[a.dtype.name]).tobytes())
            entries.append([key, a.dtype.name, list(a.shape)])
        layout.append([name, entries])
    head = json.dumps(layout, separators=(",", ":")).encode()
    payload = b"".join([MAGIC, len(head).to_bytes(8, "little"), head, *chunks])
    out = RecordDict({PACKED: ArrayRecord({PAYLOAD: Array(np.frombuffer(payload, dtype=np.uint8).copy())})})
    for name, record in content.items():
        if not isinstance(record, ArrayRecord):
            out[name] = record
    return out


def unpack(content: RecordDict) -> tuple[RecordDict, str | None]:
    """The RecordDict ``content`` stood for (itself when not packed), or (``content``, the reason
    it cannot be read). Nothing here raises on client input."""
    if not is_packed(content):
        return content, None
    try:
        return _unpack(content), None
    except (ValueError, TypeError, KeyError, UnicodeDecodeError) as exc:
        return content, f"packed arrays could not be read: {exc}"


def _unpack(content: RecordDict) -> RecordDict:
    others = [n for n in content.array_records if n != PACKED]
    if others:
        raise ValueError(f"a packed message carries no other ArrayRecord, got {others}")
    packed = content[PACKED]
    if list(packed) != [PAYLOAD]:
        raise ValueError(f"{PACKED!r} must hold exactly {PAYLOAD!r}, got {list(packed)}")
    array = packed[PAYLOAD]
    if array.dtype != "uint8" or len(array.shape) != 1:
        raise ValueError(f"{PAYLOAD!r} must be a uint8 vector, got {array.dtype} {list(array.shape)}")
    buf = memoryview(array.numpy())
    if bytes(buf[:len(MAGIC)]) != MAGIC or len(buf) < len(MAGIC) + 8:
        raise ValueError("the payload does not start with this project's packing header")
    size = int.from_bytes(buf[len(MAGIC):len(MAGIC) + 8], "little")
    start = len(MAGIC) + 8
    if size > min(MAX_LAYOUT_BYTES, len(buf) - start):
        raise ValueError(f"the layout's length {size} is beyond the payload or {MAX_LAYOUT_BYTES} bytes")
    layout = json.loads(bytes(buf[start:start + size]).decode("utf-8"))
    if not isinstance(layout, list):
        raise ValueError("the layout must be a list of [record name, entries]")
    offset, count = start + size, 0
    out = RecordDict()
    for item in layout:
        if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], str) and isinstance(item[1], list)):
            raise ValueError("each layout record is [name, [[key, dtype, shape], ...]]")
        name, entries = item
        if not name or name == PACKED or name in out or name in content:
            raise ValueError(f"record name {name!r} repeats, clashes or is empty")
        state: dict[str, Array] = {}
        for entry in entries:
            count += 1
            if count > MAX_ARRAYS:
                raise ValueError(f"more than {MAX_ARRAYS} arrays")
            if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str) and entry[1] in DTYPES
                    and isinstance(entry[2], list)
                    and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in entry[2])):
                raise ValueError(f"bad layout entry {entry!r} in record {name!r}")
            key, dtype, shape = entry
            if key in state:
                raise ValueError(f"key {key!r} repeats in record {name!r}")
            nbytes = math.prod(shape) * DTYPES[dtype].itemsize
            if offset + nbytes > len(buf):
                raise ValueError("the layout asks for more bytes than were sent")
            values = np.frombuffer(buf, dtype=DTYPES[dtype], count=math.prod(shape), offset=offset)
            state[key] = Array(values.astype(np.dtype(dtype), copy=True).reshape(shape))
            offset += nbytes
        out[name] = ArrayRecord(state)
    if offset != len(buf):
        raise ValueError(f"{len(buf) - offset} bytes sent beyond the layout")
    for name, record in content.items():
        if name != PACKED:
            out[name] = record
    return out
