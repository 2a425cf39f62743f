"""The Hopper kernels' decision as a typed IR value (ir.WarpSpecialized): set by the warp-specialize passes from
attngen/policy/hopper.py, checked by the verifier, printed by `attngen explain`."""

import os
from dataclasses import replace

import pytest

from attngen import ir
from attngen.cli import main
from attngen.errors import InternalError
from attngen.passes import compile_program
from attngen.policy import hopper
from attngen.lang.spec import parse
from attngen.ir.verify import verify
from conftest import spec_text

SPECS = os.path.join(os.path.dirname(__file__), "..", "specs")


def _program(name):
    with open(os.path.join(SPECS, f"{name}.attn")) as f:
        return compile_program(parse(f.read()))


def _with(program, **kernels):
    return replace(program, warp_specialized=replace(program.warp_specialized, **kernels))


def test_the_passes_set_the_policy_tables_values():
    train = _program("train_causal_d64").warp_specialized
    assert train.forward == hopper.forward(64, True) and train.backward == hopper.backward(64, True)
    assert train.decode is None
    assert train.forward.main == ir.GluonShape(192, 128, 2, 3, 160, 128)
    assert train.forward.short == ir.GluonShape(128, 128, 2, 2, 240, 168) and train.forward.short_keys == 4096
    assert train.backward.short.consumers == 1 and train.backward.row_block == 64
    decode = _program("decode_paged16_d128").warp_specialized
    assert decode.decode == ir.GluonDecode(block_n=64, stages=3, rows=64, loader_regs=40) and decode.forward is None
    assert not _program("fwd_causal_d80").warp_specialized  # a padded head dim: no Gluon kernel


@pytest.mark.parametrize("name, bad, message", [
    ("fwd_causal_d128", lambda ws: dict(forward=replace(ws.forward, short=replace(ws.forward.short, consumers=1))),
     "changes the rows a consumer takes"),
    ("fwd_causal_d128", lambda ws: dict(forward=replace(ws.forward, main=replace(ws.forward.main, block_m=96))),
     "not a multiple of 64"),
    ("fwd_causal_d128", lambda ws: dict(forward=replace(ws.forward, main=replace(ws.forward.main, block_n=72))),
     "not a multiple of 16"),
    ("fwd_causal_d128", lambda ws: dict(forward=replace(ws.forward, short_keys=-1)), "short_keys -1 is negative"),
    ("fwd_causal_d128", lambda ws: dict(forward=replace(ws.forward, loader_regs=20)), "setmaxnreg"),
    ("fwd_causal_d128", lambda ws: dict(forward=replace(ws.forward, main=replace(ws.forward.main, consumer_regs=244))),
     "setmaxnreg"),
    ("fwd_causal_d128", lambda ws: dict(decode=hopper.decode()), "decode on a program without"),
    ("fwd_causal_d128", lambda ws: dict(backward=hopper.backward(128, False)), "backward without"),
    ("fwd_causal_d80", lambda ws: dict(forward=hopper.forward(128, True)), "head dim 80"),
    ("fwd_fp32_d32", lambda ws: dict(forward=hopper.forward(64, False)), "head dim 32"),
    ("train_causal_d64", lambda ws: dict(backward=replace(ws.backward, short=replace(ws.backward.short, consumers=3))),
     "not a power of two"),
    ("train_causal_d64", lambda ws: dict(backward=replace(ws.backward, row_block=48)), "do not divide"),
    ("train_causal_d64", lambda ws: dict(backward=replace(ws.backward, late_rows=3)), "late_rows 3"),
    ("train_causal_d64", lambda ws: dict(backward=replace(ws.backward, dq_claim_keys=-1)), "dq_claim_keys -1"),
    ("decode_d128", lambda ws: dict(decode=replace(ws.decode, rows=48)), "a power of two"),
    ("decode_d128", lambda ws: dict(decode=replace(ws.decode, consumers=2, block_n=128)), "the FP8 cache's"),
    ("decode_d128", lambda ws: dict(decode=replace(ws.decode, widen_by_sign=True)), "the FP8 cache's"),
    ("decode_d128", lambda ws: dict(decode=replace(ws.decode, stage_v=True)), "the FP8 cache's"),
    ("decode_d128", lambda ws: dict(decode=replace(ws.decode, stage_k=True)), "the FP8 cache's"),
    ("decode_fp8kv_d128", lambda ws: dict(decode=replace(hopper.DECODE_FP8, consumers=4)), "4 consumer warpgroups"),
    ("decode_fp8kv_d128", lambda ws: dict(decode=replace(hopper.DECODE_FP8, permute_k=True)), "permute_k's layout"),
    ("decode_fp8kv_d128", lambda ws: dict(decode=replace(hopper.DECODE_FP8_2WG, stage_k=True)), "permute_k's layout"),
    ("decode_fp8kv_d128", lambda ws: dict(decode=replace(hopper.DECODE_FP8, consumers=2, block_n=64)), "64-key blocks"),
    ("decode_d128", lambda ws: dict(forward=hopper.forward(128, True)), "forward on a KV-cache program"),
])
def test_the_verifier_rejects_a_bad_decision(name, bad, message):
    program = _program(name)
    verify(program, "test")  # the shipped decision passes
    with pytest.raises(InternalError, match=message):
        verify(_with(program, **bad(program.warp_specialized)), "warp-specialize")


def test_explain_prints_the_decision(capsys):
    text = ir.format_program(_program("train_causal_d64"))
    assert text.split("\n")[1:7] == [
        "gluon forward: 192x128 tiles, 2 stages, 3 consumers x 160 regs (maxnreg 128), loader 24 regs",
        "  short (<= 4096 keys): 128x128 tiles, 2 stages, 2 consumers x 240 regs (maxnreg 168)",
        "  runs from 2048 keys and 33554432 scores; overlap, early_p, trim, persistent, balance, pair",
        "gluon backward: 64x128 tiles, 2 stages, 2 consumers x 240 regs (maxnreg 168), loader 24 regs",
        "  short (<= 2048 keys): 64x64 tiles, 3 stages, 1 consumers x 232 regs (maxnreg 128)",
        "  runs from 1 keys and 33554432 scores; dq_atomic, rows_smem, prefetch, late_rows=0, dq_local_rows=0, "
        "dq_claim_keys=0, row_block=64, max_group_split=8",
    ]
    assert main(["explain", os.path.join(SPECS, "decode_paged16_d128.attn")]) == 0
    out = capsys.readouterr().out
    assert "gluon decode: 64-key blocks, 3 stages, <= 64 rows per K/V head, loader 40 regs" in out
    assert "gluon forward" not in out
    assert main(["explain", os.path.join(SPECS, "fwd_causal_d80.attn")]) == 0
    assert "gluon " not in capsys.readouterr().out


def test_the_runtime_takes_the_gluon_kernels_from_the_program():
    """The tuner's and `attngen tune`'s view of which Gluon kernels a module has is the program's typed value."""
    import attngen
    from attngen.cli import gluon_note
    from attngen.tuning import tunables

    kernel = attngen.load(spec_text("gluon_ir_rt", 128, "bf16", "none", direction="forward+backward"))
    assert kernel.program.warp_specialized.forward is not None and hasattr(kernel.module, "attn_fwd_ws")
    assert all(gluon_note(part, (9, 0)) for part in tunables(kernel))
    no_backward = replace(kernel.program, warp_specialized=replace(kernel.program.warp_specialized, backward=None))
    kernel._program = no_backward
    notes = [gluon_note(part, (9, 0)) for part in tunables(kernel)]
    assert notes[0] and notes[1:] == [None, None]
