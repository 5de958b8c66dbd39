from tfla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule, chunk_gated_delta_rule_fwd
from tfla.ops.gated_delta_rule.fused_recurrent import fused_recurrent_gated_delta_rule

__all__ = ["chunk_gated_delta_rule", "chunk_gated_delta_rule_fwd", "fused_recurrent_gated_delta_rule"]
