"""Data-parallel serve replicas (issue 29 point 1): ``serve --nproc 2 --data-parallel-size 2``
runs two requests at once, one per replica, each the bytes of ``headmoe generate``; a job
cancelled on replica 1 leaves replica 0's alone; SIGTERM drains every replica.

One server for the module; the drain test is last (it stops the server)."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import httpx
import pytest

from headmoe.serve.store import JobDatabase, default_state_dir
from tests.serve.server import REQUEST, Server, finished, generate_samples_hashes

pytestmark = pytest.mark.multirank

LAYOUT = ["--nproc", "2", "--data-parallel-size", "2"]
#: the tiny release's default 8 steps: ~1 s a step on one core, ~10 s a job (measured with
#: ``headmoe generate --num-inference-steps 8``: step times 0.86-1.29 s), so two jobs
#: submitted together overlap for seconds on the two replicas
PAIR = [{**REQUEST, "num_inference_steps": 8, "seed": 11, "prompt": "a red fox in snow"},
        {**REQUEST, "num_inference_steps": 8, "seed": 12, "prompt": "a heron over a lake"}]
LONG = {**REQUEST, "num_inference_steps": 500}
DRAIN_S = 2.0
WAIT_S = 300.0


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_cache):
    srv = Server(tmp_path_factory.mktemp("replicas"), tiny_cache, *LAYOUT,
                 "--drain-timeout", str(DRAIN_S))
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def client(server):
    with server.client() as c:
        yield c


@pytest.fixture(scope="module")
def pair_references(tmp_path_factory, tiny_cache):
    """``generate --samples`` of `PAIR` (one process, one model load): their hashes."""
    return generate_samples_hashes(tmp_path_factory.mktemp("pair"), tiny_cache, PAIR)


def _submit(server: Server, client: httpx.Client, request: dict) -> str:
    r = client.post("/v1/videos", json=request)
    assert r.status_code == 200, f"{r.status_code} {r.text}\n{server.tail()}"
    job = r.json()
    assert job["replica"] is None, job  # queued: no replica yet
    return job["id"]


def _both_running(server: Server, client: httpx.Client, ids: list[str]) -> tuple[dict, bool]:
    """Poll ``GET /v1/videos`` until one snapshot shows every job of ``ids`` in progress;
    that snapshot's jobs by id, and whether some ``/health`` poll showed every replica
    busy (polled until then, or for a few polls more)."""
    deadline = time.monotonic() + WAIT_S
    seen, health_busy, extra = None, False, 0
    while seen is None or (not health_busy and extra < 20):
        listed = {j["id"]: j for j in client.get("/v1/videos").json()["data"]}
        jobs = [listed[i] for i in ids]
        assert not any(finished(j) for j in jobs) or seen, (
            f"a job ended before both ran at once: {jobs}\n{server.tail()}")
        if seen is None and all(j["status"] == "in_progress" for j in jobs):
            seen = {j["id"]: j for j in jobs}
        health = client.get("/health").json()
        health_busy |= [r["state"] for r in health["replicas"]] == ["busy", "busy"]
        extra += seen is not None
        assert time.monotonic() < deadline, f"never both in progress: {jobs}\n{server.tail()}"
        time.sleep(0.05)
    return seen, health_busy


def _wait(server: Server, client: httpx.Client, vid: str) -> dict:
    deadline = time.monotonic() + WAIT_S
    while not finished(job := client.get(f"/v1/videos/{vid}").json()):
        assert server.proc.poll() is None, f"server exited: {job}\n{server.tail()}"
        assert time.monotonic() < deadline, f"timed out on {job}\n{server.tail()}"
        time.sleep(0.1)
    return job


def test_health_lists_two_idle_replicas(server, client):
    health = client.get("/health").json()
    assert health["status"] == "ok", health
    assert health["replicas"] == [
        {"replica": 0, "ranks": [0], "state": "idle", "job": None},
        {"replica": 1, "ranks": [1], "state": "idle", "job": None}], health


def test_two_replicas_run_two_requests_at_once(server, client, pair_references):
    ids = [_submit(server, client, r) for r in PAIR]
    running, health_busy = _both_running(server, client, ids)
    assert {j["replica"] for j in running.values()} == {0, 1}, running
    assert health_busy, f"/health never showed both replicas busy\n{server.tail()}"
    for vid, ref in zip(ids, pair_references):
        done = _wait(server, client, vid)
        assert done["status"] == "completed", f"{done}\n{server.tail()}"
        assert done["replica"] == running[vid]["replica"], done
        assert (done["video_sha256"], done["audio_sha256"]) == ref, (done, ref)
        body = client.get(f"/v1/videos/{vid}/content")
        assert body.status_code == 200
        assert body.content == (server.output_dir / f"{vid}.mp4").read_bytes()
    health = client.get("/health").json()
    assert [r["state"] for r in health["replicas"]] == ["idle", "idle"], health


def test_cancel_on_replica_1_leaves_replica_0_running(server, client, pair_references):
    ids = [_submit(server, client, r) for r in PAIR]
    running, _ = _both_running(server, client, ids)
    by_replica = {j["replica"]: vid for vid, j in running.items()}
    assert sorted(by_replica) == [0, 1], running
    gone, kept = by_replica[1], by_replica[0]
    r = client.delete(f"/v1/videos/{gone}")
    assert r.status_code == 200 and r.json()["cancel_requested"], r.text
    stopped = _wait(server, client, gone)
    assert stopped["status"] == "cancelled" and stopped["replica"] == 1, stopped
    assert not list(server.output_dir.glob(f"{gone}.*"))
    done = _wait(server, client, kept)
    assert done["status"] == "completed" and done["replica"] == 0, f"{done}\n{server.tail()}"
    assert (done["video_sha256"], done["audio_sha256"]) == pair_references[ids.index(kept)]
    # the cancelled replica still serves: a third job runs (on either replica) to the bytes
    k = ids.index(gone)
    third = _wait(server, client, _submit(server, client, PAIR[k]))
    assert third["status"] == "completed" and third["replica"] in (0, 1), third
    assert (third["video_sha256"], third["audio_sha256"]) == pair_references[k]


def _gone(pid: int) -> bool:
    """No process ``pid`` (or only its zombie, which runs nothing)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_sigterm_drains_every_replica_and_exits_0(server, client):
    """Last in the module: it stops the shared server."""
    ranks = server.worker_pids()
    assert len(ranks) == 2, (ranks, server.tail())
    ids = [_submit(server, client, {**LONG, "seed": s}) for s in (21, 22)]
    running, _ = _both_running(server, client, ids)
    assert {j["replica"] for j in running.values()} == {0, 1}, running
    t0 = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    code = server.wait(timeout=120)
    took = time.monotonic() - t0
    assert code == 0, server.tail()
    assert took < DRAIN_S + 45, (took, server.tail())
    deadline = time.monotonic() + 10
    while not all(_gone(pid) for pid in ranks):
        assert time.monotonic() < deadline, (
            f"ranks left after the server exited: {[p for p in ranks if not _gone(p)]}")
        time.sleep(0.1)
    db = JobDatabase(default_state_dir(server.output_dir))
    try:
        rows = {vid: db.get(vid) for vid in ids}
        ends = {vid: None if row is None else row.status for vid, row in rows.items()}
    finally:
        db.close()
    # 500 steps do not finish within the 2 s drain: both are cancelled, none left running
    assert set(ends.values()) <= {"completed", "cancelled"}, (ends, server.tail())
    for vid, status in ends.items():
        if status == "cancelled":
            assert not list(server.output_dir.glob(f"{vid}.*")), vid
    with pytest.raises(httpx.TransportError):
        client.get("/health")
