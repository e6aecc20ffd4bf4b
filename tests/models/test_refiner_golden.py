"""headmoe's MAGI-2 refiner against golden/magi2_refiner: the released tensor list, the
packing (token order, coordinates, blocks, visibility), the mask, the RoPE table, every
layer's state and the outputs in fp32 (1e-4), and the released bf16 dtype flow."""

import pytest
import torch
from safetensors.torch import load_file

from headmoe.layers.range_attention import range_attention_reference
from headmoe.layers.rope import default_bands, rope_table
from headmoe.models.refiner import (
    attention_plan,
    get_refiner_config,
    pack_refiner,
    refiner_parameter_count,
    refiner_spec,
    refiner_weight_bytes,
    unpack_video,
)
from tests.goldens import golden_file
from tests.models.refiner_golden import (
    BF16_MAX,
    BF16_RMS,
    FORWARD_CASES,
    NAME,
    ROPE_TOL,
    TOL,
    dense_mask_from_rectangles,
    golden_config,
    golden_json,
    golden_model,
    load_case,
    max_abs,
    released_rows,
)

#: compares against golden/ (run under both CPU dispatches by tests/test_golden_dispatch.py)
pytestmark = pytest.mark.golden

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}


@pytest.fixture(scope="module")
def fp32_model():
    return golden_model(torch.float32)


@pytest.fixture(scope="module")
def bf16_model():
    return golden_model(torch.bfloat16)


def _packed(name):
    d = load_case(name)
    return d, pack_refiner(d["in.video_latent"][0], d["in.text"][0], golden_config())


def test_released_tensor_list_exact():
    cfg = get_refiner_config("magi2-refiner")
    mine = [(k, s, DTYPE_NAMES[d]) for k, (s, d) in refiner_spec(cfg).items()]
    assert mine == released_rows()
    release = golden_json("cases.json")["release"]
    assert len(mine) == release["num_tensors"] == 281
    assert refiner_parameter_count(cfg) == release["num_params"] == 6_720_075_280
    by_dtype = {}
    for _, shape, dtype in mine:
        by_dtype[dtype] = by_dtype.get(dtype, 0) + torch.Size(shape).numel()
    assert by_dtype == release["params_by_dtype"]
    assert refiner_weight_bytes(cfg) == 6_697_844_736 * 2 + 22_230_544 * 4


def test_config_matches_released_fields():
    cfg = get_refiner_config("magi2-refiner")
    arch = golden_json("cases.json")["release"]["arch"]
    assert (cfg.num_layers, cfg.hidden_size, cfg.head_dim, cfg.num_query_groups) == (
        arch["num_layers"], arch["hidden_size"], arch["head_dim"], arch["num_query_groups"])
    assert list(cfg.multimodal_layers) == arch["mm_layers"]
    assert (cfg.num_attention_heads, cfg.intermediate_size, cfg.rope_bands) == (32, 10920, 16)
    window = golden_json("config.json")["data_proxy"]["attn_config"]
    assert cfg.block_size == (window["block_t_size"], window["block_size"], window["block_size"])
    w = window["window"]
    assert cfg.radius == (w["block_t_radius"], w["block_h_radius"], w["block_w_radius"])
    assert golden_config().intermediate_size == 168


@pytest.mark.parametrize("name", FORWARD_CASES)
def test_packing_exact(name):
    d, p = _packed(name)
    assert torch.equal(p.token_order, d["packed.token_order"])
    assert torch.equal(p.coords, d["packed.coords"])
    assert list(p.grid.grid) == d["attn.block_grid"].tolist()
    assert torch.equal(p.block_ranges.to(torch.int32), d["attn.block_ranges"])
    assert torch.equal(p.grid.block_visible(), d["attn.block_visible"])
    bands = load_file(golden_file(NAME, "model.safetensors"))["pre_adapter.rope.bands"]
    assert torch.equal(bands, default_bands(golden_config().rope_bands))
    assert max_abs(rope_table(p.coords, bands), d["trace.rope"]) <= ROPE_TOL


@pytest.mark.parametrize("name", FORWARD_CASES)
def test_attention_plan_is_the_mask(name):
    """The plan's (tile x key ranges) cover exactly upstream's rectangles, each cell once,
    and the CPU path equals one dense masked softmax."""
    d, p = _packed(name)
    n = p.num_tokens
    plan = attention_plan(p)
    plan.validate()
    covered = torch.zeros(n, n, dtype=torch.int32)
    for r, (a, b) in enumerate(plan.q_tiles.tolist()):
        for ka, kb in plan.keys_of(r):
            covered[a:b, ka:kb] += 1
    assert int(covered.max()) == 1
    want = dense_mask_from_rectangles(d["attn.q_ranges"], d["attn.k_ranges"], n)
    assert torch.equal(covered.bool(), want)
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(n, h, 16, generator=g) for h in (4, 2, 2))
    got = range_attention_reference(q, k, v, plan, 0.25)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.repeat_interleave(2, 1).transpose(0, 1),
        v.repeat_interleave(2, 1).transpose(0, 1), attn_mask=want, scale=0.25).transpose(0, 1)
    assert max_abs(got, ref) <= 1e-6


@pytest.mark.parametrize("name", FORWARD_CASES)
def test_fp32_forward_and_traces(fp32_model, name):
    d, p = _packed(name)
    trace = {}
    out = unpack_video(fp32_model.forward_packed(p, trace), p, 48)
    assert max_abs(out, d["out.video"][0]) <= TOL
    traced = [k for k in d if k.startswith("trace.") and k != "trace.rope"]
    assert (len(traced) == 13) == (name == "forward_masked")
    for key in traced:
        assert max_abs(trace[key[len("trace."):]], d[key]) <= TOL, key
    assert torch.equal(fp32_model(d["in.video_latent"][0], d["in.text"][0]), out)


@pytest.mark.parametrize("name", FORWARD_CASES)
def test_bf16_forward_and_dtype_flow(fp32_model, bf16_model, name):
    """The README's bf16 bar (max 0.1, RMS 1e-2), counted together with the fp32 bars
    (test_fp32_forward_and_traces), and the residual's dtypes of the release."""
    d, p = _packed(name)
    trace = {}
    out = unpack_video(bf16_model.forward_packed(p, trace), p, 48)
    diff = (out.double() - d["bf16.out.video"][0].double())
    assert diff.abs().max().item() <= BF16_MAX
    assert diff.pow(2).mean().sqrt().item() <= BF16_RMS
    flow = golden_json("cases.json")["cases"][name]["bf16_dtypes"]
    got = {("block_in" if k == "embed" else k): str(v.dtype).replace("torch.", "")
           for k, v in trace.items()}
    assert got == flow


def test_mlp_chunking_changes_no_bit(fp32_model):
    d, p = _packed("forward_masked")
    chunked = golden_model(torch.float32, mlp_chunk_rows=7)
    assert torch.equal(chunked.forward_packed(p), fp32_model.forward_packed(p))
