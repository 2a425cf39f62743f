"""The specs attngen writes itself: `attention()`'s (`sdpa_spec`) and `attention_with_kvcache()`'s
(`kvcache_spec`), one per dtype, head dim, mask (and page size): sequence lengths, batch and heads are run-time
arguments of one compiled kernel."""

from __future__ import annotations

from functools import lru_cache

from . import variants as v
from .spec import Mask, Spec, parse


@lru_cache(maxsize=None)
def sdpa_spec(dtype: str, head_dim: int, causal: bool) -> Spec:
    """The spec `attention()` uses for one dtype / head dim / mask (with its backward)."""
    mask = "causal(top_left)" if causal else "none"
    name = f"sdpa_{dtype}_d{head_dim}_{'causal' if causal else 'full'}"
    text = (f"# written by attngen.attention()\nkernel {name} {{\n    direction = forward+backward\n"
            f"    mask = {mask}\n    head_dim = {head_dim}\n    dtype = {dtype}\n}}\n")
    return parse(text, f"<attention {name}>")


@lru_cache(maxsize=None)
def kvcache_spec(dtype: str, head_dim: int, causal: bool, page_size: int | None, window: tuple[int, int] = (-1, -1),
                 softcap: float = 0.0, alibi: bool = False, sinks: bool = False) -> Spec:
    """The spec `attention_with_kvcache()` uses for one dtype / head dim / mask / page size, and flash-attn's
    variants: `window` (left, right) keys around the query's position, -1 unbounded on that side (right is
    0 when causal); `softcap` C > 0: s -> C tanh(s / C); `alibi`: run-time slopes; `sinks`: run-time sinks.
    The caller has checked the values (api/kvcache.py)."""
    layout = f"paged(page_size = {page_size})" if page_size else "contiguous"
    left, right = window
    right = 0 if causal else right
    # A window unbounded on the left and closed at the query is the plain causal mask (flash-attn's (-1, 0)).
    causal = causal or (left < 0 and right == 0)
    windowed = left >= 0 or right >= 0 and not causal
    mask = "causal(bottom_right)" if causal else "none"
    variant = ""
    if windowed:
        variant += f"_w{left + 1}" if right == 0 else f"_l{_side(left)}r{_side(right)}"
    if softcap:
        variant += "_softcap" + format(float(softcap), "g").replace(".", "p").replace("+", "")
    variant += ("_alibi" if alibi else "") + ("_sinks" if sinks else "")
    name = (f"kvcache_{dtype}_d{head_dim}_{'causal' if causal else 'full'}{variant}_"
            f"{f'paged{page_size}' if page_size else 'contiguous'}")
    text = (f"# written by attngen.attention_with_kvcache()\nkernel {name} {{\n    mask = {mask}\n"
            f"    head_dim = {head_dim}\n    dtype = {dtype}\n    split_kv = auto\n    kv_layout = {layout}\n}}\n")
    spec = parse(text, f"<attention_with_kvcache {name}>")
    tree = v.Variant(_window(left, right) if windowed else None,
                     v.Softcap(float(softcap)) if softcap else v.Alibi() if alibi else None, sinks)
    if not tree:
        return spec
    # NOTE: built as a tree on the plain spec until the grammar reads the variant lines (`mask = window(W)`,
    # `score = softcap(C)`, `score = alibi`, `sinks = true`); the spec's canonical text prints them.
    return spec.replace(mask=Mask.CUSTOM if tree.mask is not None else spec.mask, variant=tree)


def _side(x: int) -> str:
    return "n" if x < 0 else str(x)


def _window(left: int, right: int):
    """Keys q - left <= k <= q + right around the (bottom-right aligned) query position, a side of -1
    unbounded: `window(W)` (W = left + 1) when right is 0, `window(L, R)`, or one comparison."""
    if left < 0:  # keys up to q + right
        return v.Compare("<=", v.BinOp("-", v.Var("k"), v.Var("q")), v.Const(right))
    if right < 0:  # keys from q - left on
        return v.Compare("<=", v.BinOp("-", v.Var("q"), v.Var("k")), v.Const(left))
    return v.Window(left, 0, left + 1) if right == 0 else v.Window(left, right)
