from tfla.ops.gla.chunk import chunk_gla

__all__ = ["chunk_gla"]
