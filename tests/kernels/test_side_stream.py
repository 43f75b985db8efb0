"""`side_stream.Branch`: the side-stream result equals running the function inline, in eager mode and
replayed from a CUDA graph whose input changed after capture (the fork must wait for the main
stream's producer, the join must precede the consumer)."""

from __future__ import annotations

import pytest
import torch

from pagoda.layers.side_stream import Branch

CUDA = torch.cuda.is_available()


def _step(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    produced = x * 3 + 1  # main-stream producer of the branch input
    branch = Branch(lambda a: a @ w, produced)  # side stream
    main = (produced @ w.t()).relu()  # main chain meanwhile
    return main + branch.join()  # consumer of both


def test_branch_inline_on_cpu_or_disabled():
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    want = (x * 3 + 1) @ w.t()
    assert torch.equal(Branch(lambda a: a @ w.t(), x * 3 + 1).join(), want)
    assert torch.equal(Branch(lambda a: a @ w.t(), x * 3 + 1, enabled=False).join(), want)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_branch_matches_inline_eager_and_in_a_graph():
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(512, 512, device="cuda", generator=g)
    x = torch.randn(256, 512, device="cuda", generator=g)

    def reference(inp):
        produced = inp * 3 + 1
        return (produced @ w.t()).relu() + produced @ w

    torch.testing.assert_close(_step(x, w), reference(x))
    static_x = x.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _step(static_x, w)  # warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = _step(static_x, w)
    for seed in range(3):
        new = torch.randn(256, 512, device="cuda", generator=g.manual_seed(seed + 1))
        static_x.copy_(new)
        graph.replay()
        torch.testing.assert_close(static_out, reference(new))
