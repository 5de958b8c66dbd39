"""The ops run on the device of their tensors, whatever device is current (``utils.on_input_device``): Triton
launches on the current device, so without the switch a layer on cuda:1 called while cuda:0 is current (a model
spread over GPUs in one process) would launch there."""
import contextlib
import importlib
import inspect

import pytest
import torch

import tfla
from tfla.ops.common import utils


class _FakeCuda(torch.Tensor):
    """A CPU tensor that reports itself on cuda:1 (the decorator reads only these two attributes)."""
    is_cuda = property(lambda self: True)
    device = property(lambda self: torch.device("cuda", 1))


def test_on_input_device_switches_to_the_first_tensor_device(monkeypatch):
    events = []

    @contextlib.contextmanager
    def device(d):
        events.append(("enter", d))
        yield
        events.append(("exit", d))

    monkeypatch.setattr(torch.cuda, "device", device)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)

    @utils.on_input_device
    def op(ctx, do, dht=None, *, scale=1.0):
        events.append("body")
        return scale

    x = torch.zeros(2).as_subclass(_FakeCuda)
    for current, args, kwargs, switched in [
        (0, (object(), x), {}, True),  # another device current: switched for the call
        (1, (object(), x), {}, False),  # the tensors' device current: nothing to do
        (0, (object(), None), {"dht": x}, True),  # the first tensor may come after None or as a keyword
        (0, (object(), None), {"scale": 2.0}, False),  # no tensor
        (0, (object(), torch.zeros(2)), {}, False),  # CPU tensors
    ]:
        monkeypatch.setattr(torch.cuda, "current_device", lambda c=current: c)
        events.clear()
        assert op(*args, **kwargs) == kwargs.get("scale", 1.0)
        cuda1 = torch.device("cuda", 1)
        assert events == ([("enter", cuda1), "body", ("exit", cuda1)] if switched else ["body"]), (current, events)
    assert inspect.signature(op).parameters.keys() == {"ctx", "do", "dht", "scale"}


def _kernel_ops():
    """The public ops that launch Triton kernels, as the functions that take their tensors (the RNN cells go through
    ``rnn``; ``mlstm_step`` is PyTorch ops only)."""
    from tfla.ops.rnn import cells

    ops = [getattr(tfla, n) for n in tfla.__all__ if n not in ("elman", "lstm", "gru", "slstm", "mlstm_step")]
    return ops + [cells.rnn, cells.rnn_state_sequence]


def test_every_kernel_op_and_backward_switches_device():
    for op in _kernel_ops():
        assert hasattr(op, "__wrapped__"), f"{op.__name__} is not wrapped by on_input_device"
    for name in ("tfla.ops.gated_delta_rule.chunk", "tfla.ops.gated_delta_rule.fused_recurrent",
                 "tfla.ops.simple_gla.chunk", "tfla.ops.simple_gla.fused_recurrent", "tfla.ops.gla.chunk",
                 "tfla.ops.mlstm.chunk", "tfla.ops.rnn.cells", "tfla.ops.common.l2norm"):
        mod = importlib.import_module(name)
        functions = [c for c in vars(mod).values() if isinstance(c, type) and issubclass(c, torch.autograd.Function)
                     and c.__module__ == name]
        assert functions, name
        for c in functions:
            assert hasattr(c.backward, "__wrapped__"), f"{name}.{c.__name__}.backward is not wrapped"


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_gdn_on_the_second_gpu_while_the_first_is_current():
    """Forward + backward of the GDN op and one decode step on cuda:1 with cuda:0 current equal the same calls on
    cuda:0 (bitwise: same kernels, same inputs)."""
    from tfla.bench.inputs import gdn_inputs

    res = []
    for dev in ("cuda:0", "cuda:1"):
        torch.cuda.set_device(0)
        x = gdn_inputs(2, 300, 2, 128, 128, HV=4, dtype=torch.bfloat16, device=dev, initial_state=True, seed=3)
        names = ("q", "k", "v", "g", "beta", "initial_state")
        leaves = [x[n].clone().requires_grad_() for n in names]
        o, s = tfla.chunk_gated_delta_rule(*leaves[:5], initial_state=leaves[5], output_final_state=True,
                                           use_qk_l2norm_in_kernel=True)
        grads = torch.autograd.grad((o.float().sum() + s.sum()), leaves)
        o1, s1 = tfla.fused_recurrent_gated_delta_rule(*(x[n][:, :1] for n in names[:5]), initial_state=s.detach(),
                                                       output_final_state=True, use_qk_l2norm_in_kernel=True)
        torch.cuda.synchronize(dev)
        res.append([t.cpu() for t in (o, s, *grads, o1, s1)])
    for a, b in zip(*res):
        assert torch.equal(a, b)
