"""Result files written atomically next to their destination.

A result file appears only when complete (a temporary file in the same directory, fsynced, then
renamed over the destination); a failed write removes its temporary file and leaves the destination
as it was.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path


def atomic_write(path: Path, data: bytes, mode: int = 0o600) -> Path:
    """Write ``data`` to ``path`` only when complete: temp file beside it, fsync, rename."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if path.is_dir():
            raise IsADirectoryError(errno.EISDIR, "is a directory", str(path))
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path
