"""`headmoe.serve.store.JobDatabase`: jobs in a real SQLite file that survive a restart, a
foreign or corrupt file refused by its path, two threads at once."""

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
import uuid
from dataclasses import replace

import pytest

from headmoe.errors import RuntimeFault, UserError
from headmoe.pipeline.image import ReferenceImage
from headmoe.pipeline.refine import RefinerStage
from headmoe.pipeline.request import GenerateRequest
from headmoe.serve.state import Job, JobStore
from headmoe.serve.store import (
    APPLICATION_ID,
    DB_NAME,
    FILE_GONE,
    INTERRUPTED,
    SCHEMA_VERSION,
    JobDatabase,
    default_state_dir,
)


def new_job(prompt="a fox", **kw):
    return Job(f"video_{uuid.uuid4().hex}", GenerateRequest(prompt=prompt), 1_800_000_000, **kw)


def completed(db, tmp_path, job):
    db.add(job)
    db.start(job.id, replica=1)
    mp4 = tmp_path / "out" / f"{job.id}.mp4"
    mp4.parent.mkdir(exist_ok=True)
    mp4.write_bytes(b"mp4")
    db.complete(job.id, mp4, {"video_sha256": "v" * 64, "audio_sha256": "a" * 64})
    return mp4


def test_restart_keeps_completed_requeues_queued_and_fails_the_interrupted(tmp_path):
    state = tmp_path / "state"
    db = JobDatabase(state)
    done, lost, running, q1, q2, cancelled = (new_job(f"p{i}") for i in range(6))
    completed(db, tmp_path, done)
    completed(db, tmp_path, lost).unlink()  # its file removed while the server was down
    db.add(running)
    db.start(running.id, replica=0)
    db.progress(running.id, 3)
    for job in (q1, q2, cancelled):
        db.add(job)
    db.end(cancelled.id, "cancelled", "cancelled by request")
    db.close()

    db = JobDatabase(state)  # the restarted server
    rec = db.recover()
    assert [r.id for r in rec.requeue] == [q1.id, q2.id]
    assert all(r.status == "queued" for r in rec.requeue)
    assert [r.id for r in rec.completed] == [done.id]
    row = rec.completed[0]
    assert (row.video_sha256, row.audio_sha256, row.replica) == ("v" * 64, "a" * 64, 1)
    assert row.file == str(tmp_path / "out" / f"{done.id}.mp4")
    assert [(r.id, r.status, r.error) for r in rec.interrupted] == \
        [(running.id, "failed", INTERRUPTED)]
    assert rec.interrupted[0].steps_done == 3
    assert [(r.id, r.status, r.error) for r in rec.lost] == [(lost.id, "failed", FILE_GONE)]
    assert db.get(cancelled.id).status == "cancelled"
    assert [r.id for r in db.jobs()] == [j.id for j in (done, lost, running, q1, q2, cancelled)]
    db.close()

    db = JobDatabase(state)  # a second restart finds nothing more to change
    again = db.recover()
    assert (again.interrupted, again.lost) == ([], [])
    assert [r.id for r in again.requeue] == [q1.id, q2.id]
    db.close()


#: a server that queues two jobs, runs the first and dies of SIGKILL without closing anything
KILLED_SERVER = textwrap.dedent("""
    import os, signal, sys
    from headmoe.pipeline.request import GenerateRequest
    from headmoe.serve.state import JobStore
    from headmoe.serve.store import JobDatabase
    db, store = JobDatabase(sys.argv[1]), JobStore(sys.argv[1], 4)
    jobs = [store.submit(GenerateRequest(prompt=p)) for p in ("runs", "waits")]
    for job in jobs:
        db.add(job)
    db.start(jobs[0].id, replica=0)
    db.progress(jobs[0].id, 2)
    print(" ".join(j.id for j in jobs), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
""")


def test_a_killed_server_leaves_a_database_the_next_one_recovers(tmp_path):
    run = subprocess.run([sys.executable, "-c", KILLED_SERVER, str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == -signal.SIGKILL, run.stderr
    running, waiting = run.stdout.split()
    db = JobDatabase(tmp_path)  # its lock died with it; its WAL is replayed
    rec = db.recover()
    assert [(r.id, r.error, r.steps_done) for r in rec.interrupted] == [(running, INTERRUPTED, 2)]
    assert [r.id for r in rec.requeue] == [waiting]
    db.close()


def test_a_row_round_trips_to_the_job_with_its_image_and_refiner(tmp_path):
    image = ReferenceImage("0" * 64, 100, (37, 23), "PNG", "RGB", 1, 96, 64, 96,
                           pixels=bytes(range(256)) * 72)
    job = new_job(admission={"prompt": "request"}, image=image, refiner=RefinerStage(64, 96, 2))
    db = JobDatabase(tmp_path)
    db.add(job)
    back = db.get(job.id).to_job()
    assert (back.id, back.request, back.admission, back.created_at) == \
        (job.id, job.request, job.admission, job.created_at)
    assert back.image == image and back.image.pixels == image.pixels
    assert back.refiner == job.refiner and back.total_steps == job.total_steps
    assert back.status == "queued" and not back.done.is_set()
    db.end(job.id, "cancelled", "cancelled by request")  # ended: the pixels go, the rest stays
    row = db.get(job.id)
    assert row.image_pixels is None and row.image == image.describe()
    assert row.to_job().done.is_set()
    db.close()


def test_completed_is_refused_while_the_file_is_missing(tmp_path):
    db = JobDatabase(tmp_path)
    job = new_job()
    db.add(job)
    db.start(job.id, replica=0)
    with pytest.raises(RuntimeFault, match=f"job {job.id}: its file {job.id}.mp4 is not in place"):
        db.complete(job.id, tmp_path / f"{job.id}.mp4", {"video_sha256": "v"})
    assert db.get(job.id).status == "in_progress"
    db.close()


def test_a_transition_from_the_wrong_status_names_the_job(tmp_path):
    db = JobDatabase(tmp_path)
    job = new_job()
    db.add(job)
    with pytest.raises(ValueError, match=f"job {job.id}: cannot be set .* while 'queued'"):
        db.progress(job.id, 1)
    with pytest.raises(ValueError, match="use complete"):
        db.end(job.id, "completed", "x")
    with pytest.raises(ValueError, match="is not in the job database"):
        db.start(new_job().id, replica=0)
    db.close()


def test_the_file_is_a_headmoe_wal_database(tmp_path):
    JobDatabase(tmp_path).close()
    conn = sqlite3.connect(tmp_path / DB_NAME)
    assert conn.execute("PRAGMA application_id").fetchone()[0] == APPLICATION_ID
    assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    conn.close()


def refused(state, match):
    """Opening ``state`` is refused naming its database file; the file is left as it was."""
    path = state / DB_NAME
    before = path.read_bytes()
    with pytest.raises(UserError, match=match) as exc:
        JobDatabase(state)
    assert str(path) in str(exc.value) and "\n" not in str(exc.value)
    assert path.read_bytes() == before
    assert not (state / f"{DB_NAME}-wal").exists()


def test_random_bytes_are_refused_by_name(tmp_path):
    (tmp_path / DB_NAME).write_bytes(os.urandom(4096))
    refused(tmp_path, "is not an SQLite database")


def test_a_broken_sqlite_file_is_refused_by_name(tmp_path):
    (tmp_path / DB_NAME).write_bytes(b"SQLite format 3\x00" + os.urandom(4080))
    refused(tmp_path, "is not a readable SQLite database|is corrupt")


def test_a_headmoe_database_with_damaged_pages_is_refused_by_name(tmp_path):
    db = JobDatabase(tmp_path)
    for i in range(40):
        db.add(new_job("x" * 400 + str(i)))
    db.close()  # the last connection's close moves the WAL into the file
    path = tmp_path / DB_NAME
    data = bytearray(path.read_bytes())
    assert len(data) > 3 * 4096
    data[4096:3 * 4096] = os.urandom(2 * 4096)
    path.write_bytes(bytes(data))
    refused(tmp_path, "is not a readable SQLite database|is corrupt")


@pytest.mark.parametrize("app_id", [0, 0x1234])
def test_another_applications_database_is_refused_by_name(tmp_path, app_id):
    conn = sqlite3.connect(tmp_path / DB_NAME)
    conn.execute("CREATE TABLE notes (text TEXT)")
    conn.execute(f"PRAGMA application_id = {app_id}")
    conn.commit()
    conn.close()
    refused(tmp_path, f"is another application's database \\(application_id {app_id:#x}")


def test_a_newer_schema_is_refused_by_name(tmp_path):
    JobDatabase(tmp_path).close()
    conn = sqlite3.connect(tmp_path / DB_NAME)
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    conn.commit()
    conn.close()
    refused(tmp_path, f"has schema version {SCHEMA_VERSION + 1}, newer than this headmoe's")


def test_a_second_server_on_the_same_state_dir_is_refused(tmp_path):
    db = JobDatabase(tmp_path)
    with pytest.raises(UserError, match=f"another server uses this state dir \\(pid {os.getpid()}"):
        JobDatabase(tmp_path)
    db.close()
    JobDatabase(tmp_path).close()  # free again once closed


def test_two_threads_write_at_once(tmp_path):
    db = JobDatabase(tmp_path)
    start = threading.Barrier(2)
    errors = []

    def work(n):
        try:
            start.wait()
            for i in range(40):
                job = new_job(f"thread {n} job {i}")
                db.add(job)
                db.start(job.id, replica=n)
                db.progress(job.id, 1)
                db.jobs()
                db.end(job.id, "failed" if i % 2 else "cancelled", f"thread {n}")
        except Exception as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(n,)) for n in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    rows = db.jobs()
    assert len(rows) == 80 and {r.status for r in rows} == {"failed", "cancelled"}
    assert all(r.error == f"thread {r.replica}" and r.steps_done == 1 for r in rows)
    db.close()


def test_default_state_dir_is_beside_the_output_dir(tmp_path, monkeypatch):
    assert default_state_dir("/srv/videos").as_posix() == "/srv/videos-state"
    assert default_state_dir("/srv/videos/") == default_state_dir("/srv/videos")
    monkeypatch.chdir(tmp_path)
    assert default_state_dir("headmoe-videos") == tmp_path / "headmoe-videos-state"
    with pytest.raises(UserError, match="--output-dir '/' has no folder name"):
        default_state_dir("/")


def test_a_state_dir_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "state").write_text("x")
    with pytest.raises(UserError, match="its state dir .*state is not a folder"):
        JobDatabase(tmp_path / "state")


def _status(db, job):
    return db.get(job.id).status


def test_the_store_writes_every_change_through(tmp_path):
    """`JobStore` with a database: each method's change is in the row before it returns."""
    db = JobDatabase(tmp_path / "state")
    store = JobStore(tmp_path / "out", 4, db)
    run, waits, gone = (store.submit(GenerateRequest(prompt=p)) for p in ("a", "b", "c"))
    assert [r.id for r in db.jobs("queued")] == [run.id, waits.id, gone.id]
    assert store.next_job(0.1) is run and _status(db, run) == "in_progress"
    store.record_step(run, 1, 0.5)
    assert db.get(run.id).steps_done == 1
    store.cancel(gone)
    assert (_status(db, gone), db.get(gone.id).error) == ("cancelled", "cancelled by request")
    with pytest.raises(RuntimeFault, match="not in place"):  # the mp4 comes first
        store.finish(run, "completed", None, {"video_sha256": "v" * 64})
    store.output_dir.mkdir()
    store.output_path(run.id).write_bytes(b"mp4")
    store.finish(run, "completed", None, {"video_sha256": "v" * 64})
    row = db.get(run.id)
    assert (row.status, row.file, row.video_sha256) == \
        ("completed", str(store.output_path(run.id)), "v" * 64)
    assert store.next_job(0.1) is waits
    store.cancel(waits)
    assert db.get(waits.id).cancel_requested
    store.finish(waits, "failed", "rank 1: ValueError: x", None)
    assert (_status(db, waits), db.get(waits.id).error) == ("failed", "rank 1: ValueError: x")
    store.forget(run)
    assert db.get(run.id) is None and not store.output_path(run.id).exists()
    db.close()


def test_restore_requeues_in_order_and_fails_a_job_that_is_refused_now(tmp_path):
    db = JobDatabase(tmp_path / "state")
    first = JobStore(tmp_path / "out", 8, db)
    jobs = [first.submit(GenerateRequest(prompt=p)) for p in ("kept", "refused", "later")]

    def readmit(job):
        if job.request.prompt == "refused":
            raise ValueError("height=4096 ... more than the 1.00 GiB limit")
        return replace(job, request=replace(job.request, num_inference_steps=3),
                       admission={"recipe": "other"})

    store = JobStore(tmp_path / "out", 1, db)  # restored jobs may go past max_queue
    queued = store.restore([r.to_job() for r in db.jobs()], readmit)
    assert [j.id for j in queued] == [jobs[0].id, jobs[2].id]
    assert [j.id for j in store.jobs()] == [j.id for j in jobs]
    refused = store.get(jobs[1].id)
    assert (refused.status, refused.error) == ("failed", "height=4096 ... more than the "
                                                         "1.00 GiB limit")
    assert refused.done.is_set() and _status(db, refused) == "failed"
    row = db.get(jobs[0].id)  # the new admission is stored
    assert (row.request["num_inference_steps"], row.admission, row.total_steps) == \
        (3, {"recipe": "other"}, 3)
    assert store.next_job(0.1).id == jobs[0].id and store.next_job(0.1).id == jobs[2].id
    db.close()
