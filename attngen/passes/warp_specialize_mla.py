"""warp-specialize-mla: on Hopper an MLA decode (`v = k[:N]`) also runs as a warp-specialised Gluon kernel.

The Triton split-KV kernel (passes latent-kv, split-kv, paged) reads each 576-wide latent tile once, but in a
program of 64 packed rows on 8 warps each warpgroup computes S = Q K^T for its own rows over all 576 columns and
holds half the [64, 512] accumulator: H200, batch 64 x 8k keys, 128 heads 245 TFLOP/s against issue 51's 500
(FlashMLA 660 on an H800). Its bound is that product: Triton cannot hand one shared 64 x 576 tile to two
warpgroups that each compute part of one product. The Gluon kernel (templates/gluon_mla_decode.py.j2) does as
FlashMLA does: Q resident in shared memory, a loader warp copying each page's latent tile by TMA into a ring of
whole tiles, and two consumer warpgroups that compute S once between them (each half the block's keys), exchange
their row maxima through shared memory, write their halves of P into one shared tile, and each add P V into its
256 of the 512 value columns, V being the first 512 columns of the same shared tile. The partial outputs and
log-sum-exps go where the Triton kernel's go, and its merge and split count are kept.

The pass records the decision and the kernel's shape on the program (`Program.warp_specialized.mla`, the
`ir.GluonMlaDecode` of `hopper.mla_decode()`: the serial schedule, or the overlapped one where hopper.MLA_OVERLAP is
on); the code generator then emits the Gluon kernel beside the Triton one, and `forward_kvcache` takes it where it
can run (`wsm_ready`: sm_90, a page pool TMA can read).

Applies, while policy hopper.MLA_GLUON is on, to latent decoding specs of DeepSeek's shape: (head_dim, head_dim_v)
(576, 512), 16-bit, no mask or a causal one aligned bottom-right, split-KV, GQA packing, a paged cache whose pages
hold whole blocks, the tile keys left `auto`. `refusal` says why another keeps the Triton kernel; `attngen explain`
prints it.
"""

from __future__ import annotations

from dataclasses import replace

from .. import ir
from ..analysis.resources import Target, shared_bytes_mla
from ..policy import hopper
from . import warp_specialize_decode

NAME = "warp-specialize-mla"

SHAPES = ((576, 512),)
"""(head_dim, head_dim_v) the template's tiles are written for: Q and each latent tile as 2 x 256 value columns and
64 rotary ones."""


def refusal(program: ir.Program) -> str | None:
    """Why a latent decoding program keeps the Triton kernel (None where the Gluon MLA kernel takes it, and for a
    program that is not a latent decode)."""
    if not program.attr("v_from_k"):
        return None
    shape, page = (program.attr("head_dim"), program.attr("head_dim_v")), program.attr("page_size")
    block = hopper.mla_decode().block_n
    if shape not in SHAPES:
        return f"(head_dim, head_dim_v) = {shape}: the Gluon MLA kernel's tiles are DeepSeek's {SHAPES[0]}"
    if page is None or page % block:
        return (f"a {'contiguous cache' if page is None else f'page of {page} tokens'}: the Gluon MLA kernel reads "
                f"pages of a multiple of {block} tokens, one TMA tile a block")
    if not (program.attr("split_kv") is not None and program.attr("pack_gqa") and warp_specialize_decode.plain(program)
            and program.attr("dtype") in ("fp16", "bf16") and program.attr("kv_dtype") is None
            and not program.attr("fixed_tiles", False)):
        return ("the Gluon MLA kernel takes split-KV, packed query heads, no mask or a causal one aligned "
                "bottom-right, a 16-bit cache and `auto` tiles")
    m, limit = hopper.mla_decode(), Target.default().shared_limit
    need = shared_bytes_mla(program.attr("head_dim"), 2, m.rows, m.block_n, m.stages, m.seesaw)
    if need > limit:
        return (f"the Gluon MLA kernel's Q, {m.stages} stages of [{m.block_n}, {shape[0]}] latent tiles and P need "
                f"{need} bytes of shared memory, more than sm_90's {limit}")
    if not hopper.MLA_GLUON:
        return ("the Gluon MLA kernel is switched off (policy hopper.MLA_GLUON) until its GPU test and timing: the "
                "Triton split-KV kernel runs, each of its warpgroups computing S = Q K^T over all 576 columns for "
                "its own rows")
    return None


def applies(program: ir.Program) -> bool:
    return bool(program.attr("v_from_k")) and refusal(program) is None


def run(program: ir.Program) -> ir.Program:
    if not applies(program):
        return program
    return replace(program, warp_specialized=replace(program.warp_specialized, mla=hopper.mla_decode()))
