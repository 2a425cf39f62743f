"""The Hopper policy's typed values, pinned, and policy changes reaching the kernel cache."""

from __future__ import annotations

import pytest

from attngen import ir
from attngen.policy import hopper

S = ir.GluonShape
ONE_TWO_EIGHT = S(block_m=128, block_n=128, stages=2, consumers=2, consumer_regs=240, maxnreg=168)
THREE_CONSUMERS = S(block_m=192, block_n=128, stages=2, consumers=3, consumer_regs=160, maxnreg=128)
COMMON = dict(loader_regs=24, overlap=True, pingpong=False, early_p=True, trim=True, persistent=True,
              min_scores=1 << 25)

# Written out from the tables as they stood when they were nested (name, value) tuples; any change to a
# produced value is a change of policy and must change these on purpose.
FORWARD = {
    (64, False): ir.GluonForward(main=THREE_CONSUMERS, short=ONE_TWO_EIGHT, balance=True, pair=False,
                                 min_keys=512, short_keys=512, **COMMON),
    (64, True): ir.GluonForward(main=THREE_CONSUMERS, short=ONE_TWO_EIGHT, balance=True, pair=True,
                                min_keys=2048, short_keys=4096, **COMMON),
    (128, False): ir.GluonForward(main=ONE_TWO_EIGHT, short=ONE_TWO_EIGHT, balance=True, pair=False, min_keys=1,
                                  short_keys=0, **COMMON),
    (128, True): ir.GluonForward(main=ONE_TWO_EIGHT,
                                 short=S(block_m=128, block_n=64, stages=3, consumers=2, consumer_regs=240, maxnreg=168),
                                 balance=False, pair=True, min_keys=1, short_keys=1024,
                                 **COMMON),
}

BWD = dict(block_m=64, block_n=128, consumers=2, consumer_regs=240, maxnreg=168)
BWD_COMMON = dict(loader_regs=24, ahead=False, dq_atomic=True, rows_smem=True, min_keys=1, min_scores=1 << 25,
                  max_group_split=8)
BACKWARD = {
    (64, False): ir.GluonBackward(main=S(stages=3, **BWD), short=S(stages=3, **BWD), prefetch=False, late_rows=0,
                                  split=False, dq_local_rows=1024, dq_claim_keys=0, row_block=64, short_keys=0,
                                  **BWD_COMMON),
    (64, True): ir.GluonBackward(main=S(stages=2, **BWD),
                                 short=S(block_m=64, block_n=64, stages=3, consumers=1, consumer_regs=232, maxnreg=128),
                                 prefetch=True, late_rows=0, split=False, dq_local_rows=0, dq_claim_keys=0,
                                 row_block=64, short_keys=2048, **BWD_COMMON),
    (128, False): ir.GluonBackward(main=S(stages=2, **BWD), short=S(stages=2, **BWD), prefetch=False, late_rows=1,
                                   split=True, dq_local_rows=0, dq_claim_keys=0, row_block=32, short_keys=0,
                                   **BWD_COMMON),
    (128, True): ir.GluonBackward(main=S(stages=2, **BWD), short=S(stages=2, **BWD), prefetch=True, late_rows=2,
                                  split=True, dq_local_rows=0, dq_claim_keys=1024, row_block=32, short_keys=0,
                                  **BWD_COMMON),
}


@pytest.mark.parametrize("key", sorted(FORWARD))
def test_forward_values_are_pinned(key):
    assert hopper.forward(*key) == FORWARD[key]


@pytest.mark.parametrize("key", sorted(BACKWARD))
def test_backward_values_are_pinned(key):
    assert hopper.backward(*key) == BACKWARD[key]


def test_decode_value_is_pinned():
    assert hopper.decode() == ir.GluonDecode(block_n=64, stages=3, rows=64, loader_regs=40)
