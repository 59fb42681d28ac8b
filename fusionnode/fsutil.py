"""Durable file-system steps shared by the checkpoint writers."""

from __future__ import annotations

import os
from pathlib import Path


def fsync_file(path: Path) -> None:
    """Flush a file's data to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Flush a directory's entries (renames, new files) to disk."""
    if os.name == "nt":  # directories cannot be opened for fsync on Windows
        return
    fsync_file(path)
