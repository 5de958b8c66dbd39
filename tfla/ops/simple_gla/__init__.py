from tfla.ops.simple_gla.chunk import chunk_lightning_attn, chunk_linear_attn, chunk_retention, chunk_simple_gla
from tfla.ops.simple_gla.fused_recurrent import fused_recurrent_simple_gla

__all__ = ["chunk_lightning_attn", "chunk_linear_attn", "chunk_retention", "chunk_simple_gla",
           "fused_recurrent_simple_gla"]
