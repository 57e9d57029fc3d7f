"""Sealed directories and a state without pickle: the storage layer under checkpoints and exports.

A sealed directory holds its files and a MANIFEST.json written last (each file's size and SHA-256);
every file and the directory are fsynced before it is renamed into place, and the parent after, so
it is whole or absent after a crash or a power loss, and `check_dir` can tell a damaged copy (a
missing, truncated or altered file) from a good one. `encode` splits a state into named tensors
(for safetensors) and a JSON tree, `decode` puts it back: loading never unpickles anything.
solrl_engine.store.checkpoint builds checkpoints on it, solrl_engine.rl.export the LoRA directories;
docs/checkpoints.md describes both.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from solrl_engine.store.safe import MAX_JSON, Unsafe, fsync_dir, is_regular, open_regular, read_regular, write_new

MANIFEST = "MANIFEST.json"
NOT_REGULAR = "{} is not a regular file (a link, a FIFO or a device: never read)"
FORMAT = 2


class Damaged(ValueError):
    """A sealed directory whose manifest or files do not match: the message says which and how."""


def encode(state: Any) -> tuple[dict[str, torch.Tensor], Any]:
    """Split `state` into named tensors and a JSON-ready tree with {"$tensor": name} in their place.

    Tuples and dicts with keys other than plain strings (an optimizer's integer parameter ids) are
    tagged ({"$tuple": [...]}, {"$items": [[key, value], ...]}) so `decode` gives back the same types:
    Random.setstate needs its tuples. Anything else (an arbitrary object) is refused: it would need pickle."""
    tensors: dict[str, torch.Tensor] = {}
    storages: set[int] = set()

    def enc(x: Any, path: tuple[str, ...]) -> Any:
        if isinstance(x, torch.Tensor):
            name = "/".join(path) or "tensor"
            while name in tensors:  # path parts holding "/" could meet; names only need to be unique
                name += "+"
            t = x.detach().cpu().contiguous()
            ptr = t.untyped_storage().data_ptr()
            if t.numel() and ptr in storages:  # safetensors stores no shared memory: tied weights are copied
                t = t.clone()
            storages.add(t.untyped_storage().data_ptr())
            tensors[name] = t
            return {"$tensor": name}
        if x is None or isinstance(x, bool | int | float | str):
            return x
        if isinstance(x, tuple):
            return {"$tuple": [enc(v, (*path, str(i))) for i, v in enumerate(x)]}
        if isinstance(x, list):
            return [enc(v, (*path, str(i))) for i, v in enumerate(x)]
        if isinstance(x, dict):
            if all(isinstance(k, str) and not k.startswith("$") for k in x):
                return {k: enc(v, (*path, k)) for k, v in x.items()}
            return {"$items": [[enc(k, (*path, "key")), enc(v, (*path, str(k)))] for k, v in x.items()]}
        where = "/".join(path) or "the top level"
        raise TypeError(
            f"checkpoint state at {where} is a {type(x).__name__}, which only pickle could store: keep tensors, "
            "numbers, strings, None, lists, tuples and dicts in a checkpoint"
        )

    return tensors, enc(state, ())


def decode(tree: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """The inverse of `encode`."""
    if isinstance(tree, list):
        return [decode(v, tensors) for v in tree]
    if isinstance(tree, dict):
        if len(tree) == 1:
            ((k, v),) = tree.items()
            if k == "$tensor":
                return tensors[v]
            if k == "$tuple":
                return tuple(decode(x, tensors) for x in v)
            if k == "$items":
                return {_hashable(decode(a, tensors)): decode(b, tensors) for a, b in v}
        return {k: decode(v, tensors) for k, v in tree.items()}
    return tree


def _hashable(k: Any) -> Any:
    return tuple(_hashable(x) for x in k) if isinstance(k, list | tuple) else k


def write_synced(path: Path, data: bytes) -> dict[str, Any]:
    """Create `path` in a directory being written (never an existing file or link) with `data`, fsynced;
    returns its manifest entry."""
    write_new(path, data)
    return _entry(data)


def _entry(data: bytes) -> dict[str, Any]:
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _hash_file(path: Path) -> dict[str, Any]:
    h, size = hashlib.sha256(), 0
    with os.fdopen(open_regular(path), "rb") as f:
        while chunk := f.read(16 * 2**20):
            h.update(chunk)
            size += len(chunk)
    return {"size": size, "sha256": h.hexdigest()}


def seal(directory: Path, meta: dict[str, Any], known: dict[str, dict[str, Any]] | None = None) -> None:
    """Write `directory`'s manifest last: every other file's size and SHA-256 (from `known`, else read
    back), each file fsynced first, the directory after. Nothing has reached its final name yet."""
    known = known or {}
    files = {}
    for p in sorted(directory.iterdir()):
        if p.name == MANIFEST or not is_regular(p):
            continue
        if p.name in known:
            files[p.name] = known[p.name]
        else:
            files[p.name] = _hash_file(p)
            with os.fdopen(open_regular(p), "rb") as f:
                os.fsync(f.fileno())
    body = {"format": FORMAT, **meta, "files": files}
    write_synced(directory / MANIFEST, json.dumps(body, indent=1).encode())
    fsync_dir(directory)


def commit(tmp: Path, final: Path) -> None:
    """Rename a sealed `tmp` to `final` (replacing what was there), then make the rename durable."""
    old = final.with_name(f".old_{final.name}")
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    fsync_dir(final.parent)
    shutil.rmtree(old, ignore_errors=True)


_ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
              torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}  # fmt: skip


def write_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Write `tensors` as a safetensors file, each tensor's bytes written and hashed where they lie:
    no serialized copy of the whole state in memory (an SD3.5-Large adapter state is ~0.9 GB).
    Returns its manifest entry; the file is fsynced."""
    if sys.byteorder != "little" or any(t.dtype not in _ST_DTYPES for t in tensors.values()):
        from safetensors.torch import save as st_save

        return write_synced(path, st_save(tensors))
    header, offset = {}, 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        header[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the format pads its header to 8 bytes with spaces
    h, size = hashlib.sha256(), 0
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    with os.fdopen(fd, "wb") as f:
        for i, chunk in enumerate([len(head).to_bytes(8, "little"), head, *tensors.values()]):
            if i > 1:
                chunk = chunk.reshape(-1).view(torch.uint8).numpy()  # type: ignore[union-attr]
            f.write(chunk)
            h.update(chunk)
            size += len(chunk)
        f.flush()
        os.fsync(f.fileno())
    return {"size": size, "sha256": h.hexdigest()}


def _check(name: str, size: int | None, sha256: Callable[[], str], want: dict[str, Any]) -> str | None:
    """What is wrong with file `name` of `size` bytes (None: missing) against its manifest entry."""
    if size is None:
        return f"{name} is missing"
    if size != want["size"]:
        how = "truncated" if size < want["size"] else "longer than written"
        return f"{name} has {size} bytes, the manifest says {want['size']} ({how})"
    if sha256() != want["sha256"]:
        return f"{name}'s SHA-256 differs from the manifest's (its bytes were altered: bit rot or a bad copy)"
    return None


# the one dot-file a sealed directory may hold: torch.distributed.checkpoint's index of its shard files (a sharded
# run's checkpoint, store/checkpoint.py save_sharded)
DCP_METADATA = ".metadata"


def _manifest(path: Path) -> dict[str, Any]:
    """The manifest of sealed directory `path`, its shape checked: Damaged naming what is wrong."""
    try:
        m = json.loads(read_regular(path / MANIFEST, MAX_JSON))
        files = m.get("files") if isinstance(m, dict) else None
        if not isinstance(files, dict) or any(Path(n).name != n or n in (".", "..") or
                                              (n.startswith(".") and n != DCP_METADATA) for n in files):  # fmt: skip
            raise ValueError("no list of plain file names")
        for n, e in files.items():
            if not (isinstance(e, dict) and type(e.get("size")) is int and e["size"] >= 0
                    and isinstance(e.get("sha256"), str)):  # fmt: skip
                raise ValueError(f"the entry of {n} is not a size and a SHA-256")
        return m
    except FileNotFoundError:
        raise Damaged(f"{MANIFEST} is missing") from None
    except (OSError, ValueError, AttributeError) as e:
        raise Damaged(f"{MANIFEST} is unreadable ({e})") from None


def _read_file(path: Path, want: dict[str, Any]) -> tuple[bytes | None, str | None]:
    """(bytes, None), or (None, what is wrong) for one listed file: missing, not a regular file, or longer
    than the manifest says (read no further than that)."""
    try:
        return read_regular(path, want["size"]), None
    except FileNotFoundError:
        return None, f"{path.name} is missing"
    except Unsafe:
        if is_regular(path):
            return None, f"{path.name} is longer than the manifest's {want['size']} bytes"
        return None, NOT_REGULAR.format(path.name)


def read_verified(path: Path, names: tuple[str, ...] | None = None) -> tuple[dict[str, Any], dict[str, bytes]]:
    """The manifest and every file it lists (or only `names`), read and checked: Damaged naming what differs."""
    m = _manifest(path)
    blobs, problems = {}, []
    for name, want in m["files"].items():
        if names is not None and name not in names:
            continue
        data, wrong = _read_file(path / name, want)
        if wrong is None and (p := _check(name, len(data), lambda d=data: hashlib.sha256(d).hexdigest(), want)):
            wrong = p
        if wrong is not None:
            problems.append(wrong)
        else:
            blobs[name] = data
    if problems:
        raise Damaged("; ".join(problems))
    return m, blobs


def check_dir(path: Path) -> tuple[bool, str]:
    """(True, what was checked) when every file of sealed directory `path` matches its manifest, else
    (False, which files differ and how). Hashes every byte, in chunks."""
    try:
        m = _manifest(path)
    except Damaged as e:
        return False, str(e)
    problems, total = [], 0
    for name, want in m["files"].items():
        f = path / name
        try:
            st = os.lstat(f)
        except FileNotFoundError:
            st = None
        if st is not None and not stat.S_ISREG(st.st_mode):
            problems.append(NOT_REGULAR.format(name))
            continue
        size = None if st is None else st.st_size
        if (p := _check(name, size, lambda f=f: _hash_file(f)["sha256"], want)) is not None:
            problems.append(p)
        total += size or 0
    if problems:
        return False, "; ".join(problems)
    return True, f"{len(m['files'])} files, {_size(total)}, SHA-256 checked"


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"
