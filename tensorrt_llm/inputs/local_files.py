"""Read local media files without blocking on them and without reading more than a cap.

`Path.read_bytes()` on a FIFO blocks until a writer appears (pinning a worker thread forever),
on /dev/zero it never ends, and a path holding a NUL byte or a lone surrogate raises errors
that are not ValueError. So paths are checked as text first, files are opened with O_NONBLOCK
(opening a FIFO then returns at once), only a regular file (os.fstat on the opened descriptor,
so nothing can be swapped in between the check and the read) is read, and the byte cap is
enforced while reading, not only from the size the file system reports.
"""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

MAX_PATH_CHARS = 4096  # PATH_MAX on Linux
_MAX_NAME_BYTES = 255  # NAME_MAX on Linux
_CHUNK = 1 << 20


class LocalFileError(ValueError):
    """A local media path that cannot be read.

    reason: "bad_path", "not_found", "not_regular", "too_large" or "unreadable".
    """

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


def check_path_text(raw: str) -> None:
    """Refuse path text the OS cannot take, with a clear message (never an OS error)."""
    shown = ascii(raw[:64])
    if "\x00" in raw:
        raise LocalFileError(f"local path {shown} contains a NUL byte", "bad_path")
    if len(raw) > MAX_PATH_CHARS:
        raise LocalFileError(
            f"local path is {len(raw)} characters long, over the {MAX_PATH_CHARS} limit",
            "bad_path",
        )
    try:
        encoded = os.fsencode(raw)
    except UnicodeError:
        raise LocalFileError(
            f"local path {shown} is not valid text (lone surrogate or undecodable character)",
            "bad_path",
        ) from None
    # NOTE: os.fsencode keeps lone surrogates on POSIX (surrogateescape); only real UTF-8
    # names can exist on the file systems we serve from, so refuse them here.
    if sys.platform != "win32":
        try:
            raw.encode("utf-8")
        except UnicodeEncodeError:
            raise LocalFileError(
                f"local path {shown} is not valid UTF-8 text (lone surrogate)", "bad_path"
            ) from None
    if any(len(part) > _MAX_NAME_BYTES for part in encoded.split(b"/")):
        raise LocalFileError(
            f"local path {shown} has a name over {_MAX_NAME_BYTES} bytes", "bad_path"
        )


def _open_flags() -> int:
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    return flags | getattr(os, "O_NOCTTY", 0)


def _opened_path(fd: int) -> Path | None:
    """The real path of an open descriptor where the OS tells it (Linux /proc)."""
    try:
        return Path(os.readlink(f"/proc/self/fd/{fd}"))
    except OSError:
        return None


def read_regular_file(path: Path, max_bytes: int, inside: Path | None = None) -> bytes:
    """The bytes of a regular file of at most `max_bytes`; raises LocalFileError.

    inside: when given, the opened file must really lie under this folder (checked on the
    descriptor where the OS allows, so a symlink swapped in after resolving cannot escape).
    """
    check_path_text(str(path))
    try:
        fd = os.open(path, _open_flags())
    except FileNotFoundError:
        raise LocalFileError(
            f"local media file {str(path)!r} does not exist", "not_found"
        ) from None
    except OSError as exc:  # ENXIO (a socket), EACCES, ELOOP, ENAMETOOLONG, ...
        raise LocalFileError(
            f"local media file {str(path)!r} cannot be opened ({os.strerror(exc.errno or 0)})",
            "unreadable",
        ) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise LocalFileError(
                f"local media path {str(path)!r} is not a regular file", "not_regular"
            )
        real = _opened_path(fd) if inside is not None else None
        if real is not None and inside is not None and not real.is_relative_to(inside):
            raise LocalFileError(f"local media path {str(path)!r} moved while opening", "bad_path")
        if info.st_size > max_bytes:
            raise LocalFileError(
                f"local file {str(path)!r} has {info.st_size} bytes, over the {max_bytes}-byte cap",
                "too_large",
            )
        return _read_capped(fd, path, max_bytes)
    finally:
        os.close(fd)


def _read_capped(fd: int, path: Path, max_bytes: int) -> bytes:
    # NOTE: the size from fstat can change while reading (a file being appended to), so the
    # cap is enforced on the bytes actually read.
    chunks, total = [], 0
    while True:
        try:
            chunk = os.read(fd, min(_CHUNK, max_bytes + 1 - total))
        except OSError as exc:
            raise LocalFileError(
                f"reading local file {str(path)!r} failed ({os.strerror(exc.errno or 0)})",
                "unreadable",
            ) from None
        if not chunk:
            return b"".join(chunks)
        total += len(chunk)
        if total > max_bytes:
            raise LocalFileError(
                f"local file {str(path)!r} is over the {max_bytes}-byte cap", "too_large"
            )
        chunks.append(chunk)
