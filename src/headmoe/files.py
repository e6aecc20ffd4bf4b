"""Reading files of an untrusted model folder: the one home of the containment rule.

A model folder (a release, a checkpoint's folder, a text encoder) is data, never code, and
never a way to reach other files:

- `confined_file(folder, entry)`: the path of a name an index (or the layout) gives, which
  must be relative, must not leave ``folder`` by ``..`` and must be a regular file (a FIFO,
  socket or device is refused by ``stat`` before anything opens it, so nothing blocks). A
  link is followed only where it stays in the folder, or, in the Hugging Face cache layout
  (``<repo>/snapshots/<revision>/...`` whose files link into ``<repo>/blobs/``), into that
  repository's ``blobs/``; a link anywhere else is refused.
- `index_map(path)`: name -> file of a ``*.safetensors.index.json``, every shard confined.
- `check_entries(folder)`: every top-level entry of a folder a library reads by itself
  (``transformers`` picks its tokenizer files) is a confined regular file or a folder.
- `read_json(path, what)`: a JSON file whose errors name the file.
- `atomic_write(path, write, overwrite=...)` and `atomic_folder(path, build)`: the one way
  headmoe writes a file or a cache folder: built under `temp_path` (``.<name>.<pid>.<uuid8>
  .tmp`` beside it), removed on any exception (also the `Terminated` of SIGTERM), then moved
  into place in one step. Without ``overwrite`` the move is a hard link, which fails if the
  name exists: two runs writing the same output cannot silently replace each other.
- `listing(kind, items)` and `brief(items)`: a problem list cut at `MAX_LISTED` names plus
  a count, so an error stays one readable line whatever the folder holds.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from headmoe.errors import RuntimeFault

#: problems listed per kind in an error message before "... and N more"
MAX_LISTED = 12
#: Hugging Face cache folders: ``<repo>/snapshots/<rev>`` link into ``<repo>/blobs``
HF_SNAPSHOTS, HF_BLOBS = "snapshots", "blobs"


def listing(kind: str, items: list[str]) -> str:
    """``"N kind: a; b; ... and M more"`` with at most `MAX_LISTED` items shown."""
    shown = "; ".join(items[:MAX_LISTED])
    more = f" ... and {len(items) - MAX_LISTED} more" if len(items) > MAX_LISTED else ""
    return f"{len(items)} {kind}: {shown}{more}"


def brief(items: Any) -> str:
    """``repr`` of a list cut after `MAX_LISTED` items: ``[0, 1, ... (1000000 items)]``."""
    if not isinstance(items, list | tuple):
        return repr(items)
    items = list(items)
    if len(items) <= MAX_LISTED:
        return repr(items)
    return "[" + ", ".join(map(repr, items[:MAX_LISTED])) + f", ... ({len(items)} items)]"


def _inside(path: str, base: str) -> bool:
    return os.path.commonpath([base, path]) == base


def _hf_blobs(base: str) -> str | None:
    """``<repo>/blobs`` when ``base`` (resolved) lies in ``<repo>/snapshots/<rev>/``."""
    parts = Path(base).parts
    for i in range(len(parts) - 2, 0, -1):
        if parts[i] == HF_SNAPSHOTS:
            blobs = os.path.join(*parts[:i], HF_BLOBS)
            return blobs if os.path.isdir(blobs) else None
    return None


def entry_problem(folder: str | os.PathLike[str], entry: str) -> tuple[str | None, str]:
    """(why ``entry`` is refused, or None; its resolved path) for `confined_file`. The
    reason is short: "missing", "not a relative file name", "outside the folder", "a link
    to <path>, outside the folder", "not a regular file". Nothing is opened."""
    base = os.path.realpath(os.fspath(folder))
    if not isinstance(entry, str) or not entry or os.path.isabs(entry):
        return "not a relative file name", ""
    joined = os.path.normpath(os.path.join(base, entry))
    if not _inside(joined, base):
        return "outside the folder", joined
    real = os.path.realpath(joined)
    blobs = _hf_blobs(base)
    if not (_inside(real, base) or (blobs is not None and _inside(real, blobs))):
        return f"a link to {real!r}, outside the folder", real
    try:
        mode = os.stat(real).st_mode
    except OSError:
        return "missing", real
    return (None if stat.S_ISREG(mode) else "not a regular file"), real


def confined_file(folder: str | os.PathLike[str], entry: str, what: str) -> str:
    """The resolved path of ``entry`` (a relative name read from ``what``) in ``folder``.

    Raises `ValueError` naming ``what``, ``entry`` and the folder when it is absolute,
    leaves the folder (``..`` or a link out, see the module docstring), is missing, or is
    not a regular file (FIFO, socket, device, folder). Nothing is opened."""
    why, real = entry_problem(folder, entry)
    if why == "missing":
        raise ValueError(f"{what} {entry!r} is missing")
    if why is not None:
        base = os.path.realpath(os.fspath(folder))
        where = f" {base!r}" if why.endswith("folder") else ""
        raise ValueError(f"{what} {entry!r} is {why}{where}; entries must be regular files "
                         "inside the folder")
    return real


def check_entries(folder: str | os.PathLike[str], what: str) -> None:
    """Every top-level entry of ``folder`` is a folder or a `confined_file` (before a
    library that picks files by itself reads it)."""
    folder = os.fspath(folder)
    for entry in sorted(os.listdir(folder)):
        if not os.path.isdir(os.path.join(folder, entry)):
            confined_file(folder, entry, what)


def read_json(path: str | os.PathLike[str], what: str) -> Any:
    """The parsed JSON of ``path`` (a regular file); `ValueError` naming ``what`` and the
    file when it cannot be read or parsed."""
    path = os.fspath(path)
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise ValueError(f"{what} {path!r} is not a regular file")
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{what} {path!r} is not a readable JSON file: {e}") from None
    except RecursionError:
        raise ValueError(f"{what} {path!r} is nested too deeply to be read") from None


def index_map(path: str | os.PathLike[str]) -> dict[str, str]:
    """name -> resolved shard file of a ``*.safetensors.index.json``; every shard is a
    `confined_file` of the index's folder (which is resolved, not the index's link)."""
    path = os.fspath(path)
    what = f"checkpoint index {path!r}"
    index = read_json(path, "checkpoint index")
    wmap = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(wmap, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in wmap.items()
    ):
        raise ValueError(f"{what} needs a 'weight_map' object of strings")
    folder = os.path.dirname(os.path.abspath(path))
    files = {shard: confined_file(folder, shard, f"{what}: shard file") for shard in sorted(set(wmap.values()))}
    return {name: files[shard] for name, shard in wmap.items()}


# ---------------------------------------------------------------------- atomic writes
def temp_path(path: str | os.PathLike[str]) -> Path:
    """``<folder>/.<name>.<pid>.<uuid8>.tmp`` beside ``path`` (same file system)."""
    path = Path(path)
    return path.parent / f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"


def _publish(tmp: Path, path: Path) -> None:
    """Move ``tmp`` to ``path`` only if ``path`` does not exist (`FileExistsError`)."""
    try:
        os.link(tmp, path)  # atomic and exclusive
    except FileExistsError:
        raise
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EMLINK, errno.EXDEV):
            raise
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))  # no hard links here
        os.replace(tmp, path)
        return
    os.unlink(tmp)


def atomic_write(path: str | os.PathLike[str], write: Callable[[str], None], *,
                 overwrite: bool = True) -> None:
    """``write(tmp)`` then move ``tmp`` to ``path`` in one step (see the module docstring);
    the temp file never stays. Without ``overwrite`` an existing ``path`` (made meanwhile by
    another run) is kept and `RuntimeFault` names it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(path)
    try:
        write(str(tmp))
        if overwrite:
            os.replace(tmp, path)
        else:
            _publish(tmp, path)
    except FileExistsError:
        raise RuntimeFault(f"{str(path)!r} was created by another run while this one was "
                           "going; it was kept and this run's file dropped, pass --overwrite "
                           "to replace it or pick another path") from None
    finally:
        if tmp.exists():
            tmp.unlink()


def atomic_folder(path: str | os.PathLike[str], build: Callable[[Path], None]) -> Path:
    """``build(tmp)`` into a temp folder beside ``path``, then rename it to ``path``; a
    concurrent builder that renamed first wins and is kept. The temp folder never stays."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(path)
    try:
        build(tmp)
        try:
            os.replace(tmp, path)
        except OSError:
            if not path.is_dir():
                raise
    finally:
        if tmp.is_dir():
            shutil.rmtree(tmp)
        elif tmp.exists():
            tmp.unlink()
    return path
