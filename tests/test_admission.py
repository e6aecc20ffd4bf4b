"""One admission for every entry point (issue 22 point 5): the same bad requests sent
through ``headmoe generate`` (its flags, `build_job`) and through ``headmoe serve`` (its
HTTP API, on the deployment `build_spec` makes) get the same verdict: the same field and
the same message. Plus the bugs of point 7, each with its test."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

import headmoe.cli.generate as generate_cli
from headmoe.cli.errors import describe
from headmoe.cli.main import build_parser
from headmoe.cli.serve import build_spec
from headmoe.errors import Refusal
from headmoe.release.folder import tiny_release
from headmoe.serve.app import create_app
from headmoe.serve.state import JobStore

BUDGET_GIB = "1"  # the same per-rank budget for both entry points (the tiny model fits)
BAD: list[dict] = [
    {"num_frames": 14}, {"num_frames": 0}, {"num_frames": 10**200 + 1}, {"num_frames": 1002},
    {"height": 50}, {"height": 16 * 10**200}, {"width": 0}, {"width": 4112},
    {"seed": -1}, {"seed": 2**63}, {"seed": 2**64},
    {"num_inference_steps": 0}, {"num_inference_steps": 1_000_000_000_000},
    {"guidance_scale": -1.0}, {"guidance_scale": 1e308}, {"audio_guidance_scale": 101.0},
    {"shift": 0.0}, {"shift": -7.0}, {"fps": 0.0}, {"fps": 1000.0}, {"fps": 0.5},
    {"seconds": 0.0}, {"seconds": 1e308}, {"seconds": float("nan")}, {"seconds": 81.0},
    {"seconds": -4.0}, {"resolution": "1080p"}, {"resolution": "720p"},
    {"size": "896x500"}, {"size": "big"}, {"size": "0x0"}, {"size": "99999x16"},
    {"resolution": "540p", "height": 256}, {"seconds": 10.0, "num_frames": 13},
    {"size": "448x256", "resolution": "540p"}, {"size": "448x256", "width": 96},
    {"prompt": "x" * 100_001}, {"negative_prompt": "y" * 100_001},
    {"height": 4096, "width": 4096, "num_frames": 1001},  # the memory estimate
]


def _flag(name: str, value) -> str:
    return f"--{name.replace('_', '-')}={value}"


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cache")
    tiny_release(folder)
    return folder


@pytest.fixture(scope="module")
def client(cache, tmp_path_factory):
    args = build_parser().parse_args(["serve", "--cache-dir", str(cache), "--max-memory-gib",
                                      BUDGET_GIB, "--output-dir",
                                      str(tmp_path_factory.mktemp("videos"))])
    spec, _ = build_spec(args)
    with TestClient(create_app(JobStore(spec.output_dir, 16), spec)) as c:
        yield c


def generate_verdict(cache, tmp_path, request: dict) -> tuple[str, str]:
    req = {"prompt": "a red fox", **request}
    argv = ["generate", "--cache-dir", str(cache), "--output", str(tmp_path / "o.mp4"),
            "--max-memory-gib", BUDGET_GIB, *(_flag(k, v) for k, v in req.items())]
    with pytest.raises(Refusal) as info:
        generate_cli.build_job(build_parser().parse_args(argv))
    code, line = describe(info.value, "generate")  # what the command line prints
    assert code == 2 and line.startswith(generate_cli.flagify(info.value.message, True))
    return info.value.field, info.value.message


def serve_verdict(client, request: dict) -> tuple[str, str]:
    body = json.dumps({"prompt": "a red fox", **request})  # nan as JSON's NaN extension
    if request.get("seconds") is not None and isinstance(request["seconds"], float):
        body = json.dumps({"prompt": "a red fox", **request, "seconds": repr(request["seconds"])})
    r = client.post("/v1/videos", content=body)
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    return err["param"], err["message"]


@pytest.mark.parametrize("request_", BAD, ids=[",".join(r) for r in BAD])
def test_generate_and_serve_give_the_same_verdict(request_, cache, client, tmp_path):
    assert generate_verdict(cache, tmp_path, request_) == serve_verdict(client, request_)
