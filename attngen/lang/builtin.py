"""The specs attngen writes itself: `attention()`'s (`sdpa_spec`), `attention_with_kvcache()`'s (`kvcache_spec`),
`flash_attn_varlen_func()`'s (`varlen_spec`, keyed by `varlen_key`) and a context-parallel ALiBi block's
(`positional_alibi_spec`), one per dtype, head dim, mask (and page size): sequence lengths, batch and heads are
run-time arguments of one compiled kernel. `attention()`'s variant arguments (window, softcap, ALiBi, sinks) add a
`Variant` (`sdpa_variant`) and a suffix to the kernel's registry key (`sdpa_key`, read back by `sdpa_key_spec`)."""

from __future__ import annotations

import re
from functools import lru_cache

from .spec import DType, Mask, Spec, parse
from .variants import Alibi, And, BinOp, Causal, Compare, Const, Softcap, Var, Variant, Window

NO_WINDOW = (-1, -1)


@lru_cache(maxsize=None)
def sdpa_spec(dtype: str, head_dim: int, causal: bool, variant: Variant = Variant(), head_dim_v: int | None = None) -> Spec:
    """The spec `attention()` uses for one dtype / head dim / mask / variant (with its backward); `head_dim_v`: V's
    head dim where it is not head_dim (None where it is)."""
    mask = "causal(top_left)" if causal else "none"
    dims = _dims(head_dim, head_dim_v)
    name = f"sdpa_{dtype}_{dims}_{'causal' if causal else 'full'}"
    if variant:
        # e.g. sdpa_bf16_d128_causal_window_4096_softcap_30: readable, and an identifier
        words = " ".join(_variant_words(variant))
        name = f"sdpa_{dtype}_{dims}_" + re.sub(r"\W+", "_", words if variant.mask is not None
                                                else f"{'causal' if causal else 'full'} {words}").strip("_")
    # FP8 inputs have a forward only (the spec refuses a backward for them)
    direction = "forward" if dtype == DType.FP8_E4M3.value else "forward+backward"
    text = (f"# written by attngen.attention()\nkernel {name} {{\n    direction = {direction}\n"
            f"    mask = {mask}\n    head_dim = {head_dim}\n{_dim_v_line(head_dim_v)}    dtype = {dtype}\n}}\n")
    spec = parse(text, f"<attention {name}>")
    if not variant:
        return spec
    return spec.replace(mask=Mask.CUSTOM if variant.mask is not None else spec.mask, variant=variant)


def v_keyword(head_dim_v: int | None) -> dict:
    """`head_dim_v=` for the cached spec writers where V has another head dim: a call without it stays the call
    (and the cached spec) it always was."""
    return {"head_dim_v": head_dim_v} if head_dim_v else {}


def _dims(head_dim: int, head_dim_v: int | None) -> str:
    """The head dims in a kernel's name: `d128`, or `d192_dv128` where V has another."""
    return f"d{head_dim}" + (f"_dv{head_dim_v}" if head_dim_v else "")


def _dim_v_line(head_dim_v: int | None) -> str:
    return f"    head_dim_v = {head_dim_v}\n" if head_dim_v else ""


@lru_cache(maxsize=None)
def positional_alibi_spec(dtype: str, head_dim: int, causal: bool, window: tuple[int, int] = NO_WINDOW,
                          head_dim_v: int | None = None, side: str | None = None) -> str:
    """The spec text of one block of context-parallel attention under ALiBi (attngen.distributed): its mask in the
    block's own positions (causal top-left, a window `q - left <= k <= q + right` with -1 unbounded, or none) and
    ALiBi over the whole sequence's, `shift[b]` the distance of the block's first query from its first key there:
    `score = s - slopes[b, h] * abs(q - k + shift[b])`, the slopes and the shift run-time tensors. `side`: where the
    caller knows the sign of every distance the block keeps, "below" (q - k + shift >= 0: keys not after queries) or
    "above" (<= 0), the score without the abs, `s - slopes[b, h] * (q - k + shift[b])` or `... * (k - q - shift[b])`:
    linear on every block, which the Gluon kernels take as a key term and a row term (analysis/distance.py)."""
    if causal:
        mask = "causal(top_left)"
    else:
        left, right = window
        mask = " and ".join([f"k >= q - {left}"] * (left >= 0) + [f"k <= q + {right}"] * (right >= 0)) or "none"
    distance = {None: "abs(q - k + shift[b])", "below": "(q - k + shift[b])", "above": "(k - q - shift[b])"}[side]
    suffix = f"_{side}" if side else ""
    return (f"kernel cp_alibi{suffix}_{dtype}_{_dims(head_dim, head_dim_v)} {{\n    direction = forward+backward\n"
            f"    mask = {mask}\n    score = s - slopes[b, h] * {distance}\n"
            f"    tensor slopes[B, H]: fp32\n    tensor shift[B]: int32\n    head_dim = {head_dim}\n"
            f"{_dim_v_line(head_dim_v)}    dtype = {dtype}\n}}\n")


def _key_dims(head_dim: int, head_dim_v: int | None) -> str:
    """The head dims in a registry key: `128`, or `192,128` where V has another (`_key_head_dims` reads it)."""
    return f"{head_dim},{head_dim_v}" if head_dim_v else str(head_dim)


def _key_head_dims(text: str) -> tuple[int, int | None]:
    head_dim, _, head_dim_v = text.partition(",")
    return int(head_dim), int(head_dim_v) if head_dim_v else None


def _variant_words(variant: Variant):
    """The variant's parts as the spec writes them."""
    if variant.mask is not None:
        yield variant.mask.text()
    if variant.score is not None:
        yield variant.score.text()
    if variant.sinks:
        yield "sinks"


def sdpa_variant(causal: bool, window: tuple[int, int] = NO_WINDOW, softcap: float = 0.0, alibi: bool = False,
                 sinks: bool = False) -> Variant:
    """The variant of `attention()`'s checked arguments, flash-attn's semantics aligned top-left as SDPA's
    `is_causal` is: `window` (left, right) keeps keys with q - left <= k <= q + right, -1 leaving that side
    unbounded (with `causal`, right is 0 and the mask is `causal & window(left + 1)`); `softcap` > 0 is
    `softcap(C)`, 0 none; `alibi` and `sinks` say whether slopes and sinks are passed. Variant() when every
    argument is its default."""
    left, right = window
    mask = None
    if causal:
        if left >= 0:
            mask = And(Causal(), Window(left, 0, left + 1))
    elif left >= 0 and right >= 0:
        mask = Window(left, right)
    elif left >= 0:  # k >= q - left, keys to the right unbounded
        mask = Compare("<=", BinOp("-", Var("q"), Var("k")), Const(left))
    elif right >= 0:  # k <= q + right, keys to the left unbounded
        mask = Compare("<=", BinOp("-", Var("k"), Var("q")), Const(right))
    score = Softcap(float(softcap)) if softcap else Alibi() if alibi else None
    return Variant(mask, score, sinks)


def sdpa_key(dtype: str, head_dim: int, causal: bool, window: tuple[int, int] = NO_WINDOW, softcap: float = 0.0,
             alibi: bool = False, sinks: bool = False, head_dim_v: int | None = None) -> str:
    """The registry key of `attention()`'s kernel: `sdpa:<dtype>:<head_dim>:<causal|full>` (`<head_dim>,<head_dim_v>`
    where V has another head dim), then for each variant argument that is not its default
    `:window=<left>,<right>`, `:softcap=<C>`, `:alibi`, `:sinks` (`sdpa_key_spec` reads it back). Arguments as
    `sdpa_variant` takes them, checked."""
    key = f"sdpa:{dtype}:{_key_dims(head_dim, head_dim_v)}:{'causal' if causal else 'full'}"
    if tuple(window) != NO_WINDOW:
        key += f":window={window[0]},{window[1]}"
    if softcap:
        key += f":softcap={float(softcap)!r}"
    if alibi:
        key += ":alibi"
    if sinks:
        key += ":sinks"
    return key


def sdpa_key_spec(key: str) -> Spec:
    """The spec of an `sdpa_key`."""
    _, dtype, dims, mask, *parts = key.split(":")
    options = _key_options(key, parts)
    causal = mask == "causal"
    head_dim, head_dim_v = _key_head_dims(dims)
    variant = sdpa_variant(causal, **options) if options else Variant()
    return sdpa_spec(dtype, head_dim, causal, variant, **v_keyword(head_dim_v))


@lru_cache(maxsize=None)
def kvcache_spec(dtype: str, head_dim: int, causal: bool, page_size: int | None, window: tuple[int, int] = NO_WINDOW,
                 softcap: float = 0.0, alibi: bool = False, sinks: bool = False, head_dim_v: int | None = None,
                 v_from_k: bool = False, kv_dtype: str | None = None) -> Spec:
    """The spec `attention_with_kvcache()` uses for one dtype / head dim (and V's, `head_dim_v`, where it is another;
    `v_from_k`: V is the cache's first head_dim_v columns, MLA's latent cache) / mask / page size, and flash-attn's
    variant arguments as `sdpa_variant` reads them (the spec aligns them bottom-right, as it does the causal mask),
    written as spec text: e.g. `mask = causal & window(4096)`, `score = softcap(30)`, `sinks = true`; `kv_dtype`
    (e.g. "fp8_e4m3") where the cache's differs from q's."""
    variant = sdpa_variant(causal, window, softcap, alibi, sinks)
    layout = f"paged(page_size = {page_size})" if page_size else "contiguous"
    mask, words = _bottom_right(variant, causal)
    # e.g. kvcache_fp16_d128_causal_window_4096_sinks_paged16: readable, and an identifier
    cache = f"_{kv_dtype.split('_')[0]}kv" if kv_dtype else ""  # e.g. kvcache_bf16_fp8kv_d128_...
    name = (f"kvcache_{dtype}{cache}_{_dims(head_dim, head_dim_v)}{'_latent' if v_from_k else ''}_{words}_"
            f"{f'paged{page_size}' if page_size else 'contiguous'}")
    lines = [f"mask = {mask}", f"head_dim = {head_dim}"] + ([f"head_dim_v = {head_dim_v}"] if head_dim_v else []) + (
        [f"v = k[:{head_dim_v}]"] if v_from_k else []) + [f"dtype = {dtype}"] + (
        [f"kv_dtype = {kv_dtype}"] if kv_dtype else []) + ["split_kv = auto", f"kv_layout = {layout}"]
    return _flash_spec("attngen.attention_with_kvcache()", name, lines, variant)


def _bottom_right(variant: Variant, causal: bool) -> tuple[str, str]:
    """The spec's `mask = ...` text of flash-attn's arguments (aligned bottom-right), and the variant's words
    for a kernel name (e.g. `causal_window_4096_sinks`)."""
    if variant.mask is not None:
        mask = variant.mask.text()
        words = " ".join(_variant_words(variant))
    else:
        mask = "causal(bottom_right)" if causal else "none"
        words = " ".join(("causal" if causal else "full", *_variant_words(variant)))
    return mask, re.sub(r"[^0-9A-Za-z]+", "_", words).strip("_")


def _flash_spec(writer: str, name: str, lines: list[str], variant: Variant) -> Spec:
    """A spec of flash-attn's arguments: `lines` (mask, sizes, layout), then the variant's score and sinks."""
    if variant.score is not None:
        lines.append(f"score = {variant.score.text()}")
    if variant.sinks:
        lines.append("sinks = true")
    body = "".join(f"    {line}\n" for line in lines)
    text = f"# written by {writer}\nkernel {name} {{\n{body}}}\n"
    return parse(text, f"<{writer.removeprefix('attngen.').removesuffix('()')} {name}>")


@lru_cache(maxsize=None)
def varlen_spec(dtype: str, head_dim: int, causal: bool, page_size: int | None = None,
                gqa: tuple[int, int] | None = None, window: tuple[int, int] = NO_WINDOW, softcap: float = 0.0,
                alibi: bool = False, sinks: bool = False, head_dim_v: int | None = None) -> Spec:
    """The spec `flash_attn_varlen_func()` uses for one dtype / head dim (and V's, `head_dim_v`, where it is
    another) / mask / page size / GQA grouping (`gqa`: (heads, kv_heads), None when they are equal) and
    flash-attn's variant arguments, aligned bottom-right per sequence as `kvcache_spec` aligns them; with a
    backward unless K/V are paged."""
    variant = sdpa_variant(causal, window, softcap, alibi, sinks)
    mask, words = _bottom_right(variant, causal)
    # e.g. varlen_bf16_d128_causal_window_4096_gqa32_8_paged16
    name = (f"varlen_{dtype}_{_dims(head_dim, head_dim_v)}_{words}" + (f"_gqa{gqa[0]}_{gqa[1]}" if gqa else "")
            + (f"_paged{page_size}" if page_size else ""))
    lines = [f"direction = {'forward' if page_size else 'forward+backward'}", f"mask = {mask}",
             f"head_dim = {head_dim}"] + ([f"head_dim_v = {head_dim_v}"] if head_dim_v else []) + [
             f"dtype = {dtype}", "layout = varlen"]
    if page_size:
        lines.append(f"kv_layout = paged(page_size = {page_size})")
    if gqa:
        lines += [f"heads = {gqa[0]}", f"kv_heads = {gqa[1]}"]
    return _flash_spec("attngen.flash_attn_varlen_func()", name, lines, variant)


def varlen_key(dtype: str, head_dim: int, causal: bool, page_size: int | None = None,
               gqa: tuple[int, int] | None = None, window: tuple[int, int] = NO_WINDOW, softcap: float = 0.0,
               alibi: bool = False, sinks: bool = False, head_dim_v: int | None = None) -> str:
    """The registry key of `flash_attn_varlen_func()`'s kernel: `varlen:<dtype>:<head_dim>:<causal|full>` (head dims
    as `sdpa_key` writes them), then `:paged=<page_size>`, `:gqa=<heads>,<kv_heads>` where given, and `sdpa_key`'s
    variant parts (`varlen_key_spec` reads it back)."""
    key = f"varlen:{dtype}:{_key_dims(head_dim, head_dim_v)}:{'causal' if causal else 'full'}"
    if page_size:
        key += f":paged={page_size}"
    if gqa:
        key += f":gqa={gqa[0]},{gqa[1]}"
    return key + sdpa_key(dtype, head_dim, causal, window, softcap, alibi, sinks).removeprefix(
        f"sdpa:{dtype}:{head_dim}:{'causal' if causal else 'full'}")


def _key_options(key: str, parts: list[str], extra: tuple[str, ...] = ()) -> dict:
    """The keyword arguments `sdpa_key`'s (and `varlen_key`'s `extra`) parts name."""
    options = {}
    for part in parts:
        name, _, value = part.partition("=")
        if name == "window":
            options["window"] = tuple(int(x) for x in value.split(","))
        elif name == "softcap":
            options["softcap"] = float(value)
        elif name in ("alibi", "sinks") and not value:
            options[name] = True
        elif name == "paged" and name in extra:
            options["page_size"] = int(value)
        elif name == "gqa" and name in extra:
            options["gqa"] = tuple(int(x) for x in value.split(","))
        else:
            raise ValueError(f"unknown part {part!r} of key {key!r}")
    return options


def varlen_key_spec(key: str) -> Spec:
    """The spec of a `varlen_key`."""
    _, dtype, dims, mask, *parts = key.split(":")
    head_dim, head_dim_v = _key_head_dims(dims)
    options = _key_options(key, parts, ("paged", "gqa"))
    return varlen_spec(dtype, head_dim, mask == "causal", **options, **v_keyword(head_dim_v))
