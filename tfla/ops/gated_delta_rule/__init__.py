from tfla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule, chunk_gated_delta_rule_fwd

__all__ = ["chunk_gated_delta_rule", "chunk_gated_delta_rule_fwd"]
