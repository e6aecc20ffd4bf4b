"""Issue 31 over HTTP: the ``model`` field (point 7) takes the served model's Hugging Face
id and preset names and no answer names a server path; ``--max-time`` (point 1) is a 422."""

from __future__ import annotations

import dataclasses

import pytest

from headmoe.models.magi2 import get_config
from headmoe.pipeline.released import RELEASED_MODEL_ID
from headmoe.serve.validate import RequestError, VideoCreate, admit_body
from tests.serve.test_units import _serve_spec


def test_model_field_takes_the_id_and_presets_never_a_path(tiny_cache, tmp_path):
    from headmoe.release import folder as release

    folder = release.tiny_release(tiny_cache)
    spec = _serve_spec(tiny_cache, tmp_path, "--model", str(folder))
    assert admit_body(VideoCreate(prompt="a fox", model="tiny"), spec).request.prompt == "a fox"
    for bad in (str(folder), folder.name, "magi2-preview", RELEASED_MODEL_ID):
        with pytest.raises(RequestError) as exc:
            admit_body(VideoCreate(prompt="a fox", model=bad), spec)
        message = exc.value.message
        assert exc.value.param == "model" and exc.value.status == 422
        assert str(tiny_cache) not in message.replace(bad, "") and "'tiny'" in message, message
    released = dataclasses.replace(spec, deployment=dataclasses.replace(
        spec.deployment, model_config=get_config("magi2-preview"),
        model="/srv/ckpt/MAGI-2-preview"))
    assert released.model_names == ("magi2-preview", RELEASED_MODEL_ID)
    with pytest.raises(RequestError) as exc:
        admit_body(VideoCreate(prompt="a fox", model="tiny"), released)
    assert "/srv" not in exc.value.message and RELEASED_MODEL_ID in exc.value.message


def test_max_time_over_http_is_422_naming_the_estimate(tiny_cache, tmp_path):
    """A server refuses a request whose time estimate is over --max-time (default 3600 s)."""
    from headmoe.cli.serve import SERVE_MAX_TIME_S

    assert _serve_spec(tiny_cache, tmp_path).deployment.max_time_s == SERVE_MAX_TIME_S
    spec = _serve_spec(tiny_cache, tmp_path, "--max-time", "5")
    admit_body(VideoCreate(prompt="a fox", num_inference_steps=2), spec)
    with pytest.raises(RequestError) as exc:
        admit_body(VideoCreate(prompt="a fox", num_inference_steps=1000), spec)
    assert exc.value.status == 422 and exc.value.param.startswith("num_inference_steps")
    assert "estimated" in exc.value.message and "max_time=5 s" in exc.value.message


def test_max_time_over_http_uses_a_measured_step(tiny_cache, tmp_path):
    """Once a step of the request's cost was measured (a finished job records it), the
    estimate is the measured one and the 422 says so."""
    from headmoe.planner.time import FLOP_RATE, MEASURED, record_steps

    spec = _serve_spec(tiny_cache, tmp_path, "--max-time", "5")
    spec = dataclasses.replace(spec, deployment=dataclasses.replace(
        spec.deployment, step_cache=str(tmp_path / "step_times.json")))
    first = admit_body(VideoCreate(prompt="a fox", num_inference_steps=2), spec)
    assert first.time.source == FLOP_RATE and first.time.seconds < 5
    record_steps(spec.deployment.step_cache, first.time.key, [9.0, 4.0, 4.0])
    with pytest.raises(RequestError) as exc:
        admit_body(VideoCreate(prompt="a fox", num_inference_steps=2), spec)
    assert exc.value.status == 422 and "estimated 8 s (measured steps)" in exc.value.message, exc.value
    other = admit_body(VideoCreate(prompt="a fox", num_inference_steps=2, size="64x64"), spec)
    assert other.time.source == FLOP_RATE  # another size: another cost
    assert first.time.source != MEASURED
