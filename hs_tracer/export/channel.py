"""The pipe between a scheduler process and its export process: framed messages of JSON and arrays.

A message is ``kind``, a JSON object and a list of numpy arrays. On the wire: two little-endian
uint32 (header length, body length), the JSON header (kind, object, each array's dtype and shape),
then the arrays' bytes back to back. Nothing is ever unpickled: the reader accepts only the dtypes
in :data:`DTYPES` and checks every length against the header.

The writer blocks when the pipe is full (the reader is behind): that holds up only the recorder
thread, never SGLang's scheduler thread, whose hand-off queue is bounded and counts what it drops.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np

FRAME = struct.Struct("<II")
DTYPES = frozenset({"<i8", "<f8", "<i4", "<f4", "|i1"})
MAX_MESSAGE = 1 << 30
"""Largest message accepted (a diagnosis window of a 7168-wide, 8-slot model is ~1.4 MB)."""
IOV_MAX = 1024
"""Buffers per ``writev`` call (POSIX guarantees at least 16; Linux takes 1024)."""
PIPE_BYTES = 1 << 20
"""Pipe capacity asked for on Linux, so a window or a long batch fits without a round trip."""


class ChannelError(RuntimeError):
    """The other end sent something that is not a message of this protocol."""


def encode(kind: str, meta: dict[str, Any], arrays: Sequence[np.ndarray] = ()) -> bytes:
    """One framed message."""
    return b"".join(frame(kind, meta, arrays))


def frame(kind: str, meta: dict[str, Any], arrays: Sequence[np.ndarray] = ()) -> list[bytes | memoryview]:
    """One framed message as the buffers to write back to back: the arrays' own memory, not copies
    (a batch of 1024-request steps carries megabytes; each copy of them costs page faults)."""
    arrays = [np.ascontiguousarray(a) for a in arrays]
    header = json.dumps({"kind": kind, "meta": meta,
                         "arrays": [[a.dtype.str, list(a.shape)] for a in arrays]}).encode()
    body = [memoryview(a).cast("B") for a in arrays if a.nbytes]
    return [FRAME.pack(len(header), sum(a.nbytes for a in arrays)), header, *body]


def write_all(fd: int, parts: Sequence[bytes | memoryview]) -> None:
    """Write every byte of ``parts``, in as few system calls as the pipe allows (it may take a long
    message in several writes)."""
    views = [memoryview(p) for p in parts if len(p)]
    while views:
        written = os.writev(fd, views[:IOV_MAX])
        while views and written >= views[0].nbytes:
            written -= views.pop(0).nbytes
        if written:
            views[0] = views[0][written:]


def enlarge_pipe(fd: int) -> None:
    """Ask for :data:`PIPE_BYTES` of pipe buffer (Linux only; best effort)."""
    try:
        import fcntl

        fcntl.fcntl(fd, getattr(fcntl, "F_SETPIPE_SZ", 1031), PIPE_BYTES)
    except (OSError, ImportError):
        pass


class Reader:
    """Splits a byte stream into messages (feed it what ``os.read`` returned)."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[tuple[str, dict[str, Any], list[np.ndarray]]]:
        """The messages completed by ``data``, in order (the rest is kept for the next call)."""
        self._buf += data
        out, pos, buf = [], 0, self._buf
        while len(buf) - pos >= FRAME.size:
            head_len, body_len = FRAME.unpack_from(buf, pos)
            if head_len + body_len > MAX_MESSAGE:
                raise ChannelError(f"message of {head_len + body_len} bytes is larger than allowed")
            start = pos + FRAME.size
            end = start + head_len + body_len
            if len(buf) < end:
                break
            out.append(_decode(bytes(buf[start:start + head_len]), bytes(buf[start + head_len:end])))
            pos = end
        del buf[:pos]  # once per call
        return out


def _decode(header: bytes, body: bytes) -> tuple[str, dict[str, Any], list[np.ndarray]]:
    try:
        head = json.loads(header)
        kind, meta, specs = head["kind"], head["meta"], head["arrays"]
    except (ValueError, KeyError, TypeError) as exc:
        raise ChannelError(f"unreadable message header: {exc}") from None
    arrays, offset = [], 0
    for dtype, shape in specs:
        if dtype not in DTYPES or not all(isinstance(n, int) and n >= 0 for n in shape):
            raise ChannelError(f"array of dtype {dtype!r} and shape {shape!r} is not allowed")
        size = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        if offset + size > len(body):
            raise ChannelError("message body shorter than its header says")
        arrays.append(np.frombuffer(body, dtype=dtype, count=size // np.dtype(dtype).itemsize,
                                    offset=offset).reshape(shape))
        offset += size
    if offset != len(body):
        raise ChannelError("message body longer than its header says")
    return kind, meta, arrays
