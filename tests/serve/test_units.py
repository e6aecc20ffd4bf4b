"""In-process pieces of the server: flag checks, the rank-side job outcomes (a failing
request, cancellation, drain) with a test-only denoiser, and the JSON wire over 2 ranks."""

from types import SimpleNamespace

import pytest

from headmoe.cli.main import main
from headmoe.distributed.context import ParallelContext
from headmoe.pipeline.deployment import Deployment
from headmoe.pipeline.request import GenerateRequest
from headmoe.serve import wire
from headmoe.serve.spec import ServeSpec
from headmoe.serve.worker import Leader, bind, run_one
from headmoe.testing import run_ranks
from tests.pipeline.fake import fake_components

#: a server deployment of a stand-in model (no weights)
FAKE_DEPLOYMENT = Deployment(model_config=SimpleNamespace(name="fake"), model="tiny",
                             dtype="fp32")


@pytest.mark.parametrize("flags, expected", [
    (["--nproc", "3", "--data-parallel-size", "2"], "--nproc has 3 ranks but the layout needs"),
    (["--nproc", "4", "--ulysses-degree", "4", "--enable-expert-parallel",
      "--expert-parallel-size", "3"], "--expert-parallel-size=3 must divide --ulysses-degree=4"),
    (["--nproc", "2"], "--nproc has 2 ranks but the layout needs"),
    (["--api-key", " "], "--api-key must not be empty"),
    (["--max-queue", "0"], "--max-queue must be >= 1, got 0"),
    (["--port", "70000"], "--port must be in [0, 65535], got 70000"),
    (["--drain-timeout", "0"], "--drain-timeout must be > 0 seconds"),
    (["--timeout", "-1"], "--timeout must be at least 1 s"),
    (["--memory-gib", "0.001"], "the weights alone do not fit: --model tiny (config tiny): "
                                "--height=16, --width=16, --num-frames=1 need an estimated"),
    (["--memory-gib", "inf"], "--max-memory-gib must be a number of GiB in [0, 1,048,576]"),
    (["--memory-gib", "nan"], "--max-memory-gib must be a number of GiB in [0, 1,048,576]"),
    (["--max-memory-gib", "-1"], "--max-memory-gib must be a number of GiB in [0, 1,048,576]"),
    (["--host", "no such host!"], "--host 'no such host!' is not a valid address"),
    (["--output-dir", "/etc/hostname/videos"],
     "--output-dir '/etc/hostname/videos': '/etc/hostname' is not a folder"),
    (["--nproc", "0"], "--nproc must be a positive number of ranks, got 0"),
    (["--api-key-file", "/nonexistent/key"], "--api-key-file '/nonexistent/key': No such file"),
    (["--api-key", "k", "--api-key-file", "f"], "give --api-key or --api-key-file, not both"),
    (["--resident-layers", "2"], "--resident-layers 2 needs --offload-layers"),
])
def test_bad_flags_exit_2_before_any_rank(flags, expected, tiny_cache, tmp_path, capsys):
    code = main(["serve", "--cache-dir", str(tiny_cache), "--output-dir", str(tmp_path / "o"),
                 *flags])
    err = capsys.readouterr().err
    assert code == 2 and expected in err, err
    assert not (tmp_path / "o").exists()


class Boom:
    def __call__(self, branches):
        raise RuntimeError("boom on the ranks")


def test_rank_outcomes_fail_cancel_complete_then_drain(tmp_path):
    spec = ServeSpec(deployment=FAKE_DEPLOYMENT, output_dir=str(tmp_path),
                     port=0, tick_s=0.01)
    leader = Leader(spec, bind("127.0.0.1", 0))
    ctx = ParallelContext.single()
    good = fake_components(ctx, None)
    bad = fake_components(ctx, None)
    bad.denoiser = Boom()
    store, req = leader.store, GenerateRequest(prompt="x", num_inference_steps=3)
    jobs = [store.submit(req) for _ in range(3)]
    for parts, job in zip((bad, good, good), jobs):
        cmd = leader.next_command()
        assert cmd["op"] == "run" and cmd["id"] == job.id
        if job is jobs[1]:
            job.cancel_requested = True  # as DELETE sets it while the job runs
        run_one(ctx, parts, spec, cmd, leader)
    failed, cancelled, done = jobs
    assert failed.status == "failed" and failed.error == "rank 0: RuntimeError: boom on the ranks"
    assert cancelled.status == "cancelled" and cancelled.steps_done == 1
    assert done.status == "completed" and done.steps_done == 3
    assert done.result["server"]["model_loads"] == 0 and done.result["video_sha256"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{done.id}.json", f"{done.id}.mp4"]
    assert leader.next_command() == {"op": "idle"}
    leader.drain_requested = True
    assert leader.next_command() == {"op": "stop"} and store.draining
    leader.sock.close()


def _wire(rank, world_size):
    got = wire.broadcast_json({"fox": "🦊", "x": [1, 2.5, None]} if rank == 0 else None)
    flag = wire.broadcast_flag(rank == 0)
    gathered = wire.all_gather_json({"rank": rank, "text": "é" * rank})
    return got, flag, gathered


def test_wire_moves_json_between_ranks():
    for got, flag, gathered in run_ranks(_wire, 2, timeout=120):
        assert got == {"fox": "🦊", "x": [1, 2.5, None]} and flag is True
        assert gathered == [{"rank": 0, "text": ""}, {"rank": 1, "text": "é"}]


def test_streamed_layers_reach_every_served_job(tiny_cache, tmp_path):
    from headmoe.cli.main import build_parser
    from headmoe.cli.serve import build_spec
    from headmoe.deployment import stream_of

    args = build_parser().parse_args(["serve", "--cache-dir", str(tiny_cache), "--output-dir",
                                      str(tmp_path / "o"), "--offload-layers",
                                      "--resident-layers", "1"])
    spec, world = build_spec(args)
    job = spec.job(GenerateRequest(prompt="a fox"), None, {})
    assert world == 1 and job.offload_layers and job.resident_layers == 1
    assert stream_of(spec.deployment).resident_layers == 1  # admitted with the streamed estimate


def _serve_spec(tiny_cache, tmp_path, *flags):
    from headmoe.cli.main import build_parser
    from headmoe.cli.serve import build_spec

    args = build_parser().parse_args(["serve", "--cache-dir", str(tiny_cache), "--output-dir",
                                      str(tmp_path / "o"), *flags])
    return build_spec(args)[0]


def test_1080p_admitted_with_refiner_refused_without(tiny_cache, tmp_path):
    """resolution "1080p" and the refiner fields go through generate's admission: on the
    tiny release (refiner/) the stage is admitted and loaded; on a bare transformer
    checkpoint (no refiner) the request is refused naming the field."""
    from headmoe.pipeline.refine import RefinerStage
    from headmoe.serve.validate import RequestError, VideoCreate, admit_body

    spec = _serve_spec(tiny_cache, tmp_path)
    assert spec.deployment.has_refiner and spec.deployment.refiner_config is not None
    body = VideoCreate(prompt="a fox", resolution="1080p", refiner_height=64,
                       refiner_width=96, refiner_steps=2)
    admitted = admit_body(body, spec)
    assert admitted.refiner == RefinerStage(64, 96, 2)
    assert (admitted.request.height, admitted.request.width) == (512, 896)  # 540p preview
    assert admit_body(VideoCreate(prompt="a fox", resolution="1080p"), spec).refiner == \
        RefinerStage()  # 1088 x 1920, the released steps
    job = spec.job(admitted.request, None, {}, refiner=admitted.refiner)
    assert job.refiner == admitted.refiner
    bare = _serve_spec(tiny_cache, tmp_path, "--model", spec.deployment.checkpoint)
    assert not bare.deployment.has_refiner
    for given, field in (({"resolution": "1080p"}, "resolution"),
                         ({"refiner_steps": 2}, "refiner_steps")):
        with pytest.raises(RequestError) as exc:
            admit_body(VideoCreate(prompt="a fox", **given), bare)
        assert exc.value.param == field and exc.value.status == 422
        assert field in exc.value.message and "refiner" in exc.value.message


def test_request_schema_is_admissions_fields():
    """The body's fields are admission's (`INPUT_FIELDS`, as generate's flags) plus model,
    less dtype (the server's ``--dtype``)."""
    from headmoe.admission import INPUT_FIELDS
    from headmoe.serve.validate import VideoCreate

    assert set(VideoCreate.model_fields) == {*INPUT_FIELDS, "model"} - {"dtype"}
