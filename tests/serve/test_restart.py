"""Jobs that survive a restart (``--state-dir``, issue 29 point 2): a one-rank server is
killed (SIGKILL) with one job completed, one in progress and one queued, and a new server
on the same state dir lists the completed one and serves its file, runs the queued one and
fails the interrupted one with its reason. A corrupt database and a state dir another
server holds are refused in one line before any rank starts. One killed and one restarted
server for the module."""

import subprocess

import pytest

from headmoe.serve.store import DB_NAME, INTERRUPTED
from tests.serve.server import HEADMOE, REQUEST, Server, finished, wait_for

#: long enough to be in progress when the server is killed
LONG = {**REQUEST, "num_inference_steps": 500}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def restarted(tmp_path_factory, tiny_cache):
    """The restarted server and, from before the kill: the completed job, its mp4's bytes,
    the job in progress and the queued one."""
    tmp = tmp_path_factory.mktemp("restart")
    first = Server(tmp, tiny_cache)
    try:
        with first.client() as c:
            done = wait_for(c, c.post("/v1/videos", json=REQUEST).json()["id"], finished)
            assert done["status"] == "completed", done
            mp4 = c.get(f"/v1/videos/{done['id']}/content").content
            running = c.post("/v1/videos", json=LONG).json()
            wait_for(c, running["id"], lambda j: j["steps_completed"] >= 1)
            queued = c.post("/v1/videos", json=REQUEST).json()
            assert c.get(f"/v1/videos/{queued['id']}").json()["status"] == "queued"
        first.proc.kill()
        first.wait(30)
    finally:
        first.stop()
    second = Server(tmp, tiny_cache)
    yield second, done, mp4, running, queued
    second.stop()


def test_completed_job_is_listed_and_its_file_served(restarted, reference):
    srv, done, mp4, running, queued = restarted
    with srv.client() as c:
        listed = [j["id"] for j in c.get("/v1/videos").json()["data"]]
        assert listed == [done["id"], running["id"], queued["id"]]  # submission order
        job = c.get(f"/v1/videos/{done['id']}").json()
        assert job["status"] == "completed" and (job["video_sha256"], job["audio_sha256"]) == reference
        assert job["created_at"] == done["created_at"] and job["progress"] == 100
        body = c.get(f"/v1/videos/{done['id']}/content")
        assert body.status_code == 200 and body.content == mp4


def test_interrupted_job_failed_with_its_reason(restarted):
    srv, _, _, running, _ = restarted
    with srv.client() as c:
        job = c.get(f"/v1/videos/{running['id']}").json()
    assert job["status"] == "failed" and job["error"] == {"message": INTERRUPTED}
    assert job["steps_completed"] >= 1  # its progress as last written


def test_queued_job_runs_after_the_restart(restarted, reference):
    srv, _, _, _, queued = restarted
    with srv.client() as c:
        job = wait_for(c, queued["id"], finished)
        assert job["status"] == "completed", job
        assert (job["video_sha256"], job["audio_sha256"]) == reference
        assert job["server"]["pid"] == srv.proc.pid  # run by the restarted server
        assert c.get(f"/v1/videos/{queued['id']}/content").status_code == 200


def _serve(tiny_cache, tmp, *flags):
    return subprocess.run(
        [HEADMOE, "serve", "--port", "0", "--cache-dir", str(tiny_cache), "--output-dir",
         str(tmp / "videos"), *flags], capture_output=True, text=True, timeout=300)


def _errors(proc):
    return [line for line in proc.stderr.splitlines() if "error" in line.lower()]


def test_a_held_state_dir_is_refused_in_one_line(restarted, tiny_cache):
    srv, *_ = restarted
    proc = _serve(tiny_cache, srv.output_dir.parent)
    state = srv.output_dir.with_name("videos-state")
    assert proc.returncode == 2, proc.stderr
    assert _errors(proc) == [
        f"headmoe serve: error: job database {state / DB_NAME}: another server uses this "
        f"state dir (pid {srv.proc.pid}); stop that server or give another --state-dir"]
    assert "loading the model" not in proc.stderr and "Traceback" not in proc.stderr


def test_a_corrupt_database_is_refused_in_one_line(tmp_path, tiny_cache):
    state = tmp_path / "state"
    state.mkdir()
    db = state / DB_NAME
    db.write_bytes(b"not a database at all, " * 100)
    proc = _serve(tiny_cache, tmp_path, "--state-dir", str(state))
    assert proc.returncode == 2, proc.stderr
    assert _errors(proc) == [
        f"headmoe serve: error: job database {db}: is not an SQLite database (its first bytes "
        "are b'not a da'); it was left as it is: move it away or give another --state-dir"]
    assert "loading the model" not in proc.stderr and "Traceback" not in proc.stderr
    assert db.read_bytes() == b"not a database at all, " * 100
