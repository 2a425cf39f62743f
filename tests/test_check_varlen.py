"""`attngen check` on a varlen spec: packed batches of several sequences of unequal lengths (an empty one among
them, seq_q != seq_k), each sequence compared with the float64 reference of it alone, forward and backward, in
Triton's interpreter."""

import torch

import attngen
from attngen.cli import main
from attngen.testing.accuracy import PackedCase, default_cases, format_result, validate
from conftest import spec_text

TRAIN = spec_text("vl_check", 32, "fp16", "causal", layout="varlen", direction="forward+backward", heads=4, kv_heads=2)
CASE = PackedCase(4, 2, (5, 0, 37, 3, 17), (9, 4, 37, 0, 40))


def test_varlen_cases_pack_unequal_sequences_with_an_empty_one_and_seq_q_unlike_seq_k():
    cases = default_cases(attngen.load(TRAIN).spec, small=True)
    assert all(isinstance(c, PackedCase) for c in cases) and len(cases) == 5
    packed = [c for c in cases if c.batch > 1]
    assert any(0 in c.lengths_q for c in packed) and any(0 in c.lengths_k for c in packed)
    assert any(n_q != n_k for c in packed for n_q, n_k in zip(c.lengths_q, c.lengths_k))
    assert all(len(set(c.lengths_q)) > 1 for c in packed)
    assert str(CASE) == "B=5 H=4/2 N_Q=5+0+37+3+17 N_K=9+4+37+0+40"


def test_attngen_check_prints_every_packed_case_forward_and_backward(tmp_path, capsys):
    path = tmp_path / "vl_check.attn"
    path.write_text(TRAIN)
    assert main(["check", str(path), "--seed", "1"]) == 0
    out = capsys.readouterr().out
    assert "ok   B=5 H=4/2 N_Q=5+0+37+3+17 N_K=9+4+37+0+40" in out
    assert out.count("  ok                                 dk") == 5 and "5/5 cases within tolerance" in out


class _OffInOneSequence:
    """A varlen kernel whose output (or, with `grads`, only its gradient) is off in the rows of one sequence."""

    def __init__(self, kernel, rows: slice, grads: bool):
        self.spec, self.module, self._kernel, self.rows, self.grads = kernel.spec, kernel.module, kernel, rows, grads

    def __call__(self, *args, **kwargs):
        out, lse = self._kernel(*args, **kwargs)
        off = torch.zeros_like(out, dtype=torch.bool)
        off[self.rows] = True
        # same values, twice the gradient (grads), or the values moved
        changed = out.detach() + 2 * (out - out.detach()) if self.grads else out + 0.5
        return torch.where(off, changed, out), lse


def test_check_fails_a_kernel_wrong_in_one_sequence_forward_or_backward():
    kernel = attngen.load(TRAIN)
    (good,) = validate(kernel, [CASE], seed=0)
    assert good.ok, format_result(good)
    fourth = slice(5 + 0 + 37, 5 + 0 + 37 + 3)  # the sequence whose 3 queries see no key: out must stay 0
    (bad,) = validate(_OffInOneSequence(kernel, fourth, grads=False), [CASE], seed=0)
    assert not bad.ok and "rows with no visible key must be exactly 0" in bad.problem
    (bad,) = validate(_OffInOneSequence(kernel, slice(5, 42), grads=True), [CASE], seed=0)  # the third sequence
    assert not bad.ok and bad.err <= bad.tol and {g.name for g in bad.grads if not g.ok} == {"dq", "dk", "dv"}
