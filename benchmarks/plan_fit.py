"""Which layouts of MAGI-2 Preview fit a GPU budget, per expert format (docs/fp8.md).

    python benchmarks/plan_fit.py [--worlds 1:131.3,2:131.3,4:74.5] [--resolutions 272p,540p]

For each world (ranks : GiB per GPU), resolution and format (bf16, fp8) it lists the layouts
`headmoe plan` enumerates whose busiest rank fits, by admission's own estimate
(`headmoe.planner.memory.estimate_memory`: weights + loader batch + activations + exchange
workspace + decode) plus the text encoder and decoders as the pipeline places them
(`component_bytes_per_rank`), three ways: resident with the components on the device,
resident with ``--offload`` (components on the host between uses), and with
``--offload-layers`` (the most resident layers that fit, `stream_report`; FP8 streaming
reads an FP8 release folder, `headmoe quantize`). Configuration only: nothing is allocated.
"""

from __future__ import annotations

import argparse

from headmoe.config import GIB
from headmoe.models.magi2.config import get_config
from headmoe.moe.formats import EXPERT_FORMATS
from headmoe.pipeline.recipe import RESOLUTIONS, recipe_for
from headmoe.pipeline.request import DTYPES
from headmoe.planner.components import component_bytes, component_bytes_per_rank
from headmoe.planner.layouts import enumerate_layouts, layout_name
from headmoe.planner.memory import StreamSettings, estimate_memory
from headmoe.planner.plan import stream_report
from headmoe.planner.predict import layout_topology
from headmoe.planner.request import RequestShape

MODEL = "magi2-preview"


def fits(world: int, budget_gib: float, resolution: str, fmt: str) -> list[tuple[str, str, str, str]]:
    """(layout, resident GiB (components on device), resident with --offload GiB,
    --offload-layers resident layers that fit or "-") per layout of ``world`` ranks, a cell
    starred where it fits ``budget_gib``."""
    model = get_config(MODEL)
    height, width = RESOLUTIONS[resolution]
    recipe = recipe_for(model)
    frames, fps = recipe.default("num_frames", "cuda"), recipe.default("fps", "cuda")
    shape = RequestShape.from_media(height=height, width=width, num_frames=frames, fps=fps,
                                    text_tokens=250, uncond_text_tokens=250)
    dtype = DTYPES[recipe.default("dtype", "cuda")]
    parts = component_bytes(MODEL)
    budget = int(budget_gib * GIB)
    rows = []
    for par in enumerate_layouts(model, world):
        est = estimate_memory(model, shape, par, dtype, (frames, height, width),
                              experts=fmt).total
        held = max(component_bytes_per_rank(layout_topology(model, par), parts, world))
        stream = stream_report(model, shape, par, dtype, StreamSettings(), world,
                               memory_bytes=budget, experts=fmt)
        n = stream.max_resident_layers

        def cell(b: int) -> str:
            return f"{b / GIB:.1f}" + (" *" if b <= budget else "")
        rows.append((layout_name(par), cell(est + held), cell(est),
                     "-" if n is None else f"{n} *"))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worlds", default="1:131.3,2:131.3,4:74.5",
                   help="ranks:GiB per GPU, comma-separated (default: 1 and 2 x 141 GB, 4 x 80 GB)")
    p.add_argument("--resolutions", default="272p,540p")
    args = p.parse_args()
    for item in args.worlds.split(","):
        world, gib = item.split(":")
        for res in args.resolutions.split(","):
            print(f"\n{world} x {gib} GiB, {res} (* fits)\n")
            print("| layout | format | resident GiB | with --offload GiB | --offload-layers: "
                  "resident layers |")
            print("|---|---|---|---|---|")
            for fmt in EXPERT_FORMATS:
                for r in fits(int(world), float(gib), res, fmt):
                    print(f"| {r[0]} | {fmt} | {r[1]} | {r[2]} | {r[3]} |")


if __name__ == "__main__":
    main()
