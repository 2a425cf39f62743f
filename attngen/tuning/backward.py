"""The backward kernels of a forward+backward spec, as the tuner sees them.

The backward is two launches (attngen/passes/recompute.py): `attn_bwd_dq`, which also computes
delta = rowsum(dO * O), then `attn_bwd_dkdv`, which reads it. Each has its own launch config, so
each is tuned as a kernel of its own (`BackwardTunable`, over attngen/runtime/parts.py's `BackwardPart`), with
the other at its current config:

  * validation runs the whole backward with every gradient poisoned (NaN) first, and compares dq,
    dk and dv with the float64 reference on one batch entry and one key/value head with its group
    of query heads (exact: those are independent of the rest), so a candidate that breaks any
    gradient is rejected;
  * timing launches this part alone, on the inputs the validation run left (the dK/dV kernel reads
    the delta the dQ kernel wrote there), so the other part's time does not blur the comparison.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..analysis.masks import fa_flops
from ..runtime import warmup
from ..runtime.keys import Shape
from ..runtime.parts import PARTS
from ..runtime.tables import describe_config
from ..testing.accuracy import Case, compare_grads, random_inputs
from .tunables import Tunable

PRODUCTS = {"attn_bwd_dq": 3, "attn_bwd_dkdv": 4}  # matrix products per (query block, key block) pair


@dataclass(frozen=True)
class GradsCheck:
    """The validation of one backward run: the per-gradient results of attngen.testing.accuracy.compare_grads."""

    grads: tuple

    @property
    def ok(self) -> bool:
        return all(g.ok for g in self.grads)

    @property
    def rel(self) -> float:
        return max(g.rel for g in self.grads)

    def __str__(self) -> str:
        return "; ".join(f"{g.name} rel {g.rel:.2e} (tol {g.rel_tol:.0e}) max|err| {g.err:.3e} (tol {g.tol:.2e})"
                         + (f" {g.problem}" if g.problem else "") for g in self.grads if not g.ok)


class BackwardTunable(Tunable):
    """One of the two backward kernels of a loaded forward+backward `Kernel` (`part`: its `BackwardPart`)."""

    kind = "backward"

    def __init__(self, part):
        super().__init__(part)
        self.name = part.name

    @property
    def label(self) -> str:
        return f"{self.spec.name} backward {self.name}"

    def tuning_inputs(self, shape, device, generator) -> dict:
        case = Case(shape.batch, shape.heads, shape.kv_heads, shape.n_q, shape.n_k)
        q, k, v = random_inputs(self.spec, case, device, generator)
        out, lse = self.kernel.forward(q, k, v, self.spec.softmax_scale)
        do = torch.randn(out.shape, generator=generator, device=device, dtype=torch.float32).to(q.dtype)
        return {"q": q, "k": k, "v": v, "out": out, "lse": lse, "do": do, "delta": torch.zeros_like(lse),
                "dq": torch.empty_like(q), "dk": torch.empty_like(k), "dv": torch.empty_like(v)}

    def tuning_run(self, inputs: dict, config: dict, *, poison: bool = False):
        """With `poison`: the whole backward, gradients NaN-filled first (for validation). Without:
        this part alone (for timing)."""
        x, module, scale = inputs, self.kernel.module, self.spec.softmax_scale
        warmup.wait()
        if poison:
            launch = self._validation_launch(x, config)
            module.backward(x["q"], x["k"], x["v"], x["out"], x["lse"], x["do"], scale,
                            dq=x["dq"], dk=x["dk"], dv=x["dv"], config=launch)
            # The dK/dV kernel timed alone reads delta = rowsum(dO * O), as the dQ kernel writes it.
            x["delta"].copy_((x["do"].float() * x["out"].float()).sum(-1))
        elif self.name == "attn_bwd_dq":
            module.launch_attn_bwd_dq(q=x["q"], k=x["k"], v=x["v"], o=x["out"], do=x["do"], lse=x["lse"],
                                      delta=x["delta"], dq=x["dq"], sm_scale=scale, **config)
        else:
            module.launch_attn_bwd_dkdv(q=x["q"], k=x["k"], v=x["v"], do=x["do"], lse=x["lse"], delta=x["delta"],
                                        dk=x["dk"], dv=x["dv"], sm_scale=scale, **config)
        return x["dq"], x["dk"], x["dv"]

    def _validation_launch(self, inputs: dict, config: dict) -> dict:
        """Poison the gradient buffers of `inputs` (NaN) and return the configs of a whole backward that runs this
        part with `config` and the other part with its current config (the Triton kernels, not the Gluon one)."""
        for name in ("dq", "dk", "dv"):
            inputs[name].fill_(float("nan"))
        other = next(p for p in PARTS if p != self.name)
        launch = {self.name: dict(config), other: self._current_config(other, inputs)}
        if self.kernel.program.warp_specialized.backward is not None:  # the tuner validates the Triton dK/dV kernel
            launch["attn_bwd_dkdv"]["warp_specialized"] = False
        return launch

    def _current_config(self, part: str, inputs: dict) -> dict:
        """The config a call of this shape would launch `part` with now (never tuning it)."""
        shape = Shape.of(inputs["q"], inputs["k"])
        return describe_config(self.kernel.part(part), shape, inputs["q"].device.index)[0]

    def tuning_check(self, inputs: dict, outputs) -> GradsCheck:
        group = inputs["q"].shape[1] // inputs["k"].shape[1]
        sliced = [t[:1, :group] if name in ("q", "do", "dq") else t[:1, :1]
                  for name, t in zip(("q", "k", "v", "do", "dq", "dk", "dv"),
                                     (inputs["q"], inputs["k"], inputs["v"], inputs["do"], *outputs))]
        q, k, v, do, dq, dk, dv = sliced
        return GradsCheck(compare_grads(self.spec, q, k, v, do, (dq, dk, dv)))

    def tuning_flops(self, shape) -> float:
        """This kernel's own matrix-product FLOPs, so its TFLOP/s compares with the GPU's peak: dQ
        recomputes S = QK^T and dP = dO V^T and forms dS K (3 products, 1.5x the forward's two);
        dK/dV recomputes S^T and dP^T and forms P^T dO and dS^T Q (4 products, 2x). The whole
        backward is 3.5x the forward, which the FlashAttention convention counts as 2.5x."""
        sizes = {"B": shape.batch, "H": shape.heads, "N_Q": shape.n_q, "N_K": shape.n_k, "HEAD_DIM": self.spec.head_dim}
        return PRODUCTS[self.name] / 2 * fa_flops(self.spec, sizes)
