"""Issue 27 points 1-2: one flag table (`headmoe.cli.flags`), one `Deployment` builder
(`headmoe.deployment.build_deployment`) called once per command, then one `admit`."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import pickle
from pathlib import Path

import pytest
import torch

import headmoe.cli.compare as compare_cli
import headmoe.cli.generate as generate_cli
import headmoe.cli.serve as serve_cli
from headmoe import admission
from headmoe.admission import INPUT_FIELDS
from headmoe.cli import flags
from headmoe.cli.main import build_parser
from headmoe.config import ParallelConfig
from headmoe.deployment import DeploymentOptions, build_deployment
from headmoe.errors import Refusal
from headmoe.models.magi2 import get_config
from headmoe.pipeline.deployment import Deployment
from headmoe.release.folder import tiny_release

CLI = Path(__file__).resolve().parents[2] / "src" / "headmoe" / "cli"


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cache")
    tiny_release(folder)
    return folder


def test_every_flag_sets_a_real_field_of_its_owner():
    for flag in flags.FLAGS:
        if flag.owner != flags.COMMAND:
            assert flag.dest in flags.OWNER_FIELDS[flag.owner], flag
    assert set(flags.LAYOUT_FIELDS) == {f.name for f in dataclasses.fields(ParallelConfig)}
    assert {f.dest for f in flags.FLAGS if f.owner == flags.REQUEST} == set(INPUT_FIELDS)
    assert len(flags.BY_DEST) == len(flags.FLAGS)  # each flag declared once


def test_the_subcommands_take_their_flags_from_the_table():
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name in ("generate", "serve"):
        for action in sub.choices[name]._actions:
            if action.dest in flags.BY_DEST:
                assert action.option_strings[0] == flags.BY_DEST[action.dest].option
    generate = {a.dest for a in sub.choices["generate"]._actions}
    serve = {a.dest for a in sub.choices["serve"]._actions}
    # generate has every flag but serve's own, which serve has
    assert {f.dest for f in flags.FLAGS} - set(flags.SERVE_ONLY) <= generate
    assert set(flags.SERVE_ONLY) <= serve and not set(flags.SERVE_ONLY) & generate


def test_a_refusal_field_maps_to_its_flags_through_the_table():
    assert flags.refusal_flags("num_frames") == ["--num-frames"]
    assert flags.refusal_flags("seconds,num_frames") == ["--seconds", "--num-frames"]
    assert flags.refusal_flags("height,width,num_frames") == ["--height", "--width",
                                                              "--num-frames"]
    assert flags.flag_of("world_size") == "--nproc"
    for name in INPUT_FIELDS:
        assert flags.flag_of(name) == "--" + name.replace("_", "-")
    with pytest.raises(Refusal) as info:
        admission.admit({"prompt": "x", "num_frames": 14},
                        Deployment(model_config=get_config("tiny")))
    assert flags.as_flags(info.value.message, True).startswith("--num-frames=14 must be")
    assert flags.refusal_flags(info.value.field) == ["--num-frames"]


def test_deployment_is_frozen_keyword_only_and_checks_its_timeout():
    with pytest.raises(TypeError):
        Deployment(get_config("tiny"))  # keyword-only
    dep = Deployment(model_config=get_config("tiny"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        dep.device = "cuda"
    with pytest.raises(ValueError, match="timeout must be at least 1 s"):
        Deployment(model_config=get_config("tiny"), timeout_s=0.5)
    with pytest.raises(ValueError, match="resident_layers=2 needs offload_layers"):
        Deployment(model_config=get_config("tiny"), resident_layers=2)


def test_build_deployment_from_the_options(cache):
    dep = build_deployment(DeploymentOptions(cache_dir=str(cache), max_memory_gib=2.0,
                                             timeout=30.0))
    assert dep.model == "tiny" and dep.model_config.name == "tiny"
    assert dep.release is not None and dep.checkpoint == dep.release.transformer
    assert dep.budget.limit == 2 << 30 and dep.budget.source == "--max-memory-gib"
    assert dep.timeout_s == 30.0 and dep.refiner_config is not None
    assert not dep.resident_refiner and dep.dtype is None
    server = build_deployment(DeploymentOptions(cache_dir=str(cache), server=True,
                                                image_encoder=None))
    assert server.resident_refiner and server.dtype == "fp32"  # the tiny recipe's
    only = build_deployment(DeploymentOptions(cache_dir=str(cache), config_only=True))
    assert only.release is None and only.budget.limit is None and only.describe == ""
    with pytest.raises(ValueError, match="--nproc has 2 ranks but the layout needs"):
        build_deployment(DeploymentOptions(cache_dir=str(cache), nproc=2))


def test_attention_flag_reaches_the_forward_plan(cache):
    """``--attention``: CPU ranks run the default path under auto / triton and refuse flash
    by name, before any rank starts; the Deployment's path reaches the model's plan."""
    from headmoe.models.magi2 import Magi2Transformer
    from headmoe.models.magi2.packing import BranchInput, pack_branches

    args = build_parser().parse_args(["generate", "--cache-dir", str(cache), "--prompt", "x"])
    assert args.attention == "auto"
    assert build_deployment(flags.options_of(args)).attention == "triton"
    args = build_parser().parse_args(["generate", "--cache-dir", str(cache), "--prompt", "x",
                                      "--attention", "flash"])
    with pytest.raises(ValueError, match="attention=flash needs CUDA ranks") as e:
        build_deployment(flags.options_of(args))
    assert flags.as_flags(str(e.value)).startswith("--attention=flash needs CUDA ranks")
    with pytest.raises(ValueError, match="attention must be one of"):
        Deployment(model_config=get_config("tiny"), attention="auto")
    cfg = get_config("tiny")
    model = Magi2Transformer(cfg, attention="flash")
    branch = BranchInput(torch.zeros(2, 2, 2, cfg.video_in_channels), torch.zeros(3, cfg.audio_in_channels),
                         torch.zeros(4, cfg.text_in_channels), 0.5, 0.5)
    assert model.plan(pack_branches([branch], cfg)).attention == "flash"
    with pytest.raises(ValueError, match="attention must be one of"):
        Magi2Transformer(cfg, attention="auto")


def test_cuda_graphs_flag_is_off_by_default_and_refused_on_cpu_before_any_rank(cache, tmp_path):
    """``--cuda-graphs``: default off (the Deployment's field, recorded in the sidecar's
    layout); on CPU ranks generate's `build_job` and serve's `build_spec` (which run before
    any rank starts) raise a ValueError naming the flag and the device."""
    base = ["--cache-dir", str(cache)]
    args = build_parser().parse_args(["generate", *base, "--prompt", "x"])
    assert args.cuda_graphs is False
    assert build_deployment(flags.options_of(args)).cuda_graphs is False
    for argv in (["generate", *base, "--prompt", "x", "--cuda-graphs"],
                 ["serve", *base, "--output-dir", str(tmp_path / "v"), "--cuda-graphs"]):
        args = build_parser().parse_args(argv)
        assert args.cuda_graphs is True
        build = generate_cli.build_job if argv[0] == "generate" else serve_cli.build_spec
        with pytest.raises(ValueError, match=r"--cuda-graphs needs CUDA ranks; the ranks run "
                           r"on device='cpu'"):
            build(args)


def test_the_flash_path_runs_in_the_model(monkeypatch):
    """With the flash backends stood in for by the math definition (CPU), a forward of
    ``attention="flash"`` goes through `flash_segment_attention` in every layer and agrees
    with the default path."""
    from headmoe.layers import flash_attention as fa
    from headmoe.models.magi2 import Magi2Transformer
    from headmoe.models.magi2.packing import BranchInput

    calls = []
    real = fa.flash_segment_attention

    def stand_in(qkv, segments, sinks, scale):
        calls.append(len(segments))
        return real(qkv, segments, sinks, scale, backend=fa.math_backend)

    cfg = get_config("tiny")
    g = torch.Generator().manual_seed(0)
    outs = {}
    for path in ("triton", "flash"):
        model = Magi2Transformer(cfg, attention=path)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.1)
        branch = BranchInput(torch.randn(2, 2, 2, cfg.video_in_channels, generator=g),
                             torch.randn(3, cfg.audio_in_channels, generator=g),
                             torch.randn(4, cfg.text_in_channels, generator=g), 0.5, 0.5)
        g.manual_seed(0)
        monkeypatch.setattr(fa, "flash_supported", lambda q, on=path == "flash": on)
        monkeypatch.setattr(fa, "flash_segment_attention", stand_in)
        outs[path] = model([branch])[0]
    assert len(calls) == cfg.num_layers
    assert torch.allclose(outs["flash"].video, outs["triton"].video, rtol=1e-4, atol=1e-5)
    assert not torch.equal(outs["triton"].video, torch.zeros_like(outs["triton"].video))


def _counting(monkeypatch, module, name):
    calls = []
    real = getattr(module, name)

    def counted(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def test_generate_builds_once_admits_once_and_the_job_pickles(cache, tmp_path, monkeypatch):
    built = _counting(monkeypatch, generate_cli, "build_deployment")
    admitted = _counting(monkeypatch, generate_cli, "admit")
    args = build_parser().parse_args(["generate", "--cache-dir", str(cache), "--prompt", "a fox",
                                      "--output", str(tmp_path / "o.mp4")])
    job, world = generate_cli.build_job(args)
    assert len(built) == 1 and len(admitted) == 1 and world == 1
    assert job.deployment is admitted[0][1]  # the job runs on the deployment admitted on
    back = pickle.loads(pickle.dumps(job))  # it travels to spawned ranks
    assert back.request == job.request and back.deployment.parallel == job.parallel


def test_serve_builds_once_admits_once(cache, tmp_path, monkeypatch):
    built = _counting(monkeypatch, serve_cli, "build_deployment")
    admitted = _counting(monkeypatch, serve_cli, "admit")
    args = build_parser().parse_args(["serve", "--cache-dir", str(cache), "--output-dir",
                                      str(tmp_path / "v")])
    spec, world = serve_cli.build_spec(args)
    assert len(built) == 1 and len(admitted) == 1 and world == 1
    assert spec.deployment.dtype == "fp32" and spec.deployment.resident_refiner
    assert pickle.loads(pickle.dumps(spec)).deployment.model == "tiny"


def test_compare_builds_once_admits_once_per_layout(cache, monkeypatch):
    built = _counting(monkeypatch, compare_cli, "build_deployment")
    admitted = _counting(monkeypatch, compare_cli, "admit")
    args = build_parser().parse_args(["compare", "--cache-dir", str(cache), "--prompt", "a fox",
                                      "--layouts", "sp2", "sp2,cfg2"])
    compare_cli.check_request(args)
    assert len(built) == 1 and len(admitted) == 2
    assert [a[1].parallel.world_size for a in admitted] == [2, 4]


def _cli_imports(path: Path) -> set[str]:
    """The cli modules ``path`` imports, at module or function level."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        out |= {n.split(".")[2] for n in names
                if n.startswith("headmoe.cli.") and (CLI / f"{n.split('.')[2]}.py").exists()}
    return out - {path.stem}


def test_no_import_cycle_in_the_cli():
    graph = {p.stem: _cli_imports(p) for p in CLI.glob("*.py")}

    def visit(node, trail):
        assert node not in trail, " -> ".join([*trail, node])
        for nxt in graph.get(node, ()):
            visit(nxt, [*trail, node])

    for module in graph:
        visit(module, [])


def test_refusal_text_shows_the_refusal_fields_from_the_table():
    text = "seconds=4 at fps=12.5 means num_frames=49, which contradicts num_frames=14"
    assert flags.refusal_text("seconds,num_frames", text) == (
        "--seconds=4 at --fps=12.5 means --num-frames=49, which contradicts --num-frames=14")
    quoted = "seed=5 (ValueError: seed=3)"
    assert flags.refusal_text("seed", quoted) == "--seed=5 (ValueError: seed=3)"
