"""Layer streaming on CPU (issue 20): same bytes as the resident model, at most K layers'
weights materialised at once, bytes moved as the planner predicts, and an EP rank reads
only the expert rows of its own shard."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from headmoe.config import ParallelConfig
from headmoe.distributed import ParallelContext
from headmoe.distributed.topology import AXES, plan_topology
from headmoe.models.magi2 import Magi2Transformer, load_checkpoint, write_random_checkpoint
from headmoe.models.magi2.loading import layer_reads, stream_layers
from headmoe.models.streaming import local_tensor, split_layers
from headmoe.moe import moe_row_slice
from headmoe.planner.memory import StreamSettings, stream_estimate
from tests.models.common import SMALL, make_request

CFG = replace(SMALL, num_layers=5, multimodal_layers=(0, 3))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("stream") / "model.safetensors"
    write_random_checkpoint(CFG, path, seed=7)  # bf16 linears and experts, as released
    return str(path)


@pytest.fixture(scope="module")
def request_():
    return make_request(CFG, 1, (2, 4, 6), 8, (5, 3))


def _resident(ckpt, dtype, req):
    model = Magi2Transformer(CFG, ParallelContext.single(), dtype=dtype)
    load_checkpoint(model, ckpt)
    return model(req)


def _meta(t: torch.Tensor) -> bool:
    return t.is_meta


@pytest.mark.parametrize(("dtype", "slots", "resident"), [
    (torch.float32, 2, 0),  # bf16 stored, cast to fp32 on the way into the slot
    (torch.bfloat16, 1, 1),
    (torch.bfloat16, 3, 2),
])
def test_same_bytes_at_most_k_layers_and_bytes_moved(ckpt, request_, dtype, slots, resident):
    want = _resident(ckpt, dtype, request_)
    ctx = ParallelContext.single()
    model, streamer = stream_layers(CFG, ctx, dtype, ckpt, resident_layers=resident,
                                    slots=slots)
    streamed = split_layers(CFG.num_layers, resident)[1]
    layers = model.block.layers
    slot_ptrs = {b.untyped_storage().data_ptr() for b in streamer.host}
    seen = []

    def check(module, args):
        """At the start of every layer: which streamed layers hold real tensors, and where."""
        live = [i for i in streamed
                if not all(_meta(t) for t in [*layers[i].parameters(), *layers[i].buffers()])]
        for i in live:
            for t in [*layers[i].parameters(), *layers[i].buffers()]:
                assert t.untyped_storage().data_ptr() in slot_ptrs  # a view of a slot
        seen.append((len(live), len(streamer.materialised())))

    for layer in layers:
        layer.register_forward_pre_hook(check)
    try:
        for step in range(2):
            before = sum(ctx.counters.streamed_bytes)
            got = model(request_)
            moved = sum(ctx.counters.streamed_bytes) - before
            for a, b in zip(want, got):
                assert torch.equal(a.video, b.video) and torch.equal(a.audio, b.audio)
            est = stream_estimate(CFG, 1, 0, dtype, StreamSettings(resident, slots))
            if step:  # the first forward fills the slots; then each forward moves this
                assert moved == est.bytes_per_step  # the planner's bytes per step
        # resident layers are real tensors outside the slots
        for i in range(resident):
            assert not any(_meta(t) for t in layers[i].parameters())
        assert len(streamer.host) == min(slots, len(streamed))
        assert len(streamer.host) * streamer.slot_bytes == est.in_flight_bytes
        assert all(b.numel() == streamer.slot_bytes for b in streamer.host)
        # while a streamed layer runs it is the only one bound, at most K are filled
        assert len(seen) == 2 * CFG.num_layers
        assert max(live for live, _ in seen) == (1 if streamed else 0)
        assert max(filled for _, filled in seen) <= slots
        # after the forward no streamed layer holds weights of its own
        assert all(_meta(t) for i in streamed for t in layers[i].parameters())
    finally:
        streamer.close()


def test_forward_after_a_failed_layer_resyncs(ckpt, request_):
    """A forward that stops in a layer leaves no layer bound; the next one is exact."""
    want = _resident(ckpt, torch.bfloat16, request_)
    model, streamer = stream_layers(CFG, ParallelContext.single(), torch.bfloat16, ckpt)

    def boom(module, args, output):
        raise RuntimeError("layer 2 failed")

    handle = model.block.layers[2].register_forward_hook(boom)
    with pytest.raises(RuntimeError, match="layer 2 failed"):
        model(request_)
    handle.remove()
    assert not streamer.bound
    got = model(request_)
    assert all(torch.equal(a.video, b.video) for a, b in zip(want, got))
    streamer.close()


def _ep_context(ep_size: int, ep_rank: int) -> ParallelContext:
    """A group-less context of EP rank `ep_rank` in an SP group of `ep_size` (shapes and
    loading only; no forward)."""
    par = ParallelConfig(ulysses_degree=ep_size, enable_expert_parallel=True)
    return ParallelContext(topology=plan_topology(ep_size, par), rank=ep_rank,
                           _groups={a: None for a in AXES})


@pytest.mark.parametrize(("ep_size", "ep_rank"), [(2, 1), (4, 2), (8, 5), (8, 7)])
def test_rank_reads_only_its_expert_rows(ckpt, ep_size, ep_rank):
    from safetensors import safe_open

    ctx = _ep_context(ep_size, ep_rank)
    model, streamer = stream_layers(CFG, ctx, torch.bfloat16, ckpt, slots=1)
    heads, experts = CFG.moe_num_heads, CFG.moe_num_experts
    start, stop, local = moe_row_slice(heads, experts, ep_size, ep_rank)
    checked = set()
    with safe_open(ckpt, framework="pt") as f:
        for i in CFG.moe_layer_ids:
            with streamer.use(i) as layer:
                for read in layer_reads(model, i):
                    if ".moe_mlp." not in read.name:
                        continue
                    full = f.get_tensor(read.key)
                    mine = local_tensor(layer, read.name)
                    assert mine.shape[0] == local
                    assert torch.equal(mine[: stop - start], full[start:stop].to(mine.dtype))
                    assert not mine[stop - start :].any()  # padded heads are zeros
                    row = full[0].numel() * full.element_size()
                    got = streamer.source.read_ranges.get(read.key)
                    # the lowest and highest byte read of this tensor: its shard's rows only
                    assert got == (start * row, stop * row) or (start == stop and got in (
                        None, (start * row, start * row))), (read.key, got)
                    checked.add(read.key)
    # gate, W_gate, W_up, W_down and the EMA bias (the selection bias takes its values)
    assert len(checked) == len(CFG.moe_layer_ids) * 5
    assert {k for k in streamer.source.read_ranges if ".moe_mlp." in k} == checked
    streamer.close()


def test_bad_settings_are_refused_before_allocating(ckpt):
    with pytest.raises(ValueError, match=r"resident_layers must be an int in \[0, 5\].*got 6"):
        stream_layers(CFG, ParallelContext.single(), torch.bfloat16, ckpt, resident_layers=6)
    with pytest.raises(ValueError, match="slots .* must be an int >= 1, got 0"):
        stream_layers(CFG, ParallelContext.single(), torch.bfloat16, ckpt, slots=0)


def test_refiner_layers_stream_through_the_same_streamer(tmp_path):
    """The refiner's loop calls a layer's parts, not the layer: `present` binds it. Same
    bits as the resident refiner, at most K layers filled, one bound at a time."""
    from headmoe.models.refiner import (
        Magi2Refiner,
        get_refiner_config,
        load_refiner,
        write_random_refiner,
    )
    from headmoe.models.refiner.loading import stream_refiner

    cfg = get_refiner_config("tiny-refiner")
    path = tmp_path / "refiner.safetensors"
    write_random_refiner(cfg, path, seed=3)
    g = torch.Generator().manual_seed(0)
    video = torch.randn(cfg.video_in_channels, 2, 4, 6, generator=g)
    text = torch.randn(5, cfg.text_in_channels, generator=g)
    resident = Magi2Refiner(cfg, dtype=torch.bfloat16)
    load_refiner(resident, path)
    want = resident(video, text)
    model, streamer = stream_refiner(cfg, ParallelContext.single(), torch.bfloat16, path,
                                     resident_layers=1, slots=2)
    layers, seen = model.block.layers, []

    def check(module, args):
        bound = [i for i in range(1, cfg.num_layers)
                 if not any(_meta(t) for t in layers[i].parameters())]
        seen.append((len(bound), len(streamer.materialised())))

    for layer in layers:
        layer.attention.register_forward_pre_hook(check)
    try:
        for _ in range(2):
            assert torch.equal(model(video, text), want)
        assert len(seen) == 2 * cfg.num_layers
        assert max(b for b, _ in seen) == 1 and max(f for _, f in seen) <= 2
        moved = sum(p.moved for p in streamer.order)
        assert sum(model.context.counters.streamed_bytes[-(cfg.num_layers - 1):]) == moved
    finally:
        streamer.close()


# ------------------------------- a checkpoint changed under a streamed run (issue 32 point 4)
def _one_tensor_file(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "shard.safetensors"
    save_file({"w": torch.arange(64 * 1024, dtype=torch.float32).reshape(64, 1024)}, path)
    return path


@pytest.mark.parametrize("change", ["truncated", "rewritten", "rewritten-same-mtime",
                                    "replaced"])
def test_changed_checkpoint_file_is_named_not_read(tmp_path, change):
    import os

    from headmoe.models.streaming import CheckpointChanged, MappedCheckpoint, TensorRead

    path = _one_tensor_file(tmp_path)
    source = MappedCheckpoint({"w": str(path)})
    dst = torch.empty(64, 1024)
    source.read_into(TensorRead("w", "w"), dst)
    assert torch.equal(dst.view(-1), torch.arange(64 * 1024, dtype=torch.float32))
    st = path.stat()
    if change == "truncated":
        os.truncate(path, st.st_size // 2)  # a mapping would raise SIGBUS on the next read
    elif change == "replaced":
        path.rename(tmp_path / "old")
        path.write_bytes((tmp_path / "old").read_bytes())
    else:
        with open(path, "r+b") as f:  # the same size, in place
            f.seek(st.st_size - 4096)
            f.write(b"\x7f" * 4096)
        if change == "rewritten-same-mtime":
            os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # the change time still moves
    with pytest.raises(CheckpointChanged, match=f"checkpoint file '{path}' (changed|cannot)"):
        source.read_into(TensorRead("w", "w"), dst)
    source.close()
