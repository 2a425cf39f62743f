"""What both suites of `attngen bench` use: the result row, and FlexAttention compiled as the peer is measured."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Row:
    suite: str
    direction: str
    provider: str
    params: dict
    ms: float | None = None
    tflops: float | None = None
    gbps: float | None = None
    error: str | None = None
    extra: dict = field(default_factory=dict)


_FLEX = []


def compiled_flex_attention():
    """flex_attention compiled as the peer is measured: static shapes (one compile per shape), with
    dynamo's recompile limit raised so that it never falls back to eager, no donated buffers (a retained graph's
    backward runs again); one per process."""
    if not _FLEX:
        import torch
        import torch._functorch.config
        from torch.nn.attention.flex_attention import flex_attention

        torch._dynamo.config.recompile_limit = 256
        torch._dynamo.config.cache_size_limit = 256
        # The benches time a backward by repeated autograd.grad on one retained graph, which a compiled backward
        # with donated buffers refuses ("requires retain_graph=False": the varlen documents row, H200)
        torch._functorch.config.donated_buffer = False
        _FLEX.append(torch.compile(flex_attention, dynamic=False))
    return _FLEX[0]


def error_text(e: Exception) -> str:
    """A row's error: the exception's type and the first line of its message (200 characters at most)."""
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:200] if text else ''}"
