from tfla.ops.rnn.cells import elman, gru, lstm, slstm

__all__ = ["elman", "gru", "lstm", "slstm"]
