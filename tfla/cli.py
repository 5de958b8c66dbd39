"""``tfla`` command line: ``tfla bench gdn [options]`` (also ``python -m tfla bench gdn``), and
``tfla bench linear-attn``, ``tfla bench mlstm``, ``tfla bench rnn``, ``tfla bench decode``.

On a machine without a CUDA GPU the kernels run through Triton's CPU interpreter on a small
default workload, so the command always runs; on a GPU the default workload is the proposal's
experiment (B = 4, T = 8192, H = 16, K = V = 128, bf16).
"""
from __future__ import annotations

import argparse
import os
import sys


def use_interpreter_without_gpu() -> None:
    """Without a CUDA GPU, run kernels through Triton's CPU interpreter (also used by ``scripts/``). Must run
    before anything imports triton: the interpreter is chosen when kernels are defined."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


def build_parser() -> argparse.ArgumentParser:
    from tfla.bench import decode, gdn, linear_attn, mlstm, rnn

    parser = argparse.ArgumentParser(prog="tfla", description="Tiled Flash Linear Attention kernels")
    sub = parser.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("bench", help="check and time kernels against peers")
    bench_sub = bench.add_subparsers(dest="op", required=True)
    p_gdn = bench_sub.add_parser("gdn", help="Gated DeltaNet (chunk_gated_delta_rule)",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    gdn.add_arguments(p_gdn)
    p_gdn.set_defaults(run=gdn.main)
    p_la = bench_sub.add_parser("linear-attn", help="linear attention, decay none/constant/scalar/vector, vs FLA",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    linear_attn.add_arguments(p_la)
    p_la.set_defaults(run=linear_attn.main)
    p_mlstm = bench_sub.add_parser("mlstm", help="mLSTM, exp and sigmoid input gate (chunk_mlstm), vs mlstm_kernels",
                                   formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    mlstm.add_arguments(p_mlstm)
    p_mlstm.set_defaults(run=mlstm.main)
    p_rnn = bench_sub.add_parser("rnn", help="LSTM, GRU, sLSTM, Elman cells, vs torch.nn (cuDNN) and FlashRNN",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    rnn.add_arguments(p_rnn)
    p_rnn.set_defaults(run=rnn.main)
    p_dec = bench_sub.add_parser("decode", help="Gated DeltaNet decode steps (fused_recurrent_gated_delta_rule), "
                                 "states or a state pool, vs FLA",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    decode.add_arguments(p_dec)
    p_dec.set_defaults(run=decode.main)
    return parser


def main(argv: list[str] | None = None) -> int:
    use_interpreter_without_gpu()
    try:
        parser = build_parser()
    except ModuleNotFoundError as e:
        if e.name in ("rich",):
            print(f"tfla bench needs the benchmark extras: pip install 'tfla[bench]' ({e})", file=sys.stderr)
            return 2
        raise
    args = parser.parse_args(argv)
    return int(args.run(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
