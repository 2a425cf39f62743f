"""The kernels of a varlen spec (`layout = varlen`), as the tuner sees them: the forward (`forward_varlen`, paged
or not) and a forward+backward spec's two backward kernels, each a launch part with its own config, as a dense
spec's (the `Kernel` and its `BackwardPart`s, whose problem text names the layout, so their entries are their own).

A varlen call is looked up by its `keys.Packed` bucket ('H=32 TOTAL_Q=16384 N_Q=2048 N_K=2048': the packed
query tokens and the mean lengths per sequence, from tensor shapes). The tuner times each candidate on a packed
batch of that bucket (`packed_lengths`): documents of random lengths packed into the shape's query tokens, as the
bench's document rows draw them (attngen/bench/varlen.py), the same batch for a shape on every run. Validation
compares a few sequences (the first, the last, the longest) with float64 one by one, sliced as the dense gate
slices (`gate.check_attention`; the backward: one key/value head with its query heads).
"""

from __future__ import annotations

import torch

from ..analysis.masks import kept_scores
from ..runtime import varlen, warmup
from ..runtime.arguments import new_output
from ..runtime.keys import Packed
from ..runtime.tables import describe_config
from ..testing.accuracy import compare_grads
from ..testing.packed import document_lengths, packed_inputs
from .backward import PRODUCTS, BackwardTunable, GradsCheck
from .gate import check_attention
from .tunables import ForwardTunable

LENGTHS_SEED = 0  # the lengths of a shape's batch: one batch per shape, whatever seed draws the data


def packed_lengths(spec, shape: Packed) -> tuple[list[int], list[int]]:
    """The query and key lengths of the sequences the tuner runs at `shape`: `shape.batch` documents of random
    lengths packed into `shape.total_q` tokens. Each sequence's keys are its share of `total_k` (its own queries
    where the totals are equal: packed documents); for a paged spec, whose `total_k` is sequences x the keys a
    block table row addresses, a cache spread from that capacity down to half of it (the decode tuner's spread),
    never shorter than its queries (a chunked prefill's new tokens are the last of its keys). A call's shape with
    more sequences than query tokens (an autotuned bucket) gets empty sequences after one-token ones."""
    generator = torch.Generator().manual_seed(LENGTHS_SEED)
    batch = max(shape.batch, 1)
    filled = min(batch, shape.total_q)
    lengths_q = (document_lengths(shape.total_q, filled, generator) if filled else []) + [0] * (batch - filled)
    if spec.kv_layout.paged:
        capacity = shape.total_k // batch
        return lengths_q, [max(n, capacity - b * capacity // (2 * batch)) for b, n in enumerate(lengths_q)]
    lengths_k = [n * shape.total_k // max(shape.total_q, 1) for n in lengths_q]
    lengths_k[-1] += shape.total_k - sum(lengths_k)
    return lengths_q, lengths_k


def checked_sequences(lengths: list[int]) -> list[int]:
    """The sequences validation compares with float64: the first, the last and the longest (the packing's two ends,
    and the most keys a tile loops over)."""
    longest = max(range(len(lengths)), key=lambda b: lengths[b])
    return sorted({0, len(lengths) - 1, longest})


def packed_flops(spec, shape: Packed) -> float:
    """FLOPs of one forward at `shape` by the FlashAttention convention per sequence: 2 * (d + d_v) per kept score
    (4 * d where V's head dim is q's)."""
    lengths_q, lengths_k = packed_lengths(spec, shape)
    kept = sum(kept_scores(spec, n_q, n_k) for n_q, n_k in zip(lengths_q, lengths_k))
    return 2.0 * (spec.head_dim + spec.head_dim_v) * shape.heads * kept


class VarlenForwardTunable(ForwardTunable):
    """The forward of a loaded varlen `Kernel` (`part`: the `Kernel`), on packed batches."""

    def tuning_inputs(self, shape: Packed, device, generator) -> dict:
        lengths_q, lengths_k = packed_lengths(self.spec, shape)
        batch = packed_inputs(self.spec, lengths_q, lengths_k, shape.heads, shape.kv_heads, device, generator)
        lse = torch.empty((shape.heads, batch.q.shape[0]), device=device, dtype=torch.float32)
        return {"batch": batch, "seqlens_k": batch.seqlens_k, "out": new_output(batch.q, batch.v), "lse": lse}

    def tuning_run(self, inputs: dict, config: dict, *, poison: bool = False):
        if poison:
            inputs["out"].fill_(float("nan"))
            inputs["lse"].fill_(float("nan"))
        x = inputs["batch"]
        warmup.wait()
        return self.kernel.module.forward_varlen(x.q, x.keys, x.values, x.cu_seqlens_q, x.cu_seqlens_k,
                                                 inputs["seqlens_k"], x.block_table, self.spec.softmax_scale,
                                                 out=inputs["out"], lse=inputs["lse"], config=config)

    def tuning_check(self, inputs: dict, outputs):
        out, lse = outputs
        x, results = inputs["batch"], []
        for b in checked_sequences(x.lengths_q):
            lse_b = lse[:, int(x.cu_seqlens_q[b]):int(x.cu_seqlens_q[b + 1])][None]
            results.append(check_attention(self.spec, x.rows(x.q, b), x.rows(x.k, b, keys=True),
                                           x.rows(x.v, b, keys=True), x.rows(out, b), lse_b))
        return next((r for r in results if not r.ok), max(results, key=lambda r: r.rel))

    def tuning_infeasible(self, config: dict, target) -> str | None:
        page_tile = getattr(self.kernel.module, "MAX_BLOCK_N", None)
        if page_tile is not None and config["BLOCK_N"] > page_tile:  # (the launcher would run it as page_tile)
            return (f"block_n={config['BLOCK_N']} crosses a page: pages of {page_tile} tokens are looked up "
                    "once per key tile, so block_n must not exceed the page size")
        return super().tuning_infeasible(config, target)

    def tuning_flops(self, shape: Packed) -> float:
        return packed_flops(self.spec, shape)


class VarlenBackwardTunable(BackwardTunable):
    """One of the two backward kernels of a loaded forward+backward varlen `Kernel` (`part`: its `BackwardPart`):
    validated as the whole backward with every gradient poisoned, timed alone (dK/dV on the delta the validation
    run left), as the dense backward's."""

    def tuning_inputs(self, shape: Packed, device, generator) -> dict:
        lengths_q, lengths_k = packed_lengths(self.spec, shape)
        x = packed_inputs(self.spec, lengths_q, lengths_k, shape.heads, shape.kv_heads, device, generator)
        seqlens_k = x.seqlens_k
        out, lse = varlen.forward(self.kernel, x.q, x.k, x.v, x.cu_seqlens_q, x.cu_seqlens_k, seqlens_k, None,
                                  self.spec.softmax_scale)
        do = torch.randn(out.shape, generator=generator, device=device, dtype=torch.float32).to(x.q.dtype)
        return {"batch": x, "seqlens_k": seqlens_k, "out": out, "lse": lse, "do": do, "delta": torch.zeros_like(lse),
                "dq": torch.empty_like(x.q), "dk": torch.empty_like(x.k), "dv": torch.empty_like(x.v)}

    def tuning_run(self, inputs: dict, config: dict, *, poison: bool = False):
        """With `poison`: the whole backward, gradients NaN-filled first (for validation). Without: this part
        alone (for timing)."""
        x, b, module, scale = inputs, inputs["batch"], self.kernel.module, self.spec.softmax_scale
        packed = dict(cu_seqlens_q=b.cu_seqlens_q, cu_seqlens_k=b.cu_seqlens_k, seqlens_k=x["seqlens_k"])
        warmup.wait()
        if poison:
            module.backward_varlen(b.q, b.k, b.v, x["out"], x["lse"], x["do"], sm_scale=scale, dq=x["dq"],
                                   dk=x["dk"], dv=x["dv"], config=self._validation_launch(x, config), **packed)
            # The dK/dV kernel timed alone reads delta = rowsum(dO * O) (H, TOTAL_Q), as the dQ kernel writes it.
            x["delta"].copy_((x["do"].float() * x["out"].float()).sum(-1).transpose(0, 1))
        elif self.name == "attn_bwd_dq":
            module.launch_attn_bwd_dq(q=b.q, k=b.k, v=b.v, o=x["out"], do=x["do"], lse=x["lse"], delta=x["delta"],
                                      dq=x["dq"], sm_scale=scale, **packed, **config)
        else:
            module.launch_attn_bwd_dkdv(q=b.q, k=b.k, v=b.v, do=x["do"], lse=x["lse"], delta=x["delta"], dk=x["dk"],
                                        dv=x["dv"], sm_scale=scale, **packed, **config)
        return x["dq"], x["dk"], x["dv"]

    def _current_config(self, part: str, inputs: dict) -> dict:
        """The config a call of these inputs would launch `part` with now (never tuning it)."""
        b = inputs["batch"]
        return describe_config(self.kernel.part(part), Packed.of(b.q, b.k, b.cu_seqlens_q), b.q.device.index)[0]

    def tuning_check(self, inputs: dict, outputs) -> GradsCheck:
        x = inputs["batch"]
        group = x.q.shape[1] // x.k.shape[1]
        results = []
        for b in checked_sequences(x.lengths_q):
            q, do, dq = (x.rows(t, b)[:, :group] for t in (x.q, inputs["do"], outputs[0]))
            k, v, dk, dv = (x.rows(t, b, keys=True)[:, :1] for t in (x.k, x.v, outputs[1], outputs[2]))
            results.append(GradsCheck(compare_grads(self.spec, q, k, v, do, (dq, dk, dv))))
        return next((r for r in results if not r.ok), max(results, key=lambda r: r.rel))

    def tuning_flops(self, shape: Packed) -> float:
        """This kernel's matrix-product FLOPs (`BackwardTunable.tuning_flops` says why PRODUCTS / 2 of the
        forward's)."""
        return PRODUCTS[self.name] / 2 * packed_flops(self.spec, shape)
