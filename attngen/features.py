"""What the generator can build today: specs asking for more get a clear error at their key."""

from __future__ import annotations

from .errors import UnsupportedError
from .spec import Spec


def check_supported(spec: Spec) -> None:
    if spec.split_kv != 1:
        raise spec.error("split_kv", "split_kv other than 1 is not supported yet", UnsupportedError)
    if spec.kv_layout.paged:
        raise spec.error("kv_layout", "a paged kv_layout is not supported yet", UnsupportedError)
