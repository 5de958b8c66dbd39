"""Compile a peer's autotuned Triton kernels in parallel processes before a benchmark times them.

FLA 0.6.0's ``chunk_gla`` autotunes ~24-36 launch configs per kernel on its first call, and each config is
compiled one after another in one process: on the H100 (Triton 3.6) that first call ran past 240-300 s.
Triton's compile cache is shared on disk (``TRITON_CACHE_DIR``), so N processes that each compile a
disjoint 1/N of every autotuner's configs fill the cache N times faster; the benchmark afterwards autotunes
over all configs as usual, finding each one compiled.

Process ``--part i --of N`` keeps, in every ``triton.runtime.autotuner.Autotuner`` (FLA's cached autotuner
is a subclass), only the pruned configs ``[i::N]`` and does not store autotune results (a sliced config list
also gives another disk-cache key, so nothing here can stand in for the full autotune). Everything after
``--`` is the ``tfla`` command line to run, e.g.::

    for i in 0 1 2 3; do
      python scripts/warm_autotune.py --part $i --of 4 -- bench linear-attn --kinds vector --impls fla \
          --mode fwdbwd --warmup 1 --rep 1 &
    done; wait
"""
from __future__ import annotations

import argparse
import sys


def main() -> int:
    argv = sys.argv[1:]
    if "--" not in argv:
        raise SystemExit("usage: warm_autotune.py --part I --of N -- <tfla command line>")
    cut = argv.index("--")
    p = argparse.ArgumentParser()
    p.add_argument("--part", type=int, required=True)
    p.add_argument("--of", type=int, required=True)
    a = p.parse_args(argv[:cut])
    if not 0 <= a.part < a.of:
        raise SystemExit(f"--part must be in [0, --of), got {a.part} of {a.of}")

    from triton.runtime.autotuner import Autotuner

    prune = Autotuner.prune_configs

    def sliced(self, *args, **kwargs):
        configs = prune(self, *args, **kwargs)
        self.cache_results = False
        return configs[a.part::a.of] or configs[-1:]

    Autotuner.prune_configs = sliced
    from tfla.cli import main as tfla_main

    return tfla_main(argv[cut + 1:])


if __name__ == "__main__":
    raise SystemExit(main())
