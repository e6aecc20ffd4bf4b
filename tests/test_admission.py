"""One admission for every entry point (issue 22 point 5): the same bad requests sent
through ``headmoe generate`` (its flags, `build_job`) and through ``headmoe serve`` (its
HTTP API, on the deployment `build_spec` makes) get the same verdict: the same field and
the same message. Plus the bugs of point 7, each with its test."""

from __future__ import annotations

import json
import re

import pytest
import torch
from fastapi.testclient import TestClient

import headmoe.cli.generate as generate_cli
from headmoe import admission
from headmoe.cli.errors import describe
from headmoe.cli.flags import as_flags
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
def spec(cache, tmp_path_factory):
    args = build_parser().parse_args(["serve", "--cache-dir", str(cache), "--max-memory-gib",
                                      BUDGET_GIB, "--output-dir",
                                      str(tmp_path_factory.mktemp("videos"))])
    return build_spec(args)[0]


@pytest.fixture(scope="module")
def client(spec):
    with TestClient(create_app(JobStore(spec.output_dir, 16), spec)) as c:
        yield c


def generate_verdict(cache, tmp_path, request: dict) -> tuple[str, str]:
    req = {"prompt": "a red fox", **request}
    argv = ["generate", "--cache-dir", str(cache), "--output", str(tmp_path / "o.mp4"),
            "--max-memory-gib", BUDGET_GIB, *(_flag(k, v) for k, v in req.items())]
    with pytest.raises(Refusal) as info:
        generate_cli.build_job(build_parser().parse_args(argv))
    code, line = describe(info.value, "generate")  # what the command line prints
    assert code == 2 and line.startswith(as_flags(info.value.message, True))
    return info.value.field, info.value.message


def serve_verdict(client, request: dict) -> tuple[str, str]:
    body = json.dumps({"prompt": "a red fox", **request})  # nan as JSON's NaN extension
    if request.get("seconds") is not None and isinstance(request["seconds"], float):
        body = json.dumps({"prompt": "a red fox", **request, "seconds": repr(request["seconds"])})
    r = client.post("/v1/videos", content=body)
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    return err["param"], err["message"]


ESTIMATE = re.compile(r"need an estimated [0-9.]+ GiB per rank \(weights [0-9.]+, ")


def _estimate_masked(verdict: tuple[str, str]) -> tuple[str, str]:
    """The verdict with the estimate's total and weights masked: the server keeps the
    release's refiner loaded, so its weights (and only they) differ from generate's
    (`test_one_memory_estimate_for_every_entry_point` checks that difference exactly)."""
    field, message = verdict
    assert field != "height,width,num_frames" or ESTIMATE.search(message), message
    return field, ESTIMATE.sub("need an estimated (masked) GiB per rank (weights (masked), ",
                               message)


@pytest.mark.parametrize("request_", BAD, ids=[",".join(r) for r in BAD])
def test_generate_and_serve_give_the_same_verdict(request_, cache, client, tmp_path):
    assert _estimate_masked(generate_verdict(cache, tmp_path, request_)) == \
        _estimate_masked(serve_verdict(client, request_))


# ---------------------------------------------------------------------- issue 22 point 7
def test_serve_refuses_num_frames_14_as_generate(cache, client, tmp_path):
    """serve once checked the size with the stand-in decoder and took 14 frames."""
    verdict = generate_verdict(cache, tmp_path, {"num_frames": 14})
    assert verdict == serve_verdict(client, {"num_frames": 14})
    assert verdict == ("num_frames", "num_frames=14 must be of the form 4k+1 (the video "
                                     "decoders make 1 + 4k frames), use 13 or 17")


def test_seed_limit_has_one_home(cache, client, tmp_path):
    """One range, [0, 2**63), from `seeding.SEED_LIMIT` (serve once allowed 2**64 - 1); a
    data-parallel job also keeps seed + k below it."""
    from headmoe.pipeline.seeding import SEED_LIMIT

    for seed in (SEED_LIMIT, 2**64 - 1):
        got = generate_verdict(cache, tmp_path, {"seed": seed})
        assert got == serve_verdict(client, {"seed": seed})
        assert got[1] == f"seed={seed} must be an integer in [0, 2**63 - 1]"
    r = client.post("/v1/videos", json={"prompt": "x", "seed": SEED_LIMIT - 1,
                                         "num_inference_steps": 1})
    assert r.status_code == 200, r.text
    with pytest.raises(Refusal, match=r"seed=9223372036854775807 is above "
                                      r"9223372036854775806: data-parallel group k"):
        admission.check_seed(SEED_LIMIT - 1, 2)


def test_one_memory_estimate_for_every_entry_point(spec):
    """serve's admission runs the planner's estimate with the real tokenizer's counts (it
    once had its own estimator with an attention term and a byte count of the text)."""
    from headmoe.models.refiner import refiner_weight_bytes
    from headmoe.planner.memory import estimate_memory
    from headmoe.serve.validate import admit_body, parse_body

    got = admit_body(parse_body(b'{"prompt": "a red fox in the snow"}'), spec)
    req = got.request
    count = spec.deployment.count_tokens
    assert got.shape.text_tokens == (count(req.prompt), count(req.negative_prompt))
    assert got.shape.text_tokens[0] != admission.byte_tokens(req.prompt)  # BPE, not bytes
    dep = spec.deployment
    want = estimate_memory(dep.model_config, got.shape, dep.parallel, req.torch_dtype,
                           (req.num_frames, req.height, req.width), req.audio_samples(44100))
    # the server keeps the release's refiner loaded, so a preview-only request counts it too
    assert dep.resident_refiner and dep.refiner_config is not None
    resident = refiner_weight_bytes(dep.refiner_config, req.torch_dtype)
    assert resident > 0 and got.estimate.weights == want.weights + resident
    assert (got.estimate.activations, got.estimate.workspace, got.estimate.decode) == (
        want.activations, want.workspace, want.decode)


def test_the_estimate_counts_the_deployments_expert_format(spec):
    """An FP8 deployment's estimate counts FP8 expert bytes (the planner's, per format);
    no device check refuses FP8 (W8A16 runs wherever the bf16 experts run)."""
    import dataclasses

    from headmoe.models.refiner import refiner_weight_bytes
    from headmoe.planner.memory import estimate_memory

    dep = spec.deployment
    got = {}
    for fmt in ("bf16", "fp8"):
        admitted = admission.admit({"prompt": "a fox"}, dataclasses.replace(dep, expert_format=fmt))
        req = admitted.request
        want = estimate_memory(dep.model_config, admitted.shape, dep.parallel, req.torch_dtype,
                               (req.num_frames, req.height, req.width), req.audio_samples(44100),
                               experts=fmt)
        resident = refiner_weight_bytes(dep.refiner_config, req.torch_dtype)
        assert admitted.estimate.weights == want.weights + resident, fmt
        got[fmt] = admitted.estimate
    assert got["fp8"].weights < got["bf16"].weights
    assert got["bf16"].activations == got["fp8"].activations


def test_schedule_refuses_a_bool_shift():
    """The sampler's schedule refuses ``shift=True`` (an inline integer test there once
    took it; `tests/test_rules.py` checks that no inline copy of `is_int` is left)."""
    from headmoe.pipeline.sampler import released_schedule

    with pytest.raises(ValueError, match="shift must be a positive number, got True"):
        released_schedule(8, True)


def test_one_rank_serve_runs_where_generate_runs(monkeypatch, tmp_path):
    """`serve --nproc 1` takes its device from `rank_device`, as generate's one rank: CUDA
    where it is available (read through the function, no GPU here)."""
    import signal
    from types import SimpleNamespace

    import headmoe.serve.worker as worker
    from headmoe.distributed import context
    from headmoe.pipeline.deployment import Deployment
    from headmoe.serve.spec import ServeSpec

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert context.rank_device() == torch.device("cuda", 0)
    seen = []

    class Stop(Exception):
        pass

    def single(parallel, device=None):
        seen.append(device)
        raise Stop

    monkeypatch.setattr(worker.ParallelContext, "single", single)
    monkeypatch.setattr(signal, "signal", lambda *a: None)
    dep = Deployment(model_config=SimpleNamespace(name="fake"), model="tiny", dtype="fp32")
    spec = ServeSpec(deployment=dep, output_dir=str(tmp_path), port=0)
    with pytest.raises(Stop):
        worker.serve_rank(spec, 0, 1)
    assert seen == [torch.device("cuda", 0)]


def test_every_flag_has_one_help_line_and_help_states_both_recipes():
    """Issue 22 point 4: a help line for every flag of every command, no doubled
    "(default: ...)"; generate --help says the tiny and the MAGI-2 Preview defaults."""
    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices
    for name, sub in commands.items():
        for action in sub._actions:
            if not action.option_strings or action.dest == "help":
                continue
            text = action.help or ""
            assert text.strip(), (name, action.option_strings)
            assert text.count("(default:") <= 1, (name, action.option_strings, text)
    help_text = commands["generate"].format_help()
    for fragment in ("100 for MAGI-2 Preview", "8 for the tiny release", "42 for MAGI-2",
                     "bf16 on a GPU", "540p for MAGI-2 Preview", "10 for MAGI-2 Preview"):
        assert fragment in " ".join(help_text.split()), fragment
