"""Flower 1.42's message objects with fewer copies and one hash per chunk, in this process.

Flower sends every ``Array`` of a message as ``ArrayChunk`` objects of at most 5 MiB, each
named by the SHA-256 of its deflated bytes. Measured on a deployed round of a 85 MB model
(2-core machine, 2026-12-04), Flower's own object code cost each of this project's processes
that sends or receives the model (the ServerApp, a ClientApp) about 0.2 s a message:

* ``ArrayChunk.deflate`` builds a bytearray, extends it with the chunk and copies it to bytes
  (two copies of the chunk; deflated once for its id and once to be sent);
* ``ArrayChunk`` never caches its id (its ``is_dirty`` is always true): outside Flower's
  ``no_object_id_recompute`` every access hashes the chunk again -- a ClientApp's reply is
  hashed twice (``push_message`` asks the message's id before entering that context);
* ``ArrayChunk.inflate`` copies the body out of the pulled bytes, and ``Array.inflate`` grows
  a bytearray chunk by chunk and copies it to bytes at the end.

``install()`` swaps these four for equivalents that produce the same bytes and the same object
ids (tests/test_fast_objects.py compares them with Flower's on arrays of every size, empty and
with repeated chunks): the header and the chunk joined once; a chunk's id kept once computed
while its data is read-only memory (an immutable ``bytes``' view: the chunks Flower makes);
the body a view of the pulled bytes; the chunks joined once. Like
``server.faults.quick_object_pulls`` it changes this process only, is idempotent, and refuses to
run on a Flower version whose functions it does not know (the check: the version string and
the replaced functions' identity). The ServerApp and the ClientApp call it when they start;
Flower's own processes (SuperLink, SuperNode) are never touched.
"""

from __future__ import annotations

import json
from typing import Any

import flwr
from flwr.app.message.array import Array
from flwr.app.message.arraychunk import ArrayChunk
from flwr.supercore.constant import HEAD_BODY_DIVIDER, HEAD_VALUE_DIVIDER
from flwr.supercore.inflatable.inflatable_object import (
    InflatableObject,
    get_object_body,
    get_object_children_ids_from_object_content,
    get_object_id,
    get_object_type_from_object_content,
)

#: the Flower version whose object code the swaps reproduce
FLOWER_VERSION = "1.42.0"

_ORIGINAL: dict[str, Any] = {
    "ArrayChunk.deflate": ArrayChunk.deflate,
    "ArrayChunk.inflate": ArrayChunk.__dict__["inflate"],
    "Array.inflate": Array.__dict__["inflate"],
    "ArrayChunk.object_id": InflatableObject.__dict__["object_id"],
}


def _chunk_deflate(self: ArrayChunk) -> bytes:
    """Flower's header, divider and body, joined once (``add_header_to_object_body``'s bytes)."""
    head = f"{self.__class__.__qualname__}{HEAD_VALUE_DIVIDER}{HEAD_VALUE_DIVIDER}{len(self.data)}"
    return b"".join((head.encode("utf-8"), HEAD_BODY_DIVIDER, self.data))


def _chunk_object_id(self: ArrayChunk) -> str:
    """The chunk's id, hashed once while its data is the same read-only buffer (Flower: every access)."""
    data = self.__dict__.get("data")
    known = self.__dict__.get("_object_id")
    if known is not None and self.__dict__.get("_id_of") is data and getattr(data, "readonly", False):
        return known
    self.__dict__["_object_id"] = object_id = get_object_id(self.deflate())
    self.__dict__["_id_of"] = data
    return object_id


def _chunk_inflate(cls: type[ArrayChunk], object_content: bytes,
                   children: dict[str, InflatableObject] | None = None) -> ArrayChunk:
    """An ArrayChunk whose data is a view of ``object_content``'s body (Flower: a copy of it)."""
    if children:
        raise ValueError("`ArrayChunk` objects do not have children.")
    object_type = get_object_type_from_object_content(object_content)
    if object_type != cls.__qualname__:
        raise ValueError(f"Class name ({cls.__qualname__}) and object type ({object_type}) do not match.")
    start = object_content.find(HEAD_BODY_DIVIDER) + len(HEAD_BODY_DIVIDER)
    return cls(data=memoryview(object_content)[start:])


def _array_inflate(cls: type[Array], object_content: bytes,
                   children: dict[str, InflatableObject] | None = None) -> Array:
    """Flower's ``Array.inflate`` with the chunks joined once (Flower: a bytearray grown chunk by chunk, then copied)."""
    if children is None:
        children = {}
    body = get_object_body(object_content, cls)
    children_ids = get_object_children_ids_from_object_content(object_content)
    metadata = json.loads(body.decode(encoding="utf-8"))
    chunk_ids = [children_ids[i] for i in metadata["arraychunk_ids"]]
    if set(chunk_ids) != set(children.keys()):
        raise ValueError(f"Unexpected set of `children`. Expected {set(chunk_ids)} but got {set(children.keys())}.")
    array = cls(dtype=metadata["dtype"], shape=tuple(metadata["shape"]), stype=metadata["stype"], data=b"")
    array.data = b"".join(children[chunk_id].data for chunk_id in chunk_ids)
    return array


def installed() -> bool:
    return ArrayChunk.__dict__.get("deflate") is _chunk_deflate


def install() -> None:
    """Swap Flower 1.42's four object functions for the faster equivalents, in this process."""
    if installed():
        return
    current = {"ArrayChunk.deflate": ArrayChunk.__dict__.get("deflate"),
               "ArrayChunk.inflate": ArrayChunk.__dict__.get("inflate"),
               "Array.inflate": Array.__dict__.get("inflate"),
               "ArrayChunk.object_id": ArrayChunk.__dict__.get("object_id", InflatableObject.__dict__["object_id"])}
    moved = [name for name, fn in current.items() if fn is not _ORIGINAL[name]]
    if flwr.__version__ != FLOWER_VERSION or moved:
        raise RuntimeError(f"strategies.flower_api.fast_objects reproduces Flower {FLOWER_VERSION}'s object code; this is "
                           f"Flower {flwr.__version__}{' with ' + ', '.join(moved) + ' changed' if moved else ''}: the "
                           "swaps need revisiting for it")
    ArrayChunk.deflate = _chunk_deflate
    ArrayChunk.object_id = property(_chunk_object_id)
    ArrayChunk.inflate = classmethod(_chunk_inflate)
    Array.inflate = classmethod(_array_inflate)


def uninstall() -> None:
    """Flower's own functions back (tests)."""
    if not installed():
        return
    ArrayChunk.deflate = _ORIGINAL["ArrayChunk.deflate"]
    del ArrayChunk.object_id
    ArrayChunk.inflate = _ORIGINAL["ArrayChunk.inflate"]
    Array.inflate = _ORIGINAL["Array.inflate"]
