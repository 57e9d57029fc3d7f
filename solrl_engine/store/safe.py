"""The file-safety layer: every write and read of a run directory goes through here.

A run directory may be shared, copied from someone else, or planted: the engine never follows a
symbolic link when it creates or replaces a file there (temporary files are made with O_EXCL |
O_NOFOLLOW under an unpredictable name, then renamed over the target, which replaces a link rather
than writing through it), keeps a replaced file's permissions, and reads a file of a run directory
only when it is a regular file (opened without following a link and without blocking on a FIFO),
inside that directory, and no larger than what such a file can be. docs/checkpoints.md ("What the
engine trusts in a run directory") says the same for users.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

# the largest a JSON file of a run (a manifest, a checkpoint's state.json, config.json) can be: a state.json
# holds numbers, the config and the evaluations (kilobytes to a few MiB); a link to /dev/zero is not read forever
MAX_JSON = 256 * 2**20
# metrics.jsonl: about 2 KiB an iteration
MAX_LOG = 2 * 2**30


class Unsafe(OSError):
    """A file in a run directory the engine will not follow, open or read: the message names it and the fix."""


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):  # fmt: skip
        if test(mode):
            return name
    return "not a regular file"


def _size(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} bytes"


def _refuse(path: Path, what: str) -> Unsafe:
    return Unsafe(f"{path} is {what}, which the engine does not follow or read in a run directory: replace it with the "
                  "file the run wrote (restore the directory from a copy), or remove it")  # fmt: skip


def open_file(path: Path, flags: int, mode: int = 0o666) -> tuple[int, os.stat_result]:
    """`path` opened with `flags` plus no-follow, non-blocking and close-on-exec, and its stat; Unsafe (the
    descriptor closed) unless it is a regular file."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise _refuse(path, "a symbolic link") from None
        if e.errno == errno.ENXIO:  # a socket
            raise _refuse(path, "a socket") from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise _refuse(path, _kind(st.st_mode))
    return fd, st


def open_regular(path: str | Path, limit: int | None = None) -> int:
    """A read-only descriptor of `path`, refused (Unsafe) unless it is a regular file, not a link, at most
    `limit` bytes. Opening never blocks (a FIFO is refused, not waited on)."""
    path = Path(path)
    fd, st = open_file(path, os.O_RDONLY)
    if limit is not None and st.st_size > limit:
        os.close(fd)
        raise Unsafe(f"{path} holds {_size(st.st_size)}, more than such a file can ({_size(limit)}): it was not "
                     "written by the engine; restore the directory from a copy")  # fmt: skip
    return fd


def read_regular(path: str | Path, limit: int = MAX_JSON) -> bytes:
    """The bytes of regular file `path` (see open_regular), never more than `limit`."""
    fd = open_regular(path, limit)
    with os.fdopen(fd, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:  # grew while read
        raise Unsafe(f"{path} holds more than such a file can ({_size(limit)}): restore the directory from a copy")
    return data


def is_regular(path: str | Path) -> bool:
    """True when `path` is a regular file itself (a link to one is not)."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def default_mode() -> int:
    """The mode `open()` gives a new file under the process's umask (0o644 under the usual 022): what a
    file written through a temporary file (mkstemp's 0o600) is given, so every file of a run directory
    is as readable as the rest."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)  # elsewhere: read by setting it (and back at once)
    os.umask(mask)
    return 0o666 & ~mask


def _mode_for(path: Path) -> int:
    """A replaced regular file keeps its permissions; a new file (or one that was a link) gets the default."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return default_mode()
    return stat.S_IMODE(st.st_mode) if stat.S_ISREG(st.st_mode) else default_mode()


def _temp_beside(path: Path, suffix: str = "") -> tuple[int, Path]:
    """A new file beside `path` under an unpredictable name (O_CREAT | O_EXCL | O_NOFOLLOW: never an existing
    file or link)."""
    fd, name = tempfile.mkstemp(prefix=f".tmp_{path.name}.", suffix=suffix, dir=path.parent)
    return fd, Path(name)


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (new names, renames) durable; file systems that cannot are let be."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF, errno.EACCES):
            raise
    finally:
        os.close(fd)


def write_atomic(path: str | Path, data: str | bytes) -> Path:
    """Replace `path` whole: written beside it under a new temporary name, fsynced, renamed over it (a link
    there is replaced, never written through), the directory fsynced. A crash or a full disk mid-write
    leaves the old file as it was; a replaced file keeps its permissions."""
    path = Path(path)
    mode = _mode_for(path)
    fd, tmp = _temp_beside(path)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return path


@contextlib.contextmanager
def replacing(path: str | Path) -> Iterator[Path]:
    """For writers that take a file name (PIL, matplotlib): yields a new temporary path beside `path` with the
    same suffix (the format follows it), then renames it over `path` as write_atomic does."""
    path = Path(path)
    mode = _mode_for(path)
    fd, tmp = _temp_beside(path, suffix=path.suffix)
    os.close(fd)
    try:
        yield tmp
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_new(path: str | Path, data: bytes) -> None:
    """Create `path` (which must not exist: O_EXCL | O_NOFOLLOW) with `data`, fsynced: files of a directory
    this process has just made."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, default_mode())
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def open_append(path: str | Path) -> int:
    """A descriptor appending to regular file `path` (created when missing), refused when it is a link or
    anything but a regular file."""
    return open_file(Path(path), os.O_WRONLY | os.O_APPEND | os.O_CREAT, default_mode())[0]


def fresh_dir(path: str | Path) -> Path:
    """An empty directory at `path` for a write in progress: whatever was there (a directory a crash left,
    a file, a link, which is removed, not followed) goes first."""
    path = Path(path)
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISDIR(os.lstat(path).st_mode):
            shutil.rmtree(path)
        else:
            path.unlink()
    path.mkdir(parents=True)
    return path


def finite_json(obj: object) -> object:
    """`obj` with every NaN or infinite float as None, so the JSON written is JSON (json.dumps writes NaN
    and Infinity, which strict readers reject)."""
    if isinstance(obj, float):
        return obj if obj == obj and abs(obj) != float("inf") else None
    if isinstance(obj, dict):
        return {k: finite_json(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [finite_json(v) for v in obj]
    return obj


def json_text(obj: object, indent: int | None = 2) -> str:
    """Strict JSON of `obj` (non-finite numbers as null: see finite_json)."""
    import json

    return json.dumps(finite_json(obj), indent=indent, allow_nan=False)
