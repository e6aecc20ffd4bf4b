"""The refiner stage shows its steps (issue 31 point 6): a bar like the preview's on rank
0, and both stages' steps counted together for a server's job progress."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import headmoe.pipeline.job as job_module
from headmoe.pipeline.refine import RefinerStage


def test_refiner_steps_have_a_bar_and_reach_on_step(monkeypatch, capsys):
    def fake_stage(ctx, model, xv, texts, generator, height, width, steps, on_step):
        for i in range(steps):
            on_step(i + 1, steps)
        return xv, [0.0] * steps

    monkeypatch.setattr(job_module, "refine_stage", fake_stage)
    job = SimpleNamespace(refiner=RefinerStage(64, 96, 3), progress=True,
                          request=SimpleNamespace(num_inference_steps=4))
    parts = SimpleNamespace(refiner=SimpleNamespace(active=lambda: contextlib.nullcontext(None)))
    seen = []
    job_module.refine(SimpleNamespace(rank=0), job, parts, SimpleNamespace(generator=None),
                      None, [], lambda done, total: seen.append((done, total)))
    assert seen == [(5, 7), (6, 7), (7, 7)]
    err = capsys.readouterr().err
    assert "refining 96x64" in err and "3/3" in err, err
