"""Layout planner: predicts, for a model config, a request shape and a layout, every per-rank
quantity the runtime counters measure (MoE rows, exchange bytes), plus weight bytes, and
recommends a layout (`headmoe plan`)."""

from headmoe.planner.layouts import enumerate_layouts, layout_name, parse_layout
from headmoe.planner.plan import LayoutPlan, plan_layout, plan_world, recommend
from headmoe.planner.predict import (
    MoEPlacement,
    forward_counters,
    layout_topology,
    moe_placement,
    sequence_branches,
    sequence_counts,
    weight_bytes,
)
from headmoe.planner.request import RequestShape

__all__ = [
    "LayoutPlan",
    "MoEPlacement",
    "RequestShape",
    "enumerate_layouts",
    "forward_counters",
    "layout_name",
    "layout_topology",
    "moe_placement",
    "parse_layout",
    "plan_layout",
    "plan_world",
    "recommend",
    "sequence_branches",
    "sequence_counts",
    "weight_bytes",
]
