"""What the tuner drives: a loaded kernel's launch parts, adapted to the protocol of attngen/tuning/__init__.py.

The runtime's parts (the `Kernel` for its forward, `runtime.parts.BackwardPart`, `runtime.parts.KVCachePart`)
know their config lookup: problem text, space, default, feasibility. A `Tunable` adds what only tuning needs:
inputs, a run that bypasses the tables, the accuracy gate, FLOPs (`ForwardTunable` here; the backward's and the
KV-cache entry's in backward.py and decoding.py). `attngen.tuning.tunable(part)` gives the one of a part.
"""

from __future__ import annotations

import torch

from ..analysis.masks import fa_flops
from ..runtime import warmup
from ..lang.spec import DESCALES
from ..runtime.arguments import new_output
from ..testing.accuracy import Case, random_inputs, runtime_tensors
from .gate import check_attention


class Tunable:
    """A launch part as the tuner sees it; the config lookup's methods are the part's."""

    kind = "forward"

    def __init__(self, part):
        self.part, self.spec = part, part.spec
        self.kernel = part.kernel  # the loaded `Kernel` whose module it launches

    def __repr__(self) -> str:
        return f"<tunable {self.part!r}>"

    @property
    def label(self) -> str:
        return self.spec.name

    @property
    def autotune(self):
        return self.part.autotune

    @property
    def tuning_optional(self) -> tuple:
        return getattr(self.part, "tuning_optional", ())

    def tuning_problem(self) -> str:
        return self.part.tuning_problem()

    def tuning_space(self) -> dict:
        return self.part.tuning_space()

    def tuning_default(self) -> dict:
        return self.part.tuning_default()

    def tuning_infeasible(self, config: dict, target) -> str | None:
        return self.part.tuning_infeasible(config, target)


class ForwardTunable(Tunable):
    """The forward kernel of a loaded `Kernel` (`part`: the `Kernel`)."""

    def __init__(self, kernel):
        self.part, self.spec, self.kernel = kernel, kernel.spec, kernel

    def tuning_inputs(self, shape, device, generator) -> dict:
        case = Case(shape.batch, shape.heads, shape.kv_heads, shape.n_q, shape.n_k)
        q, k, v = random_inputs(self.spec, case, device, generator)
        lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
        tensors = {}
        if self.spec.dtype.fp8:  # V keys-contiguous, as the module's forward copies it (`fp8_vt`), the descales random
            v = self.kernel.module.fp8_vt(v).transpose(2, 3)  # per head
            tensors = {name: t for name, t in runtime_tensors(self.spec, case, device, generator).items()
                       if name in DESCALES}
        return {"q": q, "k": k, "v": v, "out": new_output(q, v, self.spec.dtype.output.torch), "lse": lse,
                "tensors": tensors}

    def tuning_run(self, inputs: dict, config: dict, *, poison: bool = False):
        if poison:
            inputs["out"].fill_(float("nan"))
            inputs["lse"].fill_(float("nan"))
        warmup.wait()
        module = self.kernel.module
        if self.kernel.program.warp_specialized.forward is not None:  # the tuner tunes the Triton kernel, not the Gluon one
            config = dict(config, warp_specialized=False)
        return module.forward(inputs["q"], inputs["k"], inputs["v"], self.spec.softmax_scale,
                              out=inputs["out"], lse=inputs["lse"], config=config, **inputs["tensors"])

    def tuning_check(self, inputs: dict, outputs):
        out, lse = outputs
        return check_attention(self.spec, inputs["q"], inputs["k"], inputs["v"], out, lse, tensors=inputs["tensors"])

    def tuning_flops(self, shape) -> float:
        sizes = {"B": shape.batch, "H": shape.heads, "N_Q": shape.n_q, "N_K": shape.n_k, "HEAD_DIM": self.spec.head_dim}
        return fa_flops(self.spec, sizes)
