"""What the generator can build today: specs asking for more get a clear error at their key."""

from __future__ import annotations

from .errors import UnsupportedError
from .spec import Spec


def check_supported(spec: Spec) -> None:
    if spec.backward:
        raise spec.error("direction", "direction = forward+backward is not supported yet", UnsupportedError)
    # split_kv and paged kv_layouts: the decoding passes (kv-lengths, pack-gqa, split-kv, paged).
