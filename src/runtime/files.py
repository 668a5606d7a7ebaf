"""Writing a file whole or not at all."""

from __future__ import annotations

import os
from pathlib import Path


def write_atomically(path: Path, write) -> None:
    """write(file) into PATH.tmp (binary), flushed to disk, then renamed over path: a failure part way leaves the
    previous file as it was and removes PATH.tmp (a crash leaves PATH.tmp behind)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
