"""The HTTP API on a real one-rank server with an API key (one process for the module)."""

import json
import re

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from headmoe.pipeline.media import read_mp4
from tests.serve.server import REFINED, REQUEST, Server, finished, wait_for

KEY = "s3cret-key"
LONG = {**REQUEST, "num_inference_steps": 500}


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_cache):
    tmp = tmp_path_factory.mktemp("api")
    (tmp / "key").write_text(KEY + "\n")
    srv = Server(tmp, tiny_cache, "--api-key-file", str(tmp / "key"), "--max-queue", "2",
                 "--drain-timeout", "30")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    with server.client(KEY) as c:
        yield c


def _scrape(client):
    """{(sample name, sorted labels): value} of ``GET /metrics``, parsed by prometheus_client."""
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith(
        "text/plain; version=0.0.4"), r.text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(r.text) for s in family.samples}


def _metric(client, name, **labels):
    return _scrape(client)[(name, tuple(sorted(labels.items())))]


def test_health_needs_no_key(server):
    with server.client() as anon:
        assert anon.get("/health").json() == {"status": "ok", "replicas": [
            {"replica": 0, "ranks": [0], "state": "idle", "job": None}]}


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"},
                                     {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"}])
@pytest.mark.parametrize("method, path", [("GET", "/v1/videos"), ("POST", "/v1/videos"),
                                          ("GET", "/metrics"), ("POST", "/v1/videos/sync"),
                                          ("DELETE", "/v1/videos/video_" + "0" * 32)])
def test_missing_or_wrong_key_is_401(server, headers, method, path):
    with httpx.Client(base_url=server.url, headers=headers, timeout=30) as anon:
        r = anon.request(method, path, json=REQUEST)
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert "API key" in r.json()["error"]["message"]


def test_submit_poll_fetch_equals_generate(server, client, reference):
    r = client.post("/v1/videos", json=REQUEST)
    assert r.status_code == 200, r.text
    job = r.json()
    assert job["status"] == "queued" and re.fullmatch(r"video_[0-9a-f]{32}", job["id"])
    assert isinstance(job["created_at"], int) and job["num_inference_steps"] == 2
    done = wait_for(client, job["id"], finished)
    assert done["status"] == "completed" and done["progress"] == 100, done
    assert (done["video_sha256"], done["audio_sha256"]) == reference
    assert len(done["step_times_s"]["max"]) == 2 and done["total_s"] > 0
    body = client.get(f"/v1/videos/{job['id']}/content")
    assert body.status_code == 200 and body.headers["content-type"] == "video/mp4"
    path = server.output_dir / f"{job['id']}.mp4"
    assert body.content == path.read_bytes()
    frames, audio, fps, rate = read_mp4(path)
    assert frames.shape == (13, 64, 96, 3) and fps == 12.5 and rate == 44100
    side = json.loads(path.with_suffix(".json").read_text())
    assert side["request"]["negative_prompt"] == "blur" and side["request"]["seed"] == 5
    sources = side["admission"]["sources"]  # where each field came from (issue 22 point 4)
    assert sources["seed"] == "request" and sources["num_frames"] == "model default"
    assert sources["dtype"] == "server" and side["admission"]["recipe"] == "tiny"
    listed = client.get("/v1/videos").json()
    assert listed["object"] == "list" and job["id"] in [v["id"] for v in listed["data"]]


def test_refined_request_equals_generate(server, client, refined_reference, reference):
    """The refiner stage (1080p's) on the served tiny release: generate's bytes."""
    r = client.post("/v1/videos", json=REFINED)
    assert r.status_code == 200, r.text
    job = r.json()
    assert job["refiner"] == {k: REFINED[k] for k in ("refiner_height", "refiner_width",
                                                      "refiner_steps")}
    done = wait_for(client, job["id"], finished)
    assert done["status"] == "completed" and done["progress"] == 100, done
    assert done["steps_completed"] == 2 + 2  # preview then refiner steps
    assert (done["video_sha256"], done["audio_sha256"]) == refined_reference
    assert refined_reference[0] != reference[0] and refined_reference[1] == reference[1]
    assert done["refiner"]["latent"] == [7, 4, 6, 48]  # 2T - 1 = 7 latent frames
    frames, _, fps, _ = read_mp4(server.output_dir / f"{job['id']}.mp4")
    assert frames.shape == (25, 64, 96, 3) and fps == 25.0  # 4 (2T - 1) - 3 at twice 12.5


def test_seconds_and_fps_give_num_frames(client):
    job = client.post("/v1/videos", json={**REQUEST, "seconds": "0.72", "fps": 25.0}).json()
    # the largest 4k+1 <= 0.72 x 25 = 18 frames: 17 (headmoe's extension, noted)
    assert job["request"]["num_frames"] == 17 and job["request"]["fps"] == 25.0
    assert wait_for(client, job["id"], finished)["status"] == "completed"


BAD = [
    ({"prompt": 3}, "prompt", "3"),
    ({"negative_prompt": 7}, "negative_prompt", "7"),
    ({"seed": -1}, "seed", "-1"),
    ({"seed": "7"}, "seed", "'7'"),
    ({"seed": 2**64}, "seed", str(2**64)),
    ({"num_inference_steps": 0}, "num_inference_steps", "0"),
    ({"num_inference_steps": 2.5}, "num_inference_steps", "2.5"),
    ({"guidance_scale": "high"}, "guidance_scale", "'high'"),
    ({"audio_guidance_scale": True}, "audio_guidance_scale", "True"),
    ({"height": 50}, "height", "50"),
    ({"width": 0}, "width", "0"),
    ({"num_frames": 0}, "num_frames", "0"),
    ({"num_frames": 13, "seconds": 1}, "seconds,num_frames", "1"),
    ({"num_frames": 14}, "num_frames", "14"),  # generate refuses it: so does serve
    ({"seconds": True}, "seconds", "True"),
    ({"seconds": "1e308"}, "seconds", "1e+308"),
    ({"num_frames": 10**200 + 1}, "num_frames", "(201 characters)"),
    ({"height": 16 * 10**200}, "height", "(202 characters)"),
    ({"num_inference_steps": 1_000_000_000_000}, "num_inference_steps", "1000000000000"),
    ({"size": "896x500"}, "size", "'896x500'"),
    ({"refiner_height": 50}, "refiner_height", "50"),
    ({"refiner_width": "96"}, "refiner_width", "'96'"),
    ({"refiner_steps": 0}, "refiner_steps", "0"),
    ({"seconds": -1}, "seconds", "-1"),
    ({"fps": 0}, "fps", "0"),
    ({"shift": -2.0}, "shift", "-2.0"),
    ({"sampler": "ddim"}, "sampler", "'ddim'"),
    ({"model": "magi2-preview"}, "model", "'magi2-preview'"),
    ({"dtype": "bf16"}, "dtype", "'bf16'"),
    ({"steps": 3}, "steps", "3"),
    ({"height": 4096, "width": 4096, "num_frames": 401}, "height,width,num_frames", "4096"),
]


@pytest.mark.parametrize("change, field, value", BAD, ids=[b[1] + "=" + b[2] for b in BAD])
def test_bad_field_is_422_and_reaches_no_rank(client, change, field, value):
    before = (client.get("/v1/videos").json()["data"],
              _metric(client, "headmoe_requests_total", outcome="queued"))
    r = client.post("/v1/videos", json={**REQUEST, **change})
    err = r.json()["error"]
    assert r.status_code == 422 and err["param"] == field, r.text
    assert field.split(",")[0] in err["message"] and value in err["message"], err
    after = (client.get("/v1/videos").json()["data"],
             _metric(client, "headmoe_requests_total", outcome="queued"))
    assert after == before


@pytest.mark.parametrize("body", [b"{not json", b"[1, 2]", b""])
def test_malformed_body_is_400(client, body):
    r = client.post("/v1/videos", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON object" in r.json()["error"]["message"]


def test_oversized_body_is_413(client):
    r = client.post("/v1/videos", json={**REQUEST, "prompt": "x" * (2 << 20)})
    assert r.status_code == 413 and "more than" in r.json()["error"]["message"]


def test_missing_prompt_is_422(client):
    r = client.post("/v1/videos", json={"seed": 1})
    assert r.status_code == 422 and r.json()["error"]["message"] == "prompt is required"


@pytest.mark.parametrize("vid", ["video_123", "..%2F..%2Fetc%2Fpasswd", "video_" + "0" * 32])
def test_unknown_ids_are_404(client, vid):
    for path in (f"/v1/videos/{vid}", f"/v1/videos/{vid}/content"):
        assert client.get(path).status_code == 404
    assert client.delete(f"/v1/videos/{vid}").status_code == 404


def test_queue_full_then_cancel_queued_and_in_progress(server, client):
    running = client.post("/v1/videos", json=LONG).json()["id"]
    wait_for(client, running, lambda j: j["steps_completed"] >= 1)
    queued = [client.post("/v1/videos", json=REQUEST).json()["id"] for _ in range(2)]
    assert _metric(client, "headmoe_queue_length") == 2
    full = client.post("/v1/videos", json=REQUEST)
    assert full.status_code == 429 and "queue is full" in full.json()["error"]["message"]
    assert client.get(f"/v1/videos/{queued[0]}/content").status_code == 404
    gone = client.delete(f"/v1/videos/{queued[0]}").json()
    assert gone["status"] == "cancelled"
    asked = client.delete(f"/v1/videos/{running}").json()
    assert asked["status"] == "in_progress" and asked["cancel_requested"]
    stopped = wait_for(client, running, finished)
    assert stopped["status"] == "cancelled" and stopped["steps_completed"] < 500
    assert stopped["error"]["message"] == "cancelled by request"
    assert wait_for(client, queued[1], finished)["status"] == "completed"
    for vid in (running, queued[0]):
        assert not list(server.output_dir.glob(f"{vid}*"))
        assert client.get(f"/v1/videos/{vid}/content").status_code == 404


def test_sync_back_to_back_loads_the_model_once(server, client, reference):
    sides = []
    for _ in range(2):
        r = client.post("/v1/videos/sync", json=REQUEST, timeout=120)
        assert r.status_code == 200 and r.headers["content-type"] == "video/mp4", r.text
        assert (r.headers["x-video-sha256"], r.headers["x-audio-sha256"]) == reference
        path = server.output_dir / f"{r.headers['x-video-id']}.mp4"
        assert r.content == path.read_bytes()
        sides.append(json.loads(path.with_suffix(".json").read_text())["server"])
    assert sides[0]["model_loads"] == sides[1]["model_loads"] == 1
    assert sides[0]["model_loaded_at"] == sides[1]["model_loaded_at"]
    assert sides[0]["pid"] == sides[1]["pid"]
    assert _metric(client, "headmoe_model_loads_total") == 1
    assert _metric(client, "headmoe_requests_total", outcome="completed") >= 2
    assert _metric(client, "headmoe_step_seconds_count") >= 4


def test_delete_finished_job_removes_its_files(server, client):
    vid = client.post("/v1/videos", json=REQUEST).json()["id"]
    assert wait_for(client, vid, finished)["status"] == "completed"
    assert client.delete(f"/v1/videos/{vid}").json() == {"id": vid, "object": "video.deleted",
                                                         "deleted": True}
    assert not list(server.output_dir.glob(f"{vid}*"))
    assert client.get(f"/v1/videos/{vid}").status_code == 404


def test_metrics_counters_move_by_one_job_and_one_rejected_request(client):
    """``/metrics`` parses with prometheus_client's parser; a 2-step job and a 422 move
    exactly their counters; every rank's memory is there; the queue is empty after."""
    before = _scrape(client)
    bad = client.post("/v1/videos", json={**REQUEST, "num_inference_steps": 0})
    assert bad.status_code == 422, bad.text
    vid = client.post("/v1/videos", json=REQUEST).json()["id"]
    assert wait_for(client, vid, finished)["status"] == "completed"
    after = _scrape(client)

    def moved(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after[key] - before.get(key, 0.0)

    assert moved("headmoe_requests_total", outcome="queued") == 1
    assert moved("headmoe_requests_total", outcome="completed") == 1
    assert moved("headmoe_requests_total", outcome="failed") == 0
    assert moved("headmoe_requests_rejected_total", code="422") == 1
    assert moved("headmoe_step_seconds_count") == REQUEST["num_inference_steps"]
    assert moved("headmoe_job_seconds_count", outcome="completed") == 1
    assert after[("headmoe_model_loads_total", ())] == 1
    assert after[("headmoe_model_load_seconds", ())] > 0
    assert after[("headmoe_queue_length", ())] == 0
    assert after[("headmoe_replicas_busy", ())] == 0
    memory = {dict(k[1])["rank"]: v for k, v in after.items()
              if k[0] == "headmoe_resident_memory_bytes"}
    assert set(memory) == {"0"} and memory["0"] > 0  # a one-rank server


def test_sigterm_lets_the_current_job_finish_then_exits_0(server, client):
    vid = client.post("/v1/videos", json={**REQUEST, "num_inference_steps": 6}).json()["id"]
    wait_for(client, vid, lambda j: j["status"] == "in_progress")
    server.proc.terminate()
    assert server.wait(timeout=90) == 0, server.log()
    assert (server.output_dir / f"{vid}.mp4").is_file()
    assert (server.output_dir / f"{vid}.json").is_file()
    assert "Traceback" not in server.log()
