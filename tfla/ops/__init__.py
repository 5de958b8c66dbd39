"""tfla ops. Each op folder holds ``reference.py`` (ground truth), ``chunk.py`` (host orchestration and
the public function) and a README; shared Triton stages live in ``tfla/ops/common``."""
