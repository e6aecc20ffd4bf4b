"""Building blocks shared by the models: batch-invariant matmul, norms, attention, MoE glue."""
