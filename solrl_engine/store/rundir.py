"""Run directories nobody can lose: one writer at a time, a start that validates before it moves
anything, appended logs cut back to the checkpoint a run resumes from, and stops by signal that say
how to go on. docs/checkpoints.md ("Starting, stopping and resuming") describes it for users.

- One writer: a run holds an exclusive `flock` on OUT/.solrl.lock from before its checks until it
  ends (under torchrun, rank 0 holds it for the whole job: the other ranks never write OUT). The
  file records who holds it (pid, host, start, command), so a second start fails at once naming
  that process. The kernel drops a flock when its holder dies, however it dies, so the lock of a
  killed run is free: the next start takes it over and names the run that left it. The lock file
  is removed when its run ends (the inode is checked after locking, so a start racing with that
  removal never holds a lock on a file that is gone).
  The lock file must be a regular file: a planted link or FIFO is refused before anything is written.
- Validate, then move: `check_start` only reads (an existing run, a checkpoint to resume, room on
  the disk, and that OUT is a run of ours: its MARKER, or for older runs a checkpoint); the trainer
  loads the model, reward and prompts; only then does --overwrite move the old run's files into
  OUT/replaced-<time>/ (renames: nothing is deleted, nothing copied).
- Logs: `read_log` keeps the metrics.jsonl records up to the resumed iteration and drops later ones
  and a torn last line; a bad line with records after it is corruption, and the file as it was is
  kept beside it (CORRUPT_LOG); the trainer rewrites the file atomically.
- Signals: SIGINT, SIGTERM and SIGHUP stop a run after its iteration with a checkpoint; the CLI
  exits with 128 + the signal's number (EXIT_CODES), as a shell reports a process it killed.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import shutil
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from solrl_engine.store.checkpoint import (
    BEST_DIRS,
    EXPORTS,
    LEGACY,
    LEGACY_DONE,
    MANIFEST,
    MIN_FREE_BYTES,
    RUN_DIRS,
    RUN_FILES,
    CheckpointError,
    checkpoints,
    pick,
    verify,
)
from solrl_engine.store.safe import MAX_LOG, Unsafe, fsync_dir, is_regular, open_file, read_regular, write_atomic

log = logging.getLogger("solrl_engine.rl")

LOCK = ".solrl.lock"
REPLACED = "replaced-"
MARKER = ".solrl-run"  # written at a run's start: what --overwrite and --auto-resume recognise as a run of ours
CORRUPT_LOG = "{name}.corrupt-{time}"  # a log with a corrupt line, kept as it was before the resume rewrote it
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
EXIT_CODES = {int(s): 128 + int(s) for s in STOP_SIGNALS}  # 130, 143, 129


class RunDirBusy(FileExistsError):
    """Another process holds the run directory's lock; the message names it."""


class NothingToResume(CheckpointError):
    """--resume where there is no checkpoint; nothing was changed."""


class Stopped(BaseException):  # noqa: N818 - like KeyboardInterrupt: not an error, a request to stop
    """A stop signal that ends the process where it is: during start-up (iteration None), or a second
    SIGINT during the run (the iteration in progress is lost; the last checkpoint stays)."""

    def __init__(self, signum: int, iteration: int | None = None) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum, self.iteration = signum, iteration


def start_mode(resume: bool = False, overwrite: bool = False, auto_resume: bool = False) -> str:
    """The start the CLI's flags ask for: "new", "resume", "overwrite" or "auto"; more than one is refused."""
    given = [f for f, on in (("--resume", resume), ("--overwrite", overwrite), ("--auto-resume", auto_resume)) if on]
    if len(given) > 1:
        raise ValueError(
            f"{' and '.join(given)} contradict each other: --resume continues the run in the output directory, "
            "--overwrite starts a new one there (moving the old one aside), --auto-resume resumes when there is a "
            "checkpoint and starts otherwise; pass one"
        )
    return {"--resume": "resume", "--overwrite": "overwrite", "--auto-resume": "auto"}[given[0]] if given else "new"


# --- the lock ---------------------------------------------------------------------------------------------


def _holder(text: str) -> str:
    """Who holds (or held) a lock, from its file: "pid 123 on host, started ..., `solrl train ...`"."""
    try:
        h = json.loads(text)
        return f"pid {h['pid']} on {h['host']}, started {h['started']} (`{h['command']}`)"
    except (ValueError, KeyError, TypeError):
        return "a process that has not written its pid yet (it is starting)"


class RunLock:
    """The exclusive lock of one run directory (see the module docstring); `hold` is the way to take it."""

    def __init__(self, out: str | Path) -> None:
        self.out = Path(out)
        self.path = self.out / LOCK
        self.fd: int | None = None
        self.created: list[Path] = []  # directories this lock made: removed again if the run leaves them empty

    def acquire(self) -> RunLock:
        try:
            missing = [p for p in (self.out, *self.out.parents) if not p.exists()]
            self.out.mkdir(parents=True, exist_ok=True)
            self.created = missing
            while True:
                fd = self._open()
                if not self._lock(fd):
                    holder = _holder(os.pread(fd, 4096, 0).decode(errors="replace"))
                    os.close(fd)
                    raise RunDirBusy(
                        f"{self.out} is in use by another run: {holder}. Nothing was changed. Wait for it to end, "
                        "stop it (SIGTERM stops it after its iteration, with a checkpoint), or choose another --output"
                    )
                try:
                    if os.fstat(fd).st_ino == os.stat(self.path).st_ino:
                        break
                except FileNotFoundError:
                    pass
                os.close(fd)  # its run ended and removed the file between our open and our lock: open it anew
        except (RunDirBusy, Unsafe):
            self._remove_created()
            raise
        except OSError as e:
            self._remove_created()
            raise PermissionError(f"cannot write to the output directory {self.out}: {e}; choose a writable "
                                  "--output") from None  # fmt: skip
        self.fd = fd
        left = os.pread(fd, 4096, 0).decode(errors="replace")
        if left.strip():
            log.warning("%s: taking over the lock left by %s: that process is gone (a lock dies with its holder)",
                        self.out, _holder(left))  # fmt: skip
        argv = ["solrl" if a.endswith(("cli.py", "/solrl")) else a for a in sys.argv]
        me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
              "command": " ".join(argv)[:400]}  # fmt: skip
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
        return self

    def _open(self) -> int:
        """The lock file, opened without following a link or blocking on a FIFO, and only if it is a regular
        file: a planted .solrl.lock is refused before anything is written through it."""
        try:
            return open_file(self.path, os.O_RDWR | os.O_CREAT, 0o644)[0]
        except Unsafe:
            raise Unsafe(f"{self.path} is not a regular file (a symbolic link, a FIFO or a device): nothing was "
                         "written through it. Remove it (no run of ours leaves one) and start again") from None

    def _lock(self, fd: int) -> bool:
        """True once `fd` holds the lock, False when another process holds it. A file system that has no
        locks is warned about and run on unlocked."""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        except OSError as e:
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL):
                os.close(fd)
                raise
            log.warning("%s: its file system refuses locks (%s): running without the one-writer lock; make sure "
                        "no other run uses this directory", self.out, e.strerror)  # fmt: skip
        return True

    def release(self) -> None:
        """Remove the lock file while still holding it, then let go; directories this lock created and
        the run left empty (a start that failed) go too."""
        if self.fd is None:
            return
        try:
            if os.fstat(self.fd).st_ino == os.stat(self.path).st_ino:
                self.path.unlink()
        except FileNotFoundError:
            pass
        os.close(self.fd)
        self.fd = None
        self._remove_created()

    def _remove_created(self) -> None:
        for d in self.created:  # deepest first
            with contextlib.suppress(OSError):
                d.rmdir()


_held: dict[str, RunLock] = {}


@contextlib.contextmanager
def hold(out: str | Path) -> Iterator[RunLock]:
    """Hold OUT's lock for the `with` block; RunDirBusy at once when another process holds it. Nested
    holds of one directory in one process share the outer one (the CLI takes it before the trainer)."""
    key = os.path.realpath(out)
    if key in _held:
        yield _held[key]
        return
    lock = RunLock(out).acquire()
    _held[key] = lock
    try:
        yield lock
    finally:
        del _held[key]
        lock.release()


# --- validate the start, then move the old run aside ---------------------------------------------------


def run_entries(out: Path) -> list[str]:
    """The names in OUT that belong to a run (what --overwrite moves aside), sorted."""
    if not out.is_dir():
        return []
    named = [n for n in (*RUN_FILES, *RUN_DIRS) if (out / n).exists()]
    patterns = ("eval_*.png", ".tmp_*", ".old_*", "*.tmp.png", "*.tmp", "*.corrupt-*", MARKER)
    leftovers = [p.name for pat in patterns for p in out.glob(pat)]
    return sorted(set(named + leftovers))


def mark(out: str | Path) -> None:
    """Mark OUT as a run of this engine (kept through resumes; --overwrite moves it aside with the rest)."""
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    write_atomic(Path(out) / MARKER, json.dumps({"engine": "solrl-engine", "marked": stamp}))


def is_run(out: str | Path) -> bool:
    """True when OUT is a run of ours: its marker, or (runs made before the marker) a sealed or old-format
    checkpoint under checkpoints/."""
    out = Path(out)
    if is_regular(out / MARKER):
        return True
    return any(is_regular(p / MANIFEST) or (is_regular(p / LEGACY) and is_regular(p / LEGACY_DONE))
               for p in checkpoints(out / "checkpoints"))  # fmt: skip


def looks_like(out: Path) -> str:
    """What a directory that is not a run of ours looks like, for the refusal."""
    names = sorted(p.name for p in out.iterdir())
    if "model_index.json" in names:
        return "a diffusers pipeline: it holds model_index.json"
    if "config.json" in names and any(n.endswith((".safetensors", ".bin")) for n in names):
        return "a model directory: it holds config.json and weights"
    shown = ", ".join(names[:4]) + ("..." if len(names) > 4 else "")
    return f"it holds {shown} but no {MARKER} and no checkpoint of a run (a run of an earlier version that never " \
           "checkpointed: move its files aside yourself)"


def check_start(out: str | Path, mode: str) -> str:
    """Read-only checks before a start: "new" where OUT holds a run is refused (FileExistsError),
    "resume" without a verified checkpoint too (NothingToResume), every checkpoint damaged is a
    CheckpointError, and a disk nearly full an OSError. Returns what the start will do: "new",
    "resume" or "overwrite" ("auto" resolved). Nothing in OUT is changed."""
    out = Path(out)
    ckpts = out / "checkpoints"
    existing = [n for n in run_entries(out) if not n.startswith(".")]
    if existing and mode != "resume" and not is_run(out):  # never move what the engine did not write
        raise FileExistsError(
            f"{out} is not a run directory of solrl-engine ({looks_like(out)}); nothing was moved or written. "
            "Choose another --output: a new or empty directory, or a run's own"
        )
    if mode == "auto":
        mode = "resume" if pick(ckpts, warn=False) is not None else ("overwrite" if existing else "new")
    if mode == "resume":
        lock = _held.get(os.path.realpath(out))
        made = not out.is_dir() or (lock is not None and out in lock.created)  # by this start's lock: it was not there
        if made or not [p for p in out.iterdir() if p.name != LOCK]:
            raise NothingToResume(f"--resume: {out} {'does not exist' if made else 'is empty'}: nothing to resume (a "
                                  "misspelled --output?); to start a new run there leave out --resume")  # fmt: skip
        if pick(ckpts, warn=False) is None:
            why = "checkpoints/ is missing" if not ckpts.is_dir() else "checkpoints/ holds none"
            raise NothingToResume(
                f"--resume: {out} holds no checkpoint to resume from ({why}); nothing was changed. To start this run "
                f"over there pass --overwrite instead (the old files move to {out}/{REPLACED}<time>/), or choose "
                "another --output"
            )
    if mode == "new" and existing:
        raise FileExistsError(
            f"{out} already holds a run ({', '.join(existing[:4])}{'...' if len(existing) > 4 else ''}): pass "
            "--resume to continue it, --overwrite to start over in it (the old run is moved aside), or choose another "
            "--output"
        )
    where = next(p for p in (out, *out.parents) if p.exists())
    free = shutil.disk_usage(where).free
    if free < MIN_FREE_BYTES:
        aside = [p.name for p in out.glob(f"{REPLACED}*")] if out.is_dir() else []
        hint = f" (older runs moved aside there: {', '.join(aside)})" if aside else ""
        raise OSError(f"only {free / 2**20:.0f} MiB free on the disk of {out}: checkpoints need room; free space"
                      f"{hint} or choose another --output (the run has not started)")  # fmt: skip
    return mode


def check_room(out: str | Path, need: int) -> None:
    """Before the first write: room on OUT's disk for the run's checkpoints (`need` bytes: one being written
    beside the last), else OSError naming both sizes."""
    out = Path(out)
    where = next(p for p in (out, *out.parents) if p.exists())
    free = shutil.disk_usage(where).free
    if free < need:
        raise OSError(f"only {free / 2**20:.0f} MiB free on the disk of {out}, and this run's checkpoints need about "
                      f"{need / 2**20:.0f} MiB (one written beside the last): free space or choose another --output "
                      "(nothing was written)")  # fmt: skip


def move_aside(out: str | Path) -> Path | None:
    """Move the old run's files into OUT/replaced-<time>/, one rename each (nothing is deleted or copied;
    a crash midway leaves every file in one place or the other). Returns that directory, None when there
    was nothing to move."""
    out = Path(out)
    names = run_entries(out)
    if not names:
        return None
    dest = out / f"{REPLACED}{time.strftime('%Y%m%d-%H%M%S')}"
    n = 1
    while dest.exists():
        n += 1
        dest = dest.with_name(f"{dest.name.split('.')[0]}.{n}")
    dest.mkdir()
    for name in names:
        os.rename(out / name, dest / name)
    fsync_dir(dest)
    fsync_dir(out)
    size = sum(p.stat().st_size for p in dest.rglob("*") if p.is_file())
    log.warning("--overwrite: the previous run in %s was moved to %s (%.1f MiB; delete it to free the space)",
                out, dest, size / 2**20)  # fmt: skip
    return dest


def damaged_exports(out: str | Path) -> bool:
    """On resume: check OUT's exported adapters against their manifests, warning about each damaged one;
    True when lora/ or lora_ema/ must be written again (both are made from the checkpoint's state).
    A damaged lora_best/ cannot be remade (its evaluation is past): it is named, and left to restore."""
    again = False
    for d in EXPORTS:
        if (Path(out) / d).is_dir() and (v := verify(Path(out) / d, kind="export")).status == "damaged":
            fix = "restore it from a copy" if d in BEST_DIRS else "written again from the checkpoint"
            log.warning("%s is damaged (%s): %s", Path(out) / d, v.detail, fix)
            again |= d not in BEST_DIRS
    return again


# --- appended logs ----------------------------------------------------------------------------------------


def read_log(path: str | Path, iteration: int, keep_aside: bool = True) -> tuple[list[dict[str, Any]], str | None]:
    """The records of a JSON-lines log (each with an "iter") up to `iteration`, and what was dropped
    beyond them (None: nothing): records of later iterations, written after the checkpoint a run resumes
    from (they run again), and a last line that does not parse (a write cut short by a crash or a full
    disk). A line that does not parse with whole records after it is corruption, not a torn write: with
    `keep_aside` the file as it was is kept beside it (CORRUPT_LOG), so nothing is lost when it is rewritten."""
    path = Path(path)
    if not path.exists() and not path.is_symlink():
        return [], None
    data = read_regular(path, MAX_LOG)
    keep: list[dict[str, Any]] = []
    later, bad = 0, []
    lines = [(n, line) for n, line in enumerate(data.split(b"\n"), 1) if line.strip()]
    for n, line in lines:
        try:
            rec = json.loads(line)
            it = int(rec["iter"])
        except (ValueError, KeyError, TypeError):
            bad.append(n)
            continue
        if it <= iteration:
            keep.append(rec)
        else:
            later += 1
    torn = [n for n in bad if n == lines[-1][0]]  # only the last line can be a write cut short
    corrupt = [n for n in bad if n not in torn]
    why = []
    if later:
        why.append(f"{later} record(s) of iterations after {iteration}, written after the checkpoint (they run again)")
    if torn:
        why.append(f"a torn last line (line {torn[0]}: a write cut short by a crash or a full disk)")
    if corrupt:
        where = f"line {corrupt[0]}{f' and {len(corrupt) - 1} more' if len(corrupt) > 1 else ''}"
        kept = ""
        if keep_aside:
            aside = path.with_name(CORRUPT_LOG.format(name=path.name, time=time.strftime("%Y%m%d-%H%M%S")))
            write_atomic(aside, data)
            kept = f"; the file as it was is kept as {aside}"
        why.append(f"CORRUPT {where} (records follow it, so it is not a torn write: the file was altered or the "
                   f"disk is failing){kept}")  # fmt: skip
    if data and not data.endswith(b"\n") and not torn:
        why.append("a last line without its newline")
    return keep, "; ".join(why) or None


# --- stop signals -----------------------------------------------------------------------------------------


class StopSignals:
    """SIGINT, SIGTERM and SIGHUP (a closed terminal) ask the run to stop after its iteration, with a
    checkpoint; a second SIGINT stops it at once (Stopped). Installed for a `with` block, in the main
    thread only (elsewhere the caller's handlers stay), and put back after it."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.iteration = 0  # the last finished iteration, kept current by the trainer
        self._old: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        self.signum = None
        if threading.current_thread() is threading.main_thread():
            for s in STOP_SIGNALS:
                self._old[s] = signal.signal(s, self._on)
        return self

    def __exit__(self, *exc: object) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)
        self._old.clear()

    def _on(self, signum: int, _frame: object) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            raise Stopped(signum, self.iteration)
        self.signum = self.signum or signum
        log.warning("%s: stopping after this iteration with a checkpoint (Ctrl-C again: at once, losing the "
                    "iteration); `--resume` continues from there", signal.Signals(signum).name)  # fmt: skip

    def requested(self, dist: Any, device: torch.device) -> bool:
        """A signal on any rank stops every rank after the same iteration (a collective): each rank counts
        its signal, and a rank that got none takes the first one any rank got (in STOP_SIGNALS' order)."""
        mine = torch.tensor([float(self.signum == s) for s in STOP_SIGNALS], device=device)
        counts = dist.sum_(mine).tolist()
        if self.signum is None and any(counts):
            self.signum = int(next(s for s, n in zip(STOP_SIGNALS, counts, strict=True) if n))
        return any(counts)

    @property
    def name(self) -> str | None:
        return None if self.signum is None else signal.Signals(self.signum).name


@contextlib.contextmanager
def start_up_signals() -> Iterator[None]:
    """During start-up (model loading) SIGTERM and SIGHUP end the process as Ctrl-C does (Stopped, like
    KeyboardInterrupt), so the CLI can say in one line that nothing was changed, with the signal's code."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, _frame: object) -> None:
        raise Stopped(signum)

    old = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
