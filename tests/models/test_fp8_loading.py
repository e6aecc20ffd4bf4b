"""FP8 routed experts on load (issue 28 points 1, 2, 5): the format's names and refusals,
quantize-on-load of a rank's own head shard (the bytes of the whole tensor quantized, then
cut), an FP8 checkpoint read as stored, and the casts that are refused."""

import pytest
import torch
from safetensors.torch import load_file, save_file

from headmoe.config import ParallelConfig
from headmoe.distributed.context import ParallelContext
from headmoe.distributed.topology import plan_topology
from headmoe.models.magi2 import Magi2Transformer, check_checkpoint, load_checkpoint
from headmoe.models.magi2.loading import MOE_MARKER, checkpoint_spec, stored_expert_format
from headmoe.moe import MultiHeadMoE
from headmoe.moe.formats import (
    EXPERT_FORMATS,
    check_expert_format,
    format_name,
    resolve_format,
    stored_format,
)
from headmoe.moe.fp8 import quantize
from headmoe.moe.fp8_format import SCALE_SUFFIX, VALUES, Fp8Experts
from headmoe.pipeline.deployment import Deployment
from tests.models.common import SMALL


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    """SMALL's random bf16-layout checkpoint (path, tensors)."""
    from headmoe.models.magi2 import write_random_checkpoint

    path = tmp_path_factory.mktemp("ckpt") / "small.safetensors"
    write_random_checkpoint(SMALL, path, seed=3)
    return path, load_file(path)


def _fp8_state(tensors):
    """The whole checkpoint with every expert weight quantized (values + _scale)."""
    out = {}
    for name, t in tensors.items():
        if MOE_MARKER in name and name.rsplit(".", 1)[-1] in VALUES:
            q = quantize(name, t)
            out[name], out[name + SCALE_SUFFIX] = q.data, q.scale
        else:
            out[name] = t
    return out


def _ep_model(ep_rank, experts=Fp8Experts):
    """SMALL built for SP rank `ep_rank` of SP2 x EP2 (no process groups)."""
    pc = ParallelConfig(ulysses_degree=2, enable_expert_parallel=True, expert_parallel_size=2)
    ctx = ParallelContext(topology=plan_topology(2, pc), rank=ep_rank)
    return Magi2Transformer(SMALL, ctx, dtype=torch.bfloat16, experts=experts)


def _same(a, b):
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8)) \
        if a.dtype == torch.float8_e4m3fn else torch.equal(a, b)


def test_format_names_and_refusals():
    assert set(EXPERT_FORMATS) == {"bf16", "fp8"}
    with pytest.raises(ValueError, match=r"expert_format must be one of 'bf16', 'fp8', got 'fp4'"):
        check_expert_format("fp4")
    with pytest.raises(ValueError, match="expert_format"):
        Deployment(model_config=SMALL, expert_format="fp16")
    assert resolve_format(None, "fp8", "x") == "fp8"
    assert resolve_format(None, "bf16", "x") == "bf16"
    assert resolve_format("fp8", "bf16", "x") == "fp8"  # quantized on load
    with pytest.raises(ValueError, match=r"expert_format='bf16' contradicts the ckpt"):
        resolve_format("bf16", "fp8", "the ckpt")
    spec = checkpoint_spec(SMALL, Fp8Experts)
    assert stored_format(spec) == "fp8" and stored_format(checkpoint_spec(SMALL)) == "bf16"
    name = next(n for n in spec if n.endswith(".moe_mlp.W_down_scale"))
    assert spec[name][1] == torch.float32
    assert spec[name.removesuffix(SCALE_SUFFIX)][1] == torch.float8_e4m3fn


@pytest.mark.parametrize("ep_rank", [0, 1])
def test_quantize_on_load_gives_the_whole_tensors_bytes_cut_to_the_shard(full, tmp_path,
                                                                         ep_rank):
    """A rank quantizes only its rows; they equal the rows of the fully quantized tensor,
    so every layout holds the same FP8 bytes; an FP8 checkpoint loads to the same model."""
    path, tensors = full
    on_load = _ep_model(ep_rank)
    report = load_checkpoint(on_load, path)
    assert report.expert_format == "bf16"
    assert {format_name(m.experts) for m in on_load.modules()
            if isinstance(m, MultiHeadMoE)} == {"fp8"}
    stored = tmp_path / "fp8.safetensors"
    save_file(_fp8_state(tensors), stored)
    assert stored_expert_format(stored) == "fp8"
    direct = _ep_model(ep_rank)
    assert load_checkpoint(direct, stored).expert_format == "fp8"
    reference = _fp8_state(tensors)
    checked = 0
    for name, t in on_load.state_dict().items():
        assert _same(t, direct.state_dict()[name]), name
        if MOE_MARKER in name and name.rsplit(".", 1)[-1].removesuffix(SCALE_SUFFIX) in VALUES:
            moe = on_load.get_submodule(name.rsplit(".", 1)[0])
            ref = reference[name][moe.row_start:moe.row_stop]
            assert _same(t[: ref.shape[0]], ref), name
            checked += 1
    assert checked == 6 * len(SMALL.moe_layer_ids)
    # the non-expert tensors are those of the bf16 model
    bf16 = _ep_model(ep_rank, EXPERT_FORMATS["bf16"])
    load_checkpoint(bf16, path)
    for name, t in bf16.state_dict().items():
        if MOE_MARKER not in name or name.rsplit(".", 1)[-1] not in VALUES:
            assert torch.equal(t, on_load.state_dict()[name]), name


def test_fp8_checkpoint_refuses_a_bf16_model_and_casts(full, tmp_path):
    path, tensors = full
    stored = tmp_path / "fp8.safetensors"
    save_file(_fp8_state(tensors), stored)
    with pytest.raises(ValueError, match=r"fp8-e4m3, which a model of expert_format='bf16' "):
        load_checkpoint(Magi2Transformer(SMALL, dtype=torch.bfloat16), stored)
    # an FP8 tensor where the bf16 layout has bf16 (no scales: read as the bf16 format)
    name = next(n for n in tensors if n.endswith(".moe_mlp.W_up"))
    bad = dict(tensors, **{name: tensors[name].to(torch.float8_e4m3fn)})
    save_file(bad, tmp_path / "cast.safetensors")
    with pytest.raises(ValueError, match=rf"1 tensors to or from FP8, which are never cast: "
                                         rf"{name} expected \[.*\] BF16, found F8_E4M3"):
        check_checkpoint(SMALL, tmp_path / "cast.safetensors")
    # a NaN byte in stored FP8 values is refused by name
    nan = _fp8_state(tensors)
    raw = nan[name].view(torch.uint8).clone()
    raw.view(-1)[5] = 0x7F
    nan[name] = raw.view(torch.float8_e4m3fn)
    save_file(nan, tmp_path / "nan.safetensors")
    with pytest.raises(ValueError, match=rf"{name}: 1 NaN byte"):
        load_checkpoint(Magi2Transformer(SMALL, dtype=torch.bfloat16, experts=Fp8Experts),
                        tmp_path / "nan.safetensors")


def test_streaming_refuses_another_format_than_stored(full):
    from headmoe.models.magi2.loading import stream_layers

    with pytest.raises(ValueError, match="offload_layers streams the stored bytes of .*, "
                                         "whose experts are bf16: expert_format='fp8'"):
        stream_layers(SMALL, ParallelContext.single(), torch.bfloat16, full[0],
                      experts=Fp8Experts)
