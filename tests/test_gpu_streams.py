"""The torch bridge launches fp4sim's GPU work on torch's current CUDA stream.

The first test checks the stream logic without a GPU (a stand-in for CuPy records what the bridge asks of it);
the second, marked ``gpu``, runs a converted layer inside a non-default stream against the default one, bit for
bit, on a device.
"""
from __future__ import annotations

import sys
import types

import pytest

torch = pytest.importorskip("torch")

import fp4sim as fs  # noqa: E402
from fp4sim.torch import function  # noqa: E402


def test_cuda_passes_use_torchs_current_stream(monkeypatch):
    seen = []

    class Ctx:
        def __init__(self, *args):
            self.args = args

        def __enter__(self):
            seen.append((type(self).__name__, "enter", self.args))

        def __exit__(self, *exc):
            seen.append((type(self).__name__, "exit", self.args))

    class Device(Ctx):
        pass

    class ExternalStream(Ctx):
        pass

    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(Device=Device, ExternalStream=ExternalStream))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda idx: types.SimpleNamespace(cuda_stream=0xBEEF + idx))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    with function._device_stream(torch.device("cuda", 1)):
        assert seen == [("Device", "enter", (1,)), ("ExternalStream", "enter", (0xBEEF + 1, 1))]
    assert [s[1] for s in seen[2:]] == ["exit", "exit"]
    seen.clear()
    with function._device_stream(torch.device("cuda")):          # no index: torch's current device
        assert seen[1] == ("ExternalStream", "enter", (0xBEEF + 3, 3))
    seen.clear()
    with function._device_stream(torch.device("cpu")):
        assert seen == []


@pytest.mark.gpu
def test_a_layer_in_a_side_stream_gives_the_default_streams_bits():
    if not (torch.cuda.is_available() and fs.gpu.available()):
        pytest.skip("needs a CUDA device and CuPy (pip install '.[gpu]')")
    from fp4sim.torch import convert
    torch.manual_seed(0)
    x = torch.randn(256, 512, device="cuda")

    def run(stream):
        torch.manual_seed(0)
        m = convert(torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256)).cuda(),
                    "nvfp4_paper")
        ctx = torch.cuda.stream(stream) if stream is not None else torch.cuda.stream(torch.cuda.current_stream())
        with ctx:
            xi = x.clone().requires_grad_()
            y = m(xi)
            y.square().sum().backward()
        torch.cuda.synchronize()
        return [y.detach(), xi.grad] + [p.grad for p in m.parameters()]

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())          # x was made on the default stream
    for a, b in zip(run(None), run(side)):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))
