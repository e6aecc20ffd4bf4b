"""`JobDatabase`: rank 0's jobs in SQLite, so that a restarted server keeps them.

One file, ``<state_dir>/jobs.sqlite3`` (`DB_NAME`; the state dir defaults to
`default_state_dir` of ``--output-dir``), one table ``jobs``, one row per job with the
fields of `headmoe.serve.state.Job` (the same status names, `STATUSES`):

====================  ===================================================================
column                what
====================  ===================================================================
``seq``               submission order (INTEGER PRIMARY KEY)
``id``                the server id, ``video_<32 hex>`` (`ID_PATTERN`), unique
``status``            ``queued`` / ``in_progress`` / ``completed`` / ``failed`` / ``cancelled``
``request``           the `GenerateRequest` as run, JSON (``to_dict``)
``admission``         where each field came from, JSON (`Admitted.describe`)
``image``             the reference image's description, JSON, or NULL
``image_pixels``      its preprocessed RGB bytes (uint8 ``[height, width, 3]``) while the
                      job may still run (NULL once it ended: the table stays small)
``refiner``           the refiner stage (``RefinerStage.to_dict``), JSON, or NULL
``steps_done``        progress: steps finished of ``total_steps`` (both stages)
``cancel_requested``  0 / 1
``video_sha256``      the hashes of a completed job (from its sidecar)
``audio_sha256``
``sidecar``           the completed job's sidecar, JSON
``file``              the completed job's mp4, an absolute path
``error``             why a job failed or was cancelled
``replica``           the data-parallel replica that ran it (0 with one replica)
``created_at``        unix seconds (int), as the job object
``started_at``        unix seconds (float)
``completed_at``      unix seconds (int)
====================  ===================================================================

The file says whose it is: ``PRAGMA application_id`` = `APPLICATION_ID` and ``PRAGMA
user_version`` = `SCHEMA_VERSION`. `JobDatabase` refuses, by the file's path and what is
wrong, anything else (`UserError`): a file that is not SQLite, another application's
database, a schema newer than this headmoe's, a corrupt one (``PRAGMA quick_check``), and
a state dir another server holds (an ``fcntl`` lock on ``jobs.lock``). Nothing is ever
reset or overwritten: an empty file or a missing one is the only thing it initialises.

Writes: WAL journal, ``synchronous=FULL``, every write one ``BEGIN IMMEDIATE`` transaction.
Threads: the HTTP thread and the rank-0 loop share ONE connection behind ONE lock (a
`threading.Lock`; SQLite serialises writers anyway, and a lock keeps each method's reads
and writes one step).

Recovery at start-up (`JobDatabase.recover`):

- a ``completed`` row whose file is gone becomes ``failed`` with `FILE_GONE`: a row is
  never completed without its file (and `JobDatabase.complete` refuses a missing file);
- an ``in_progress`` row becomes ``failed`` with `INTERRUPTED`;
- ``queued`` rows stay queued and come back in submission order, to be queued again.
"""

from __future__ import annotations

import fcntl
import json
import os
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, Any

from headmoe.errors import RuntimeFault, UserError
from headmoe.pipeline.image import ReferenceImage
from headmoe.pipeline.refine import RefinerStage
from headmoe.pipeline.request import GenerateRequest
from headmoe.serve.metrics import TERMINAL
from headmoe.serve.state import ID_PATTERN, STATUSES, Job

#: ``PRAGMA application_id`` of a headmoe job database: "HMoE" in ASCII
APPLICATION_ID = 0x484D6F45
#: ``PRAGMA user_version``: the schema below; a newer file is refused, never downgraded
SCHEMA_VERSION = 1
#: the database file and its lock file in the state dir
DB_NAME, LOCK_NAME = "jobs.sqlite3", "jobs.lock"
#: the suffix of the default state dir's name (``videos`` -> ``videos-state``)
STATE_DIR_SUFFIX = "-state"
#: the error of a running job after a restart, and of a completed one whose file is gone
INTERRUPTED = "interrupted by a server restart"
FILE_GONE = "its file is gone"
#: the first 16 bytes of every SQLite 3 file
SQLITE_HEADER = b"SQLite format 3\x00"

_STATUS_LIST = ", ".join(f"'{s}'" for s in STATUSES)
SCHEMA = f"""
CREATE TABLE jobs (
    seq INTEGER PRIMARY KEY,
    id TEXT NOT NULL UNIQUE,
    status TEXT NOT NULL CHECK (status IN ({_STATUS_LIST})),
    request TEXT NOT NULL,
    admission TEXT NOT NULL,
    image TEXT,
    image_pixels BLOB,
    refiner TEXT,
    steps_done INTEGER NOT NULL DEFAULT 0,
    total_steps INTEGER NOT NULL,
    cancel_requested INTEGER NOT NULL DEFAULT 0,
    video_sha256 TEXT,
    audio_sha256 TEXT,
    sidecar TEXT,
    file TEXT,
    error TEXT,
    replica INTEGER,
    created_at INTEGER NOT NULL,
    started_at REAL,
    completed_at INTEGER,
    CHECK (status != 'completed' OR file IS NOT NULL)
);
"""


def default_state_dir(output_dir: str | os.PathLike[str]) -> Path:
    """The ``--state-dir`` default: a folder beside ``--output-dir``, its name plus
    `STATE_DIR_SUFFIX` (``/srv/videos`` -> ``/srv/videos-state``), absolute."""
    out = Path(os.path.abspath(os.path.expanduser(os.fspath(output_dir))))
    if not out.name:
        raise UserError(f"--output-dir {os.fspath(output_dir)!r} has no folder name to put "
                        "a state dir beside: give --state-dir")
    return out.with_name(out.name + STATE_DIR_SUFFIX)


@dataclass(frozen=True)
class JobRow:
    """One row of ``jobs`` (the columns of the module docstring), JSON columns decoded."""

    id: str
    status: str
    request: dict[str, Any]
    admission: dict[str, Any]
    image: dict[str, Any] | None
    image_pixels: bytes | None
    refiner: dict[str, int] | None
    steps_done: int
    total_steps: int
    cancel_requested: bool
    video_sha256: str | None
    audio_sha256: str | None
    sidecar: dict[str, Any] | None
    file: str | None
    error: str | None
    replica: int | None
    created_at: int
    started_at: float | None
    completed_at: int | None

    def to_job(self) -> Job:
        """The `Job` of this row (status, progress, result and error as stored; the image
        with its pixels), for a restarted server's `JobStore`."""
        image = None
        if self.image is not None:
            image = replace(ReferenceImage.from_dict(self.image), pixels=self.image_pixels)
        job = Job(self.id, GenerateRequest(**self.request), self.created_at,
                  status=self.status, steps_done=self.steps_done,
                  cancel_requested=self.cancel_requested, error=self.error,
                  started_at=self.started_at, completed_at=self.completed_at,
                  result=self.sidecar, admission=self.admission, image=image,
                  replica=self.replica,
                  refiner=None if self.refiner is None else RefinerStage.from_dict(self.refiner))
        if self.status in TERMINAL:
            job.done.set()
        return job


@dataclass(frozen=True)
class Recovery:
    """What `JobDatabase.recover` found: ``requeue`` the queued rows in submission order;
    ``completed`` those whose file is there; ``interrupted`` and ``lost`` the rows it
    marked failed (`INTERRUPTED`, `FILE_GONE`), as they are now."""

    requeue: list[JobRow]
    completed: list[JobRow]
    interrupted: list[JobRow]
    lost: list[JobRow]


_JSON_COLUMNS = ("request", "admission", "image", "refiner", "sidecar")


def _row(r: sqlite3.Row) -> JobRow:
    d = dict(r)
    del d["seq"]
    for k in _JSON_COLUMNS:
        d[k] = None if d[k] is None else json.loads(d[k])
    d["cancel_requested"] = bool(d["cancel_requested"])
    return JobRow(**d)


def _refuse(path: Path, why: str,
            hint: str = "it was left as it is: move it away") -> UserError:
    return UserError(f"job database {path}: {why}; {hint} or give another --state-dir")


def _check_header(path: Path) -> None:
    """Refuse a non-empty file that is not SQLite 3, before SQLite touches it."""
    if path.exists() and not path.is_file():
        raise _refuse(path, "is not a regular file")
    if path.is_file() and path.stat().st_size > 0:
        with path.open("rb") as f:
            head = f.read(len(SQLITE_HEADER))
        if head != SQLITE_HEADER:
            raise _refuse(path, "is not an SQLite database (its first bytes are "
                                f"{head[:8]!r})")


def _identify(conn: sqlite3.Connection, path: Path) -> bool:
    """True for a new (empty) database, False for a headmoe job database this code reads;
    anything else is refused (`UserError` naming ``path`` and what is wrong)."""
    try:
        app = conn.execute("PRAGMA application_id").fetchone()[0]
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        tables = [r[0] for r in conn.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")]
        check = conn.execute("PRAGMA quick_check").fetchone()[0]
    except sqlite3.DatabaseError as exc:
        raise _refuse(path, f"is not a readable SQLite database ({exc})") from exc
    if check != "ok":
        raise _refuse(path, f"is corrupt (quick_check: {check})")
    if app == 0 and version == 0 and not tables:
        return True
    if app != APPLICATION_ID:
        raise _refuse(path, f"is another application's database (application_id "
                            f"{app:#x}, not headmoe's {APPLICATION_ID:#x}; tables {tables})")
    if version > SCHEMA_VERSION:
        raise _refuse(path, f"has schema version {version}, newer than this headmoe's "
                            f"{SCHEMA_VERSION}: run the newer headmoe")
    if version < 1 or "jobs" not in tables:
        raise _refuse(path, f"is an unfinished headmoe job database (schema version "
                            f"{version}, tables {tables})")
    return False


class JobDatabase:
    """The job table of one state dir (see the module docstring). Every method is safe
    from any thread; each write is one transaction."""

    def __init__(self, state_dir: str | os.PathLike[str]):
        self.state_dir = Path(os.path.abspath(os.fspath(state_dir)))
        self.path = self.state_dir / DB_NAME
        if self.state_dir.exists() and not self.state_dir.is_dir():
            raise _refuse(self.path, f"its state dir {self.state_dir} is not a folder")
        try:
            self.state_dir.mkdir(parents=True, exist_ok=True)
            self._lock_file = self._hold_lock()
        except OSError as exc:
            raise _refuse(self.path, f"its state dir cannot be used ({exc})",
                          "fix its permissions") from exc
        try:
            _check_header(self.path)
            self._conn = sqlite3.connect(self.path, isolation_level=None,
                                         check_same_thread=False)
            self._conn.row_factory = sqlite3.Row
            try:
                self._open()
            except BaseException:
                self._conn.close()
                raise
        except BaseException:
            self._lock_file.close()
            raise
        self._lock = threading.Lock()

    def _hold_lock(self) -> IO[str]:
        """Hold ``jobs.lock`` exclusively (one server per state dir) or refuse."""
        f = (self.state_dir / LOCK_NAME).open("a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            f.seek(0)
            holder = f.read().strip() or "unknown"
            f.close()
            raise _refuse(self.path, f"another server uses this state dir (pid {holder})",
                          "stop that server") from exc
        f.seek(0)
        f.truncate()
        f.write(str(os.getpid()))
        f.flush()
        return f

    def _open(self) -> None:
        new = _identify(self._conn, self.path)
        self._conn.execute("PRAGMA journal_mode = WAL")
        self._conn.execute("PRAGMA synchronous = FULL")
        if new:
            with self._transaction() as c:
                c.execute(SCHEMA)
                c.execute(f"PRAGMA application_id = {APPLICATION_ID}")
                c.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        self._conn.execute("BEGIN IMMEDIATE")
        try:
            yield self._conn
            self._conn.execute("COMMIT")
        except BaseException:
            if self._conn.in_transaction:
                self._conn.execute("ROLLBACK")
            raise

    def close(self) -> None:
        """Close the connection and let go of the state dir."""
        with self._lock:
            self._conn.close()
            self._lock_file.close()

    # ------------------------------------------------------------------ writes
    def add(self, job: Job) -> None:
        """Insert ``job`` (a new, queued `Job`) with its request, admission, image (and
        pixels) and refiner stage."""
        if not ID_PATTERN.fullmatch(job.id):
            raise ValueError(f"job id must match {ID_PATTERN.pattern}, got {job.id!r}")
        image = None if job.image is None else json.dumps(job.image.describe())
        pixels = None if job.image is None else job.image.pixels
        refiner = None if job.refiner is None else json.dumps(job.refiner.to_dict())
        with self._lock, self._transaction() as c:
            c.execute(
                "INSERT INTO jobs (id, status, request, admission, image, image_pixels, "
                "refiner, steps_done, total_steps, cancel_requested, created_at) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (job.id, job.status, json.dumps(job.request.to_dict()),
                 json.dumps(job.admission), image, pixels, refiner, job.steps_done,
                 job.total_steps, int(job.cancel_requested), job.created_at))

    def readmit(self, job: Job) -> None:
        """A queued ``job`` of a restarted server, admitted again: its request, admission
        and refiner stage as the new admission made them (the served model or budget may
        have changed)."""
        refiner = None if job.refiner is None else json.dumps(job.refiner.to_dict())
        self._move(job.id, ("queued",), request=json.dumps(job.request.to_dict()),
                   admission=json.dumps(job.admission), refiner=refiner,
                   total_steps=job.total_steps)

    def start(self, job_id: str, replica: int, started_at: float | None = None) -> None:
        """A queued job runs now, on data-parallel replica ``replica``."""
        self._move(job_id, ("queued",), status="in_progress", replica=replica,
                   started_at=time.time() if started_at is None else started_at)

    def progress(self, job_id: str, steps_done: int) -> None:
        """``steps_done`` steps of the running job are finished."""
        self._move(job_id, ("in_progress",), steps_done=steps_done)

    def request_cancel(self, job_id: str) -> None:
        """The running job is asked to stop at its next layer."""
        self._move(job_id, ("in_progress",), cancel_requested=1)

    def complete(self, job_id: str, file: str | os.PathLike[str], sidecar: dict[str, Any],
                 completed_at: int | None = None) -> None:
        """The running job is completed: its mp4 ``file`` is in place (renamed there
        already; `RuntimeFault` naming the job otherwise) and ``sidecar`` its sidecar."""
        path = Path(os.path.abspath(os.fspath(file)))
        if not path.is_file():
            raise RuntimeFault(f"job {job_id}: its file {path.name} is not in place; a job "
                               "is completed only once its mp4 is written")
        self._move(job_id, ("in_progress",), status="completed", file=str(path),
                   sidecar=json.dumps(sidecar), video_sha256=sidecar.get("video_sha256"),
                   audio_sha256=sidecar.get("audio_sha256"), error=None, image_pixels=None,
                   completed_at=int(time.time()) if completed_at is None else completed_at)

    def end(self, job_id: str, status: str, error: str,
            completed_at: int | None = None) -> None:
        """A queued or running job ends without a file: ``status`` ``failed`` or
        ``cancelled``, ``error`` why."""
        if status not in TERMINAL - {"completed"}:
            raise ValueError(f"status must be 'failed' or 'cancelled' (use complete() for "
                             f"'completed'), got {status!r}")
        self._move(job_id, ("queued", "in_progress"), status=status, error=error,
                   image_pixels=None,
                   completed_at=int(time.time()) if completed_at is None else completed_at)

    def delete(self, job_id: str) -> None:
        """Drop a finished job's row (its files are the caller's)."""
        with self._lock, self._transaction() as c:
            n = c.execute("DELETE FROM jobs WHERE id = ? AND status IN (?, ?, ?)",
                          (job_id, *sorted(TERMINAL))).rowcount
            if n != 1:
                raise ValueError(self._why_not(c, job_id, "deleted", sorted(TERMINAL)))

    def _move(self, job_id: str, allowed: tuple[str, ...], **sets: Any) -> None:
        """``UPDATE`` the row of ``job_id`` if its status is in ``allowed``; else
        `ValueError` naming the job and its status."""
        cols = ", ".join(f"{k} = ?" for k in sets)
        marks = ", ".join("?" * len(allowed))
        with self._lock, self._transaction() as c:
            n = c.execute(f"UPDATE jobs SET {cols} WHERE id = ? AND status IN ({marks})",
                          (*sets.values(), job_id, *allowed)).rowcount
            if n != 1:
                raise ValueError(self._why_not(c, job_id, f"set {sorted(sets)}", allowed))

    @staticmethod
    def _why_not(c: sqlite3.Connection, job_id: str, what: str, allowed: Any) -> str:
        row = c.execute("SELECT status FROM jobs WHERE id = ?", (job_id,)).fetchone()
        if row is None:
            return f"job {job_id!r} is not in the job database"
        return (f"job {job_id}: cannot be {what} while {row[0]!r} (only while one of "
                f"{list(allowed)})")

    # ------------------------------------------------------------------ reads
    def get(self, job_id: str) -> JobRow | None:
        """The row of ``job_id``, None if there is none."""
        with self._lock:
            r = self._conn.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return None if r is None else _row(r)

    def jobs(self, status: str | None = None) -> list[JobRow]:
        """Every row (of ``status``, if given) in submission order."""
        where, args = ("WHERE status = ?", (status,)) if status else ("", ())
        with self._lock:
            rows = self._conn.execute(f"SELECT * FROM jobs {where} ORDER BY seq", args)
            return [_row(r) for r in rows]

    def recover(self) -> Recovery:
        """Start-up after a restart (module docstring): running rows -> failed
        (`INTERRUPTED`), completed rows without their file -> failed (`FILE_GONE`); the
        queued rows to queue again, in submission order."""
        now = int(time.time())
        with self._lock, self._transaction() as c:
            running = [r[0] for r in c.execute(
                "SELECT id FROM jobs WHERE status = 'in_progress' ORDER BY seq")]
            gone = [r[0] for r in c.execute(
                "SELECT id, file FROM jobs WHERE status = 'completed' ORDER BY seq")
                if not Path(r[1]).is_file()]
            for ids, error in ((running, INTERRUPTED), (gone, FILE_GONE)):
                c.executemany("UPDATE jobs SET status = 'failed', error = ?, image_pixels = "
                              "NULL, completed_at = COALESCE(completed_at, ?) WHERE id = ?",
                              [(error, now, i) for i in ids])
        by_id = {r.id: r for r in self.jobs()}
        return Recovery(
            requeue=[r for r in by_id.values() if r.status == "queued"],
            completed=[r for r in by_id.values() if r.status == "completed"],
            interrupted=[by_id[i] for i in running], lost=[by_id[i] for i in gone])


def check_output_dir(db: JobDatabase, output_dir: str | os.PathLike[str]) -> None:
    """Refuse (`UserError`, one line naming both folders) a database whose completed jobs'
    files are in another folder than ``output_dir``: a server serves the files of its
    ``--output-dir`` only, so a state dir goes with the output dir it was made with."""
    out = Path(os.path.abspath(os.fspath(output_dir))).resolve()
    for row in db.jobs("completed"):
        folder = Path(row.file or "").parent.resolve()
        if folder != out:
            raise _refuse(db.path, f"its completed jobs' files are in {folder}, not in "
                                   f"--output-dir {out}", "give that --output-dir")


def check_state_dir(state_dir: str | os.PathLike[str],
                    output_dir: str | os.PathLike[str]) -> Path:
    """Open the database of ``state_dir`` and let it go again, before any rank starts: a
    corrupt or foreign file, a state dir another server holds or one made with another
    ``--output-dir`` raises `UserError` naming it (`JobDatabase`, `check_output_dir`);
    a missing database is created. Returns the database's path."""
    db = JobDatabase(state_dir)
    try:
        check_output_dir(db, output_dir)
    finally:
        db.close()
    return db.path
