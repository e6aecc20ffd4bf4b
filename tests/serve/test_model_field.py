"""The HTTP ``model`` field (issue 31 point 7): the served model's Hugging Face id and preset
names are accepted, and no answer names a server path."""

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
    released = dataclasses.replace(spec, model_config=get_config("magi2-preview"),
                                   model="/srv/ckpt/MAGI-2-preview")
    assert released.model_names == ("magi2-preview", RELEASED_MODEL_ID)
    with pytest.raises(RequestError) as exc:
        admit_body(VideoCreate(prompt="a fox", model="tiny"), released)
    assert "/srv" not in exc.value.message and RELEASED_MODEL_ID in exc.value.message
