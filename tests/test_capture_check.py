"""The bodies CUDA graphs capture, checked on CPU for what a graph would get wrong
(flashrt/core/capture_check.py): host syncs, host tensors, and work that depends on host state."""
from __future__ import annotations

import pytest
import torch

from conftest import ARCHS
from flashrt import native
from flashrt.core.capture_check import hazards
from flashrt.lm import use_graph_bodies
from flashrt.lm.speculative import use_static_steps

pytestmark = pytest.mark.usefixtures("one_thread")


# ---- the check itself: each planted mistake is named, a graph-safe body passes -------------
def _planted():
    buf, pos = torch.zeros(16), torch.zeros((), dtype=torch.int64)
    host = {"p": 3, "x": torch.ones(4)}

    def step():          # what happens between two replays: the position and inputs move on
        pos.add_(1)
        host["p"] += 1
        host["x"] = torch.ones(4)
    bodies = {
        "graph-safe": lambda: buf.index_fill_(0, pos + torch.arange(2, device=buf.device), 1.0),
        "host int slice": lambda: buf[: host["p"]].add_(1),
        "host scalar": lambda: buf.add_(host["p"]),
        "input reallocated by the host": lambda: buf[:4].add_(host["x"]),
        "tensor slice bound": lambda: buf[: pos + 2].add_(1),
        "item": lambda: buf.add_(pos.item()),
        "bool": lambda: buf.add_(1) if bool(pos >= 0) else None,
        "boolean mask": lambda: buf[buf > 0].sum(),
        "factory without device": lambda: buf[:2].add_(torch.arange(2)),
        "torch.tensor": lambda: buf[:2].add_(torch.tensor([1.0, 2.0], device=buf.device)),
        "tolist": lambda: buf.tolist(),
    }
    return bodies, step


EXPECT = {"host int slice": "differs between the runs", "host scalar": "differs between the runs",
          "input reallocated by the host": "external buffer at",
          "tensor slice bound": "host sync", "item": "host sync", "bool": "host sync",
          "boolean mask": "boolean-mask index", "factory without device": "arange() without device=",
          "torch.tensor": "host copy tensor()", "tolist": "host copy tolist()"}


@pytest.mark.parametrize("name", ["graph-safe", *EXPECT])
def test_check_names_each_planted_mistake(name):
    bodies, step = _planted()
    found = hazards(bodies[name], step)
    if name == "graph-safe":
        assert found == []
    else:
        assert found and any(EXPECT[name] in f for f in found), found
        assert "test_capture_check.py" in found[0]      # it names the line that did it


# ---- the bodies flashrt captures ------------------------------------------------------------
# linear_kernel="aten": what CUDA selects (the CPU kernels never run inside a graph). On a GPU
# (bench/gpu_check.sh) the bodies run eagerly there, so CUDA-only branches (Triton attention)
# are checked too, before any capture.
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@pytest.mark.parametrize("device,dtype", [("cpu", "float32"), ("cpu", "bfloat16"),
                                          pytest.param("cuda", "bfloat16", marks=CUDA)])
@pytest.mark.parametrize("arch", ARCHS)
def test_language_model_graph_bodies_are_capturable(runtime, arch, device, dtype):
    rt = runtime(arch, dtype=dtype, linear_kernel="aten", device=device, cuda_graphs=False)
    graphs = use_graph_bodies(rt)
    rt.prefill(list(range(1, 20)))
    moves = iter(range(30, 10_000, 7))
    for key, body in graphs.fns.items():     # every step size, "sample" and "decode"
        found = hazards(body, lambda: rt.prefill([next(moves), 5, 6]))
        assert found == [], (key, found)


def test_speculative_bodies_are_capturable(runtime):
    rt = runtime("qwen3_5", linear_kernel="aten")
    assert rt.net.has_draft_head
    steps = use_static_steps(rt, max_T=3)
    rt.prefill(list(range(1, 20)))
    hidden = torch.randn(3, rt.net.config.hidden_size, generator=torch.Generator().manual_seed(0))
    row = iter(range(20, 200, 5))

    def move():          # main: a committed step; draft: other tokens, hidden and rows
        rt.prefill([7, 8])
        steps.draft(torch.tensor([9, 10, 11]), hidden, next(row))
    for key in steps.bodies():
        found = hazards(lambda: steps.run_body(*key), move)
        assert found == [], (key, found)


@pytest.mark.skipif(not native.SMALL_M_LINEAR, reason="the extension's small-M kernel is not built here")
def test_check_sees_the_cpu_kernel_allocate_on_the_host(runtime):
    """The CPU small-M kernel returns a host tensor: not capturable, and never selected on
    CUDA. The check finds it inside a real model step."""
    rt = runtime("qwen3", linear_kernel="flashrt")
    graphs = use_graph_bodies(rt)
    rt.prefill([1, 2, 3])
    found = hazards(graphs.fns[2], lambda: rt.prefill([4]))
    assert any("without device=" in f for f in found), found
