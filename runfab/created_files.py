"""Files this project creates in folders a user chose (the output root, a prepared corpus, a report's or
a benchmark's folder), opened without following a link.

Opening such a path the ordinary way follows a symbolic link placed there beforehand and writes the
file it points to (in a shared output root, anyone's), or creates a dangling link's target. Here a
link, anything but a regular file, or a file with another hard link is refused with ``NotCreatedHere``
(one line that names it) and left exactly as it was. Only the last component of the path is checked:
the folders above it are the user's choice.

Standard library only, so that the tools use it without importing torch.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

_FLAGS = {  # the open(2) flags of each mode; "w" truncates only after the file was checked
    "w": os.O_WRONLY | os.O_CREAT,
    "x": os.O_WRONLY | os.O_CREAT | os.O_EXCL,
    "a": os.O_WRONLY | os.O_CREAT | os.O_APPEND,
    "a+": os.O_RDWR | os.O_CREAT | os.O_APPEND,
}


class NotCreatedHere(FileExistsError):
    """A path where a file is to be written holds something this program did not create there."""

    def __init__(self, path: str, what: str) -> None:
        super().__init__(errno.EEXIST, what, path)
        self.message = (f"{path} is {what}; nothing is written through it and it was left as it is: move it away, "
                        "or write somewhere else")

    def __str__(self) -> str:
        return self.message


def open_created(path: str | os.PathLike, mode: str = "w", encoding: str | None = "utf-8"):
    """``open(path, mode)`` for a file to write, never through a link: "w" (truncated), "x" (must not
    exist), "a" or "a+" (appended), each with "b" for bytes."""
    path = os.fspath(path)
    binary = "b" in mode
    kind = mode.replace("b", "")
    # O_NONBLOCK: a planted FIFO is refused instead of blocking the open until someone reads it.
    flags = _FLAGS[kind] | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    try:
        fd = os.open(path, flags, 0o666)
    except OSError as error:
        if error.errno in (errno.ELOOP, errno.EEXIST) and os.path.islink(path):  # EEXIST: with O_EXCL
            raise NotCreatedHere(path, f"a symbolic link (to {os.readlink(path)})") from None
        if error.errno == errno.ENXIO:  # a FIFO or socket without a reader
            raise NotCreatedHere(path, "not a regular file") from None
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise NotCreatedHere(path, "not a regular file")
        if info.st_nlink > 1:
            raise NotCreatedHere(path, f"a file with {info.st_nlink - 1} other hard link(s), which writing it would "
                                       "change too")
        os.set_blocking(fd, True)
        if kind == "w":
            os.ftruncate(fd, 0)
        return os.fdopen(fd, mode.replace("x", "w"), **({} if binary else {"encoding": encoding}))
    except BaseException:
        os.close(fd)
        raise


def write_text(path: str | os.PathLike, text: str, encoding: str = "utf-8") -> None:
    """``Path.write_text`` through ``open_created``."""
    with open_created(path, "w", encoding=encoding) as file:
        file.write(text)


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """``Path.write_bytes`` through ``open_created``."""
    with open_created(path, "wb") as file:
        file.write(data)


def is_same_file(path: Path, info: os.stat_result) -> bool:
    """Whether ``path`` itself (not a link's target) is still the file ``info`` describes."""
    try:
        now = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return (now.st_dev, now.st_ino) == (info.st_dev, info.st_ino)
