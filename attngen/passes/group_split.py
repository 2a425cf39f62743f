"""group-split: a second Triton dK/dV kernel whose programs each take a part of a GQA group's query heads.

`attn_bwd_dkdv` has one program per (batch, K/V head, block of keys), each walking every query head of its group
(recompute). Where that grid leaves multiprocessors idle (issue 51: B=1, 4 K/V heads of 7 query heads each and 2049
keys are 68 programs of 128 keys on the H200's 132), the work of a group is split over programs instead:
`attn_bwd_dkdv_split` is the same kernel (after causal-skip and tma: the same loops, masks and loads) with a grid
axis over GROUP_SPLIT parts, the group loop narrowed to part p's heads [GROUP * p // GROUP_SPLIT, GROUP * (p + 1)
// GROUP_SPLIT), and dK, dV stored unrounded in float32 into DK_PART and DV_PART (B, H_KV, GROUP_SPLIT, N_K, D),
one slice a part. The module's backward picks the parts at launch (`group_split` of policy/splits.py, the Gluon
backward's rule, on the device's multiprocessors, at most `TritonBackward.max_group_split`) and sums them after
with the Gluon path's pass, part by part in order: the same bits every run, no atomics. One part launches
`attn_bwd_dkdv` as before.

Applies to dense backward programs (not varlen: its grid is over packed key tiles) with one head dim for Q, K and
V (the summing pass takes one width).
"""

from __future__ import annotations

from dataclasses import replace

from .. import ir
from ..errors import InternalError
from ..ir import DT, Buffer, Loop, LoopKind, Role, Space, Store, sym
from ..policy import configs
from .grid import grid_path, rebuild
from .recompute import g, hkv

NAME = "group-split"

KERNEL = "attn_bwd_dkdv_split"

part = sym.index("part")
GROUP_SPLIT = sym.size("GROUP_SPLIT")


def applies(program: ir.Program) -> bool:
    return (any(k.name == "attn_bwd_dkdv" for k in program.kernels) and not program.attr("varlen")
            and program.attr("head_dim_v") is None and configs.BWD_MAX_GROUP_SPLIT > 1)


def _part_buffer(buffer: Buffer) -> Buffer:
    """DK (B, H_KV, N_K, D) -> DK_PART (B, H_KV, GROUP_SPLIT, N_K, D) in float32; DV likewise."""
    shape = buffer.shape[:2] + (GROUP_SPLIT,) + buffer.shape[2:]
    return Buffer(f"{buffer.name}_PART", shape, DT.F32, Space.HBM, Role.OUTPUT)


def _split_kernel(kernel: ir.KernelIR) -> ir.KernelIR:
    path = grid_path(kernel, NAME)
    if [loop.var for loop in path] != [sym.b, hkv, sym.start_n]:
        raise InternalError(f"{NAME} expects attn_bwd_dkdv's grid over (b, hkv, start_n)")
    parts = {p.name: _part_buffer(p) for p in kernel.params if p.name in ("DK", "DV")}
    found = []

    def stmt(st):
        if isinstance(st, Loop) and st.var == g:
            found.append(st)
            return replace(st, start=sym.FloorDiv(sym.GROUP * part, GROUP_SPLIT),
                           stop=sym.FloorDiv(sym.GROUP * (part + 1), GROUP_SPLIT), note="this part's query heads")
        if isinstance(st, Store) and st.target.name in parts:
            return replace(st, target=parts[st.target.name], index=st.index[:2] + (part,) + st.index[2:])
        return st

    body = ir.map_stmts(path[-1].body, stmt)
    if len(found) != 1:
        raise InternalError(f"{NAME} expects one loop over the group's query heads in attn_bwd_dkdv")
    # NOTE: four grid loops: codegen folds b and hkv into the launch's last axis (at most 65535 programs), which
    # holds; the launcher splits only where B x H_KV x key tiles are fewer than the multiprocessors
    part_loop = Loop(part, sym.ZERO, GROUP_SPLIT, sym.ONE, (), LoopKind.GRID, "parts of the group")
    grid = rebuild(path[:2] + [part_loop, path[2]], body)
    symbols = []
    for decl in kernel.symbols:
        symbols.append(decl)
        if decl.symbol == sym.GROUP:
            symbols.append(ir.SymbolDecl(GROUP_SPLIT, ir.SymKind.SIZE, "programs sharing a group's query heads"))
    params = tuple(parts.get(p.name, p) for p in kernel.params)
    return replace(kernel, name=KERNEL, params=params, symbols=tuple(symbols), body=grid,
                   doc="float32 dK and dV of one part of a GQA group's query heads, for one (batch, K/V head, "
                       "block of BLOCK_N keys)")


def run(program: ir.Program) -> ir.Program:
    if not applies(program):
        return program
    split = _split_kernel(program.kernel("attn_bwd_dkdv"))
    return replace(program, kernels=program.kernels + (split,),
                   triton_backward=ir.TritonBackward(max_group_split=configs.BWD_MAX_GROUP_SPLIT,
                                                     sum_block=configs.BWD_SUM_ELEMENTS // program.attr("head_dim_padded")))
