"""Checkpoints you can trust: no pickles, checksums, fsync, and a resume that verifies and falls back.

A checkpoint is a directory `iter_NNNNNN` of three files:

    tensors.safetensors   every tensor of the state (adapters, EMA, optimizer, generator states),
                          named by where it sits in the state: "adapters/ema/<layer>", "opt/state/0/exp_avg"
    state.json            everything else (iteration, counters, Random states, config, guard, evaluations),
                          with {"$tensor": name} where a tensor was
    MANIFEST.json         written last: each file's size and SHA-256 (it replaces the old COMPLETE marker)

It is written under `.tmp_iter_NNNNNN`, every file and the directory fsynced, renamed into place and
the parent fsynced: after a crash or a power loss a checkpoint is whole or absent. Loading reads
only JSON and safetensors, so no file in a run directory can make a resume execute code, and checks
every byte it reads against the manifest. `pick` gives the newest checkpoint that verifies, warning
about each damaged one it passes over; when checkpoints exist but none verifies it raises
CheckpointError before anything is written. Old checkpoints (`state.pt` + `COMPLETE`) are read with
`torch.load(weights_only=True)`; one holding more than tensors and plain values is refused with the
command that converts it (`python -m solrl_engine.store.checkpoint convert DIR`). The storage under it
(sealed directories, the tensors + JSON encoding) is solrl_engine.store.sealed; docs/checkpoints.md has
the layout, the guarantees and their measured cost.

The run directory around the checkpoints (its lock, what a start checks, --overwrite, logs cut back
on resume) is solrl_engine.store.rundir.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import pickle  # only to refuse: _DCPMetadataUnpickler unpickles nothing outside the DCP index's own types
import shutil
import sys
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from solrl_engine.store.safe import MAX_JSON, fresh_dir, is_regular, open_regular
from solrl_engine.store.sealed import (  # noqa: F401 - MANIFEST, encode, decode, FORMAT: part of this module's API
    DCP_METADATA,
    FORMAT,
    MANIFEST,
    Damaged,
    check_dir,
    commit,
    decode,
    encode,
    read_verified,
    seal,
    write_synced,
    write_tensors,
)

log = logging.getLogger("solrl_engine.rl")

TENSORS, STATE = "tensors.safetensors", "state.json"
LEGACY, LEGACY_DONE = "state.pt", "COMPLETE"  # checkpoints of earlier versions
CONVERT = "python -m solrl_engine.store.checkpoint convert"


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: damaged, unreadable, or an old pickle that is refused."""


class RefusedPickle(CheckpointError):
    """An old pickled checkpoint holding more than tensors and plain values: loading it could run code."""


# --- writing and reading checkpoints ----------------------------------------------------------------


def _number(p: Path) -> int | None:
    try:
        return int(p.name.removeprefix("iter_")) if p.name.startswith("iter_") and p.is_dir() else None
    except ValueError:
        return None


def checkpoints(root: str | Path) -> list[Path]:
    """Every checkpoint directory under `root`, complete or not, newest first."""
    root = Path(root)
    found = [(n, p) for p in root.glob("iter_*") if (n := _number(p)) is not None] if root.is_dir() else []
    return [p for _, p in sorted(found, reverse=True)]


def _complete(p: Path) -> bool:
    return (p / MANIFEST).exists() or (p / LEGACY_DONE).exists()


class DiskFull(OSError):
    """The disk filled while a checkpoint was written: the partial one is removed, the message says how much
    it needed; the last complete checkpoint stays."""


def write(final: Path, state: dict[str, Any], meta: dict[str, Any] | None = None, prepared: bool = False) -> Path:
    """Write `state` as a checkpoint directory at `final`, atomically and durably. `prepared`: its temporary
    directory already holds other files (save_sharded's shards), sealed with the rest. A full disk removes the
    partial directory and raises DiskFull naming what was needed."""
    tmp = final.with_name(f".tmp_{final.name}")
    tensors, tree = encode(state)
    try:
        return _write(final, tmp, tensors, tree, meta, prepared)
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        partial = sum(p.stat().st_size for p in tmp.iterdir() if p.is_file()) if tmp.is_dir() else 0
        shutil.rmtree(tmp, ignore_errors=True)
        need = max(sum(t.numel() * t.element_size() for t in tensors.values()) + 2**20, partial)  # (+ the JSON)
        free = shutil.disk_usage(final.parent).free
        full = DiskFull(f"the disk of {final.parent} is full ({e.strerror}) while writing checkpoint {final.name}: it "
                        f"needs about {need / 2**20:.0f} MiB, {free / 2**20:.0f} MiB are free; the partial checkpoint "
                        "was removed and the last complete one stays")  # fmt: skip
        full.errno = e.errno
        raise full from None


def _write(final: Path, tmp: Path, tensors: dict[str, torch.Tensor], tree: Any, meta: dict[str, Any] | None,
           prepared: bool) -> Path:  # fmt: skip
    if not prepared:
        fresh_dir(tmp)
    known = {
        STATE: write_synced(tmp / STATE, json.dumps(tree).encode()),
        TENSORS: write_tensors(tmp / TENSORS, tensors),
    }
    pause = float(os.environ.get("SOLRL_CHECKPOINT_PAUSE_S", "0") or 0)
    if pause > 0:  # a test hook: hold the writer mid-checkpoint so a kill can land there
        (tmp / "PAUSED").write_text("")
        time.sleep(pause)
        (tmp / "PAUSED").unlink()
    seal(tmp, {"kind": "checkpoint", **(meta or {})}, known)
    commit(tmp, final)
    return final


def save(root: str | Path, iteration: int, state: dict[str, Any], keep: int = 2, prepared: bool = False) -> Path:
    """Write checkpoint `iteration` under `root` and keep the newest `keep` complete ones (`prepared`: see write)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = write(root / f"iter_{iteration:06d}", state, {"iteration": iteration}, prepared)
    for stale in root.glob(".del_iter_*"):  # left by a crash while an old checkpoint was being deleted
        shutil.rmtree(stale, ignore_errors=True)
    for old in [p for p in checkpoints(root) if _complete(p)][keep:]:
        gone = old.with_name(f".del_{old.name}")  # out of sight in one rename, then deleted at leisure
        old.rename(gone)
        shutil.rmtree(gone, ignore_errors=True)
    return final


@contextlib.contextmanager
def _one_process_dcp(dist: Any) -> Iterator[None]:
    """torch.distributed.checkpoint in one process (no process group, on purpose): without its warning."""
    with warnings.catch_warnings():
        if dist.world == 1:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def save_sharded(root: str | Path, iteration: int, state: dict[str, Any], keep: int, dist: Any,
                 shards: dict[str, Any]) -> None:  # fmt: skip
    """A checkpoint whose large tensors every rank writes itself: `shards` (DTensors: each rank's part) go through
    torch.distributed.checkpoint into the checkpoint's temporary directory, then rank 0 writes `state` beside
    them and seals the whole directory, manifest over every file, as `save` does: the same trust (checksums,
    fsync, verify before resume, fall back). Every rank calls it; `state` matters on rank 0 only."""
    import torch.distributed.checkpoint as dcp

    root = Path(root)
    tmp = root / f".tmp_iter_{iteration:06d}"
    if dist.main:
        root.mkdir(parents=True, exist_ok=True)
        fresh_dir(tmp)
    dist.barrier()
    with _one_process_dcp(dist):
        dcp.save(shards, checkpoint_id=str(tmp), no_dist=dist.world == 1)
    dist.barrier()
    if dist.main:
        save(root, iteration, state, keep, prepared=True)
    dist.barrier()


def load_shards(path: str | Path, shards: dict[str, Any], dist: Any) -> None:
    """Fill `shards` (as `save_sharded` took them: each rank's part, loaded in place) from checkpoint `path`,
    resharded to this run's ranks. The index and the shard files are read without unpickling anything beyond
    their own types (`dcp_reader`, `dcp_planner`); `pick` has hashed every file before."""
    import torch.distributed.checkpoint as dcp

    with _one_process_dcp(dist):
        dcp.load(shards, storage_reader=dcp_reader(path), planner=dcp_planner(), no_dist=dist.world == 1)


# what torch.distributed.checkpoint's `.metadata` (a pickle) may name: its own metadata classes, tensor sizes,
# dtypes and layouts, and the path type; a file naming anything else is refused, never unpickled
_DCP_META = "torch.distributed.checkpoint.metadata"
_DCP_NAMES = {(_DCP_META, n) for n in ("Metadata", "TensorStorageMetadata", "ChunkStorageMetadata",
                                       "BytesStorageMetadata", "TensorProperties", "MetadataIndex", "StorageMeta",
                                       "_MEM_FORMAT_ENCODING")} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"), ("torch", "device"),
    ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath")}  # fmt: skip


class _DCPMetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        dtype = module == "torch" and "." not in name and isinstance(getattr(torch, name, None), torch.dtype)
        if (module, name) in _DCP_NAMES or dtype:  # exact names only (a dotted one would reach other modules)
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint index")


def dcp_planner() -> Any:
    """torch.distributed.checkpoint's load planner, with the non-tensor entries of the shard files (AdamW's
    param_groups: numbers, strings, lists) read by `torch.load(weights_only=True)`, not DCP's weights_only=False."""
    import io

    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint._traverse import set_element  # (where DefaultLoadPlanner puts an entry)

    class Planner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            obj = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return Planner()


class IndexRefused(ValueError):
    """A DCP index that names something other than its own types and its checkpoint's shard files."""


def read_dcp_index(path: Path, name: str = DCP_METADATA) -> Any:
    """Checkpoint `path`'s DCP index, unpickling only the index's own types, its storage entries checked to
    name plain files of the checkpoint (a `relative_path` that climbs out is refused, never opened)."""
    try:
        with os.fdopen(open_regular(path / name, MAX_JSON), "rb") as f:
            meta = _DCPMetadataUnpickler(f).load()
        for info in (getattr(meta, "storage_data", None) or {}).values():
            rel = getattr(info, "relative_path", None)
            if not isinstance(rel, str) or Path(rel).name != rel or rel.startswith(".") or not is_regular(path / rel):
                raise IndexRefused(f"it names {rel!r}, not a shard file of the checkpoint")
    except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, OSError, ValueError, TypeError) as e:
        raise IndexRefused(str(e)) from None
    return meta


def dcp_reader(path: str | Path) -> Any:
    """A torch.distributed.checkpoint reader of checkpoint `path` that keeps the promise above: DCP reads its
    `.metadata` with a plain `pickle.load`, which could run code; this one unpickles only the index's own types
    (exact names) and raises CheckpointError on anything else. With `dcp_planner` nothing in the shard files is
    unpickled beyond weights_only either."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class Reader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            rank = kwargs.get("rank")
            name = DCP_METADATA if rank is None else f"__{rank}{DCP_METADATA}"
            try:
                meta = read_dcp_index(Path(self.path), name)
            except IndexRefused as e:
                raise CheckpointError(f"checkpoint {path}: {name} is refused ({e}); restore the run directory from "
                                      "a copy, or start over with --overwrite") from None  # fmt: skip
            if getattr(meta, "storage_meta", None) is None:
                meta.storage_meta = StorageMeta()
            meta.storage_meta.load_id = self.load_id  # as DCP's own reader marks it
            return meta

    return Reader(str(path))


def latest(root: str | Path) -> Path | None:
    """The newest complete checkpoint directory under `root` (not verified: see `pick`), or None."""
    return next((p for p in checkpoints(root) if _complete(p)), None)


@dataclass
class Verdict:
    """What `verify` found: status "ok", "damaged", "old" (a pickle without checksums that loads with
    weights_only), "refused" (an old pickle holding more than that) or "unverifiable" (no manifest)."""

    path: Path
    status: str
    detail: str

    @property
    def usable(self) -> bool:
        return self.status in ("ok", "old")


def _legacy_problem(e: Exception, path: Path) -> RefusedPickle:
    """An old pickle that torch.load(weights_only=True) rejects: refused with how to convert it."""
    target = path.parent if path.name == LEGACY else path
    return RefusedPickle(
        f"{path} is an old-format checkpoint (a pickle) holding more than tensors and plain values, so "
        f"loading it could run code from the file: refused ({str(e).splitlines()[0][:200]}). If you trust "
        f"everyone who could write to it, convert it once with `{CONVERT} {target}` (this unpickles it) and "
        "resume again; otherwise delete it to resume from an older checkpoint"
    )


def load_legacy(file: Path, mmap: bool = False) -> dict[str, Any]:
    """An earlier version's pickled checkpoint, read with weights_only=True (no code runs)."""
    import pickle

    try:
        return torch.load(file, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        raise _legacy_problem(e, file) from None
    except Exception as e:  # a torn or altered zip surfaces as whatever the reader hits first
        raise CheckpointError(f"{file.name} is unreadable ({type(e).__name__}: {str(e)[:200]})") from None


def load(path: str | Path) -> dict[str, Any]:
    """The state in checkpoint directory `path`; every byte checked against its manifest first."""
    path = Path(path)
    if not (path / MANIFEST).exists() and (path / LEGACY).exists():
        return load_legacy(path / LEGACY)
    from safetensors.torch import load as st_load

    try:
        # (a sharded run's shard files are read by each rank through DCP, after `pick` hashed them all in chunks)
        _, blobs = read_verified(path, (STATE, TENSORS))
        return decode(json.loads(blobs[STATE]), st_load(blobs[TENSORS]))
    except Damaged as e:
        raise CheckpointError(f"checkpoint {path} is damaged: {e}") from None
    except (KeyError, ValueError) as e:  # verified bytes that still do not parse: written by something else
        raise CheckpointError(f"checkpoint {path} does not parse ({type(e).__name__}: {e})") from None


# Verdicts by directory, with the (name, size, mtime, inode) of its files when checked: a resume checks
# the same checkpoint before anything is written and again when it picks one; unchanged files are
# not hashed twice. `load` always checks the bytes it reads.
_checked: dict[str, tuple[tuple, Verdict]] = {}


def _signature(path: Path) -> tuple:
    try:
        stats = [(p.name, p.stat()) for p in path.iterdir()]
    except OSError:
        return ()
    return tuple(sorted((name, st.st_size, st.st_mtime_ns, st.st_ino) for name, st in stats))


def verify(path: str | Path, kind: str = "checkpoint") -> Verdict:
    """Check a checkpoint or an exported adapter directory against its manifest (hashes every byte)."""
    path = Path(path)
    key, sig = str(path.resolve()), _signature(path)
    if key in _checked and _checked[key][0] == sig and sig:
        return _checked[key][1]
    if path.is_symlink():
        v = Verdict(path, "damaged", "a symbolic link, not a checkpoint the run wrote (never followed)")
    elif (path / MANIFEST).exists():
        ok, detail = check_dir(path)
        if ok and (path / DCP_METADATA).exists():  # a sharded checkpoint: its index must name its own files
            try:
                read_dcp_index(path)
            except IndexRefused as e:
                ok, detail = False, f"{DCP_METADATA} is refused ({e})"
        v = Verdict(path, "ok" if ok else "damaged", detail)
    elif kind == "checkpoint" and (path / LEGACY).exists() and (path / LEGACY_DONE).exists():
        v = _verify_legacy(path / LEGACY, path)
    elif kind == "checkpoint":
        v = Verdict(path, "damaged", f"{MANIFEST} is missing (a checkpoint gets its name only once complete)")
    else:
        v = Verdict(path, "unverifiable", f"no {MANIFEST}: written by an earlier version")
    _checked[key] = (sig, v)
    return v


def _verify_legacy(file: Path, shown: Path) -> Verdict:
    try:
        load_legacy(file, mmap=True)  # mapped, not read: the pickle is checked, the tensor bytes are not
    except CheckpointError as e:
        return Verdict(shown, "refused" if isinstance(e, RefusedPickle) else "damaged", str(e))
    return Verdict(shown, "old", f"old format ({LEGACY}, a pickle): no checksums to verify; loads with weights_only")


def pick(root: str | Path, warn: bool = True) -> Path | None:
    """The newest checkpoint under `root` that verifies, warning about each damaged one newer than it;
    None when there is none at all. CheckpointError when checkpoints exist but none can be used, or
    the newest usable one is an old pickle that is refused (nothing is written either way)."""
    bad: list[Verdict] = []
    for p in checkpoints(root):
        v = verify(p)
        if v.status == "refused":
            raise CheckpointError(v.detail)
        if v.usable:
            if bad and warn:
                log.warning("falling back to %s, the newest checkpoint that verifies", p)
            return p
        bad.append(v)
        if warn:
            log.warning("checkpoint %s is damaged and skipped: %s", p, v.detail)
    if not bad:
        return None
    lines = "\n".join(f"  {v.path.name}: {v.detail}" for v in bad)
    raise CheckpointError(
        f"no checkpoint in {root} verifies, so there is nothing safe to resume from:\n{lines}\n"
        "Nothing was changed. Restore the directory from a copy (then `solrl verify` it), or start over "
        "with --overwrite instead of --resume"
    )


def resume_point(root: str | Path, dist: Any = None) -> Path | None:
    """`pick` on rank 0, the same choice on every rank (rank 0 decides and broadcasts, so ranks never
    resume from different checkpoints); every rank raises the same CheckpointError when none verifies."""
    if dist is None or dist.world == 1:
        return pick(root)
    choice: tuple[str | None, str | None] = (None, None)
    if dist.main:
        try:
            p = pick(root)
            choice = (None if p is None else str(p), None)
        except CheckpointError as e:
            choice = (None, str(e))
    path, err = dist.broadcast_object(choice)  # type: ignore[misc]
    if err is not None:
        raise CheckpointError(err)
    return None if path is None else Path(path)


# --- a run directory ---------------------------------------------------------------------------------

RUN_FILES = ("metrics.jsonl", "config.json", "summary.json", "reward.png", "quantization.txt", "compare.png")
# the EMA adapter of the best held-out evaluation, and the file inside it that says which one that was
BEST_LORA, BEST_INFO = "lora_best", "solrl_best.json"
# what a run exports, by train_mode: the trained weights, their EMA and the best evaluation's EMA (LoRA adapters,
# or whole transformers from full fine-tuning)
EXPORT_DIRS = {"lora": ("lora", "lora_ema", BEST_LORA), "full": ("transformer", "transformer_ema", "transformer_best")}
BEST_DIRS = {dirs[2] for dirs in EXPORT_DIRS.values()}
EXPORTS = tuple(d for dirs in EXPORT_DIRS.values() for d in dirs)
RUN_DIRS = ("checkpoints", *EXPORTS, "tensorboard", "wandb")
MIN_FREE_BYTES = 64 * 2**20


def verify_run(out: str | Path) -> list[Verdict]:
    """Every checkpoint (newest first) and exported adapter of a run directory, checked; also a
    pre-training directory's checkpoints and its old `checkpoint.pt`."""
    out = Path(out)
    found = [verify(p) for p in checkpoints(out / "checkpoints")]
    found += [verify(out / d, kind="export") for d in EXPORTS if (out / d).is_dir()]
    if (out / "checkpoint.pt").is_file():
        found.append(_verify_legacy(out / "checkpoint.pt", out / "checkpoint.pt"))
    return found


# --- converting an old checkpoint ----------------------------------------------------------------------


def convert_legacy(path: str | Path) -> Path:
    """Rewrite an old pickled checkpoint (a trainer's `iter_N/` or pre-training's `checkpoint.pt`) in
    this format. This UNPICKLES it, so it may run code the file holds: only for files you trust."""
    path = Path(path)
    file = path / LEGACY if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"{file}: no old-format checkpoint there (a directory with {LEGACY}, or checkpoint.pt)")
    state = torch.load(file, map_location="cpu", weights_only=False)
    if path.is_dir():
        return write(path, state, {"iteration": state.get("iteration"), "converted_from": LEGACY})
    return save(path.parent / "checkpoints", int(state["step"]), state)


def _main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] != "convert":
        print(f"usage: {CONVERT} CHECKPOINT  (an old iter_NNNNNN/ directory or a pre-training checkpoint.pt)")
        return 2
    print(f"converted: {convert_legacy(argv[1])}")
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
