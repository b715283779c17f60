"""Packed messages: all arrays of a Message as one byte vector, with its layout.

Flower 1.42 stores and sends each array of a message as its own object (one authenticated
request per array between SuperNode, SuperLink and ServerApp); a multi-client node's reply
of the digits CNN holds 4 x 16 of them. ``pack`` turns all ArrayRecords of a RecordDict into
ONE ArrayRecord, ``PACKED``, holding ONE uint8 array: a header, the layout (record names,
keys, dtypes and shapes as UTF-8 JSON) and every array's bytes. Config and metric records are
left as they are. ``unpack`` restores the ArrayRecords exactly (same names, keys, order,
dtypes, shapes and bytes), so every check of a reply runs on what the client sent, as for an
unpacked one. A malformed layout is a reason to reject, never an exception that ends a run.

Copies (a model of the paper's size is 96 MB): ``pack_arrays`` writes the payload with ONE copy
of every array's bytes -- from a tensor's memory, or from the raw part of an ``Array``'s
``.npy`` bytes, never through ``np.save`` / ``np.load`` -- straight into the ``.npy`` bytes of
the packed ``Array``; ``unpack_arrays`` reads the payload with ONE copy, into the tensors the
reader uses (``unpack`` rebuilds Flower ``ArrayRecord``s on top, for readers that want them).

Both sides of this project speak it: the ServerApp packs its train messages (``packed=True``
on the strategy), this project's ClientApp unpacks them and answers a packed message packed
(a plain one plain); the strategy unpacks any reply that is packed and reads any other as before, so a foreign
ClientApp that sends Flower's usual ArrayRecord of a state dict works unchanged, and a user's
ServerApp with the strategy's default (``packed=False``) sends plain messages.
"""

from __future__ import annotations

import io
import json
import math
from collections.abc import Mapping

import numpy as np
import torch
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
#: dtypes a packed message may carry (numpy names; little-endian on the wire), and bfloat16 (2 bytes)
DTYPES = {name: np.dtype(name).newbyteorder("<") for name in
          ("float32", "float64", "float16", "int64", "int32", "int16", "int8", "uint8", "bool")}
BFLOAT16 = "bfloat16"
WIRE_DTYPES = (*DTYPES, BFLOAT16)
#: the dtypes a lossy entry (``[key, wire dtype, shape, dtype, delta]``) may be restored to
RESTORE = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16, BFLOAT16: torch.bfloat16}
#: Flower's serialisation type of an ``Array`` holding ``.npy`` bytes
NUMPY_STYPE = "numpy.ndarray"

#: what ``pack_arrays`` takes as one array: a tensor, a NumPy array or a Flower ``Array``
Packable = torch.Tensor | np.ndarray | Array


def is_packed(content: RecordDict) -> bool:
    return PACKED in content.array_records


# --- writing ---------------------------------------------------------------------------------------------------
def _raw(name: str, key: str, value: Packable) -> tuple[str, list[int], memoryview]:
    """(dtype name, shape, the array's bytes in C order, little-endian) without a copy where the
    value already holds them so: a contiguous CPU tensor's memory, an ``Array``'s raw ``.npy`` body."""
    if isinstance(value, Array):
        raw = _npy_body(value)
        if raw is not None:
            return raw
        value = value.numpy()
    elif isinstance(value, torch.Tensor):
        value = value.detach().cpu().contiguous()
        if value.dtype == torch.bfloat16:  # no NumPy dtype: its 2-byte words
            return BFLOAT16, list(value.shape), memoryview(value.view(torch.int16).numpy().reshape(-1).view(np.uint8))
        value = value.numpy()
    a = np.asarray(value)
    if a.dtype.name not in DTYPES:
        raise TypeError(f"pack: array {name}/{key} has dtype {a.dtype.name}, not one of {sorted(DTYPES)}")
    a = np.asarray(a, dtype=DTYPES[a.dtype.name], order="C")  # (np.ascontiguousarray makes 0-d arrays 1-d)
    return a.dtype.name, list(a.shape), memoryview(a.reshape(-1).view(np.uint8))


def _npy_body(array: Array) -> tuple[str, list[int], memoryview] | None:
    """An ``Array``'s dtype, shape and raw bytes read from its ``.npy`` header (a view); None where
    the bytes are not a plain C-order little-endian array of a packable dtype (then read by numpy)."""
    if array.stype != NUMPY_STYPE:
        return None
    try:
        head = io.BytesIO(array.data[:4096])
        version = np.lib.format.read_magic(head)
        reader = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, fortran, dtype = reader(head)
    except (ValueError, OSError):
        return None
    little = dtype.byteorder in ("<", "|") or (dtype.byteorder == "=" and np.little_endian)
    if fortran or dtype.name not in DTYPES or not little:
        return None
    start = head.tell()
    if len(array.data) - start != math.prod(shape) * dtype.itemsize:
        return None
    return dtype.name, list(shape), memoryview(array.data)[start:]


def npy_bytes(parts: list, nbytes: int) -> bytes:
    """The ``.npy`` bytes of a uint8 vector of ``nbytes`` made of ``parts`` (bytes-like), in ONE copy."""
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "|u1", "fortran_order": False, "shape": (nbytes,)})
    return b"".join([header.getvalue(), *parts])


#: how one lossy entry is to be read: (the dtype to restore, whether it is a difference from the reader's reference)
Restore = tuple[str, bool]


def pack_arrays(records: Mapping[str, Mapping[str, Packable]],
                restore: Mapping[str, Mapping[str, Restore]] | None = None) -> Array:
    """ONE uint8 ``Array`` holding every array of ``records`` (record name -> key -> array) and the layout.

    ``restore`` (record -> key -> (dtype, delta)): entries sent in a lossy dtype (``wire.encode``:
    bfloat16 or float16) that the reader casts back to ``dtype`` and, where ``delta``, adds to its
    reference (the global model the reply answers)."""
    layout, chunks, size = [], [], 0
    restore = restore or {}
    for name, record in records.items():
        entries = []
        for key, value in record.items():
            dtype, shape, raw = _raw(name, key, value)
            chunks.append(raw)
            size += raw.nbytes
            how = restore.get(name, {}).get(key)
            entries.append([key, dtype, shape] if how is None else [key, dtype, shape, how[0], bool(how[1])])
        layout.append([name, entries])
    head = json.dumps(layout, separators=(",", ":")).encode()
    prefix = MAGIC + len(head).to_bytes(8, "little") + head
    payload = npy_bytes([prefix, *chunks], len(prefix) + size)
    return Array(dtype="uint8", shape=(len(prefix) + size,), stype=NUMPY_STYPE, data=payload)


def packed_content(payload: Array, others: Mapping[str, object] = ()) -> RecordDict:
    """A RecordDict of the packed ``payload`` and the message's other (config, metric) records."""
    out = RecordDict({PACKED: ArrayRecord({PAYLOAD: payload})})
    for name, record in dict(others).items():
        out[name] = record
    return out


def pack(content: RecordDict) -> RecordDict:
    """``content`` with all its ArrayRecords in one (``PACKED``); other records as they are."""
    payload = pack_arrays({name: dict(record) for name, record in content.array_records.items()})
    return packed_content(payload, {n: r for n, r in content.items() if not isinstance(r, ArrayRecord)})


# --- reading ---------------------------------------------------------------------------------------------------
def unpack_arrays(content: RecordDict, reference: Mapping[str, torch.Tensor] | None = None,
                  ) -> tuple[dict[str, dict[str, torch.Tensor]] | None, str | None]:
    """The array records a packed ``content`` carries, as tensors (record name -> key -> tensor, in
    the layout's order, each a fresh writable CPU tensor), or (None, None) when ``content`` is not
    packed, or (None, the reason it cannot be read). Nothing here raises on client input.
    ``reference``: what delta entries are differences from (the global model a reply answers)."""
    if not is_packed(content):
        return None, None
    try:
        return _unpack(content, reference), None
    except (ValueError, TypeError, KeyError, UnicodeDecodeError) as exc:
        return None, f"packed arrays could not be read: {exc}"


def unpack(content: RecordDict) -> tuple[RecordDict, str | None]:
    """The RecordDict ``content`` stood for (itself when not packed), or (``content``, the reason
    it cannot be read). Nothing here raises on client input."""
    arrays, why = unpack_arrays(content)
    if arrays is None:
        return content, why
    out = RecordDict({name: ArrayRecord({k: Array(v.numpy()) for k, v in state.items()})
                      for name, state in arrays.items()})
    for name, record in content.items():
        if name != PACKED:
            out[name] = record
    return out, None


def _payload_view(array: Array) -> memoryview:
    """The packed payload's bytes: a view into the ``Array``'s ``.npy`` body (read by numpy where it
    is not the plain uint8 vector ``pack_arrays`` writes)."""
    raw = _npy_body(array)
    if raw is not None:
        return raw[2]
    return memoryview(array.numpy())


def _read(buf: memoryview, dtype: str, shape: list[int], offset: int) -> torch.Tensor:
    """One array of the payload, copied into a fresh tensor."""
    if dtype == BFLOAT16:
        words = np.frombuffer(buf, dtype=DTYPES["int16"], count=math.prod(shape), offset=offset)
        return torch.from_numpy(words.astype(np.int16, copy=True).reshape(shape)).view(torch.bfloat16)
    values = np.frombuffer(buf, dtype=DTYPES[dtype], count=math.prod(shape), offset=offset)
    return torch.from_numpy(values.astype(np.dtype(dtype), copy=True).reshape(shape))


def _restored(value: torch.Tensor, name: str, key: str, how: list, reference: Mapping[str, torch.Tensor] | None
              ) -> torch.Tensor:
    """A lossy entry cast back to its dtype and, if it is a delta, added to the reference's value."""
    if not (isinstance(how[0], str) and how[0] in RESTORE and isinstance(how[1], bool)
            and (value.is_floating_point() or not how[1])):
        raise ValueError(f"bad restore {how!r} of {name}/{key}")
    out = value.to(RESTORE[how[0]])
    if how[1]:
        ref = None if reference is None else reference.get(key)
        if ref is None or tuple(ref.shape) != tuple(out.shape) or ref.dtype != out.dtype:
            raise ValueError(f"{name}/{key} is a difference from a global array the reader does not hold "
                             f"(or of another shape or dtype)")
        out += ref
    return out


def _unpack(content: RecordDict, reference: Mapping[str, torch.Tensor] | None = None
            ) -> dict[str, dict[str, torch.Tensor]]:
    others = [n for n in content.array_records if n != PACKED]
    if others:
        raise ValueError(f"a packed message carries no other ArrayRecord, got {others}")
    packed = content[PACKED]
    if list(packed) != [PAYLOAD]:
        raise ValueError(f"{PACKED!r} must hold exactly {PAYLOAD!r}, got {list(packed)}")
    array = packed[PAYLOAD]
    if array.dtype != "uint8" or len(array.shape) != 1:
        raise ValueError(f"{PAYLOAD!r} must be a uint8 vector, got {array.dtype} {list(array.shape)}")
    buf = _payload_view(array)
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
    out: dict[str, dict[str, torch.Tensor]] = {}
    for item in layout:
        if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], str) and isinstance(item[1], list)):
            raise ValueError("each layout record is [name, [[key, dtype, shape], ...]]")
        name, entries = item
        if not name or name == PACKED or name in out or name in content:
            raise ValueError(f"record name {name!r} repeats, clashes or is empty")
        state: dict[str, torch.Tensor] = {}
        for entry in entries:
            count += 1
            if count > MAX_ARRAYS:
                raise ValueError(f"more than {MAX_ARRAYS} arrays")
            if not (isinstance(entry, list) and len(entry) in (3, 5) and isinstance(entry[0], str)
                    and entry[1] in WIRE_DTYPES and isinstance(entry[2], list)
                    and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in entry[2])):
                raise ValueError(f"bad layout entry {entry!r} in record {name!r}")
            key, dtype, shape = entry[:3]
            if key in state:
                raise ValueError(f"key {key!r} repeats in record {name!r}")
            nbytes = math.prod(shape) * (2 if dtype == BFLOAT16 else DTYPES[dtype].itemsize)
            if offset + nbytes > len(buf):
                raise ValueError("the layout asks for more bytes than were sent")
            value = _read(buf, dtype, shape, offset)
            state[key] = value if len(entry) == 3 else _restored(value, name, key, entry[3:], reference)
            offset += nbytes
        out[name] = state
    if offset != len(buf):
        raise ValueError(f"{len(buf) - offset} bytes sent beyond the layout")
    return out
