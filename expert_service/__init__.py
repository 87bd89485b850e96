"""Expert workers: own a shard of the routed experts of every MoE layer, compute the fused MoE."""
