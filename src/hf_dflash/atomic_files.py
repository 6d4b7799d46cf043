"""Files written whole or not at all.

Every file hf-dflash writes for later reading (a card, `training_info.json`, an adapter's base record, a prompt file, a
cache of the target's features, a benchmark report) is filled under a temporary name of its own beside the
destination and renamed into place (`os.replace`) only when complete. A failed or killed write leaves the destination
as it was and removes its temporary file; two processes writing the same destination never share a temporary file.
The temporary file gets the mode a plain `open` would have given the destination (`tempfile` makes it private).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def created_mode(directory: bool = False) -> int:
    """The mode `open` (0o666) or `mkdir` (0o777) gives a new file or folder under this process's umask."""
    umask = os.umask(0)
    os.umask(umask)
    return (0o777 if directory else 0o666) & ~umask


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a new temporary path beside `path` for the caller to write; when the block ends without an exception it
    replaces `path` whole, otherwise it is removed and `path` is untouched. Creates `path`'s parent folders."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        tmp.chmod(created_mode())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)  # gone after a successful replace; the partial file after a failure


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """Write `text` (UTF-8) to `path` through `atomic_path`; returns `path`."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return Path(path)
