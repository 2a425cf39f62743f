"""PagedKVCache: pages on demand, appends through the Triton kernel, free, fork with copy on write,
attention over the cache, and a simulated serving workload's memory utilisation."""

import random

import pytest
import torch

import attngen
from attngen import KernelInputError
from attngen.testing import reference
from attngen.api.paged import OutOfPages, PagedKVCache
from conftest import DEVICE


def rand(*shape, dtype=torch.float16, device=DEVICE, gen=None):
    return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(dtype)


class Shadow:
    """What each sequence should hold, kept as plain contiguous tensors."""

    def __init__(self):
        self.k, self.v = {}, {}

    def append(self, seq, k, v):
        self.k[seq] = torch.cat([self.k.get(seq, k[:0]), k])
        self.v[seq] = torch.cat([self.v.get(seq, v[:0]), v])

    def fork(self, seq, child):
        self.k[child], self.v[child] = self.k[seq].clone(), self.v[seq].clone()


def assert_holds(cache, shadow, seq):
    n = cache.length(seq)
    table = cache.block_table([seq], device="cpu")[0]
    assert n == shadow.k[seq].shape[0]
    assert torch.equal(reference.gather_cache(cache.k_pages.cpu(), n, table), shadow.k[seq].cpu())
    assert torch.equal(reference.gather_cache(cache.v_pages.cpu(), n, table), shadow.v[seq].cpu())


def test_append_allocates_on_demand_and_writes_every_token():
    cache = PagedKVCache(num_pages=12, page_size=4, kv_heads=2, head_dim=16, device=DEVICE)
    shadow, gen = Shadow(), torch.Generator(DEVICE).manual_seed(0)
    a, b = cache.new_sequence(), cache.new_sequence()
    for tokens in (5, 1, 3, 4):
        k, v = rand(2, tokens, 2, 16, gen=gen), rand(2, tokens, 2, 16, gen=gen)
        cache.append([a, b], k, v)
        shadow.append(a, k[0], v[0])
        shadow.append(b, k[1], v[1])
    assert cache.length(a) == 13 and len(cache.pages(a)) == 4  # ceil(13 / 4)
    assert cache.free_pages == 12 - 8
    for seq in (a, b):
        assert_holds(cache, shadow, seq)
    assert cache.utilization() == pytest.approx(26 / 32)
    cache.free(a)
    assert cache.free_pages == 8 and cache.utilization() == pytest.approx(13 / 16)


def test_append_takes_any_strides():
    """Rows are read at unit stride by the append kernel: a view with a strided head dim (or
    transposed heads) is copied first instead of being read as garbage."""
    cache = PagedKVCache(num_pages=4, page_size=4, kv_heads=2, head_dim=16, device=DEVICE)
    shadow, gen = Shadow(), torch.Generator(DEVICE).manual_seed(3)
    s = cache.new_sequence()
    wide = rand(5, 2, 32, gen=gen)
    heads_last = rand(5, 16, 2, gen=gen)
    for k, v in ((wide[..., ::2], wide[..., 1::2]), (heads_last.transpose(1, 2), rand(5, 2, 16, gen=gen))):
        cache.append(s, k, v)
        shadow.append(s, k, v)
    assert_holds(cache, shadow, s)


def test_fork_shares_pages_and_copies_the_partial_page_on_write():
    cache = PagedKVCache(num_pages=10, page_size=4, kv_heads=1, head_dim=16, device=DEVICE)
    shadow, gen = Shadow(), torch.Generator(DEVICE).manual_seed(1)
    parent = cache.new_sequence()
    k, v = rand(6, 1, 16, gen=gen), rand(6, 1, 16, gen=gen)
    cache.append(parent, k, v)
    shadow.append(parent, k, v)
    child = cache.fork(parent)
    shadow.fork(parent, child)
    assert cache.pages(child) == cache.pages(parent) and cache.free_pages == 8
    # The child appends: its full first page stays shared, its partial second page is copied.
    k2, v2 = rand(3, 1, 16, gen=gen), rand(3, 1, 16, gen=gen)
    cache.append(child, k2, v2)
    shadow.append(child, k2, v2)
    assert cache.pages(child)[0] == cache.pages(parent)[0]
    assert cache.pages(child)[1] != cache.pages(parent)[1]
    # The parent, now the only holder of its partial page, appends in place.
    before = cache.pages(parent)
    k3, v3 = rand(1, 1, 16, gen=gen), rand(1, 1, 16, gen=gen)
    cache.append(parent, k3, v3)
    shadow.append(parent, k3, v3)
    assert cache.pages(parent) == before
    for seq in (parent, child):
        assert_holds(cache, shadow, seq)
    cache.free(parent)
    assert_holds(cache, shadow, child)  # the shared first page survives its other holder
    cache.free(child)
    assert cache.free_pages == 10 and cache.utilization() == 1.0


def test_out_of_pages_changes_nothing_and_bad_calls_are_named():
    cache = PagedKVCache(num_pages=2, page_size=4, kv_heads=1, head_dim=16, device=DEVICE)
    s = cache.new_sequence()
    with pytest.raises(OutOfPages, match="needs 3 pages; 2 of 2 are free"):
        cache.append(s, rand(9, 1, 16), rand(9, 1, 16))
    assert cache.length(s) == 0 and cache.free_pages == 2
    with pytest.raises(KernelInputError, match="k must be"):
        cache.append(s, rand(3, 2, 16), rand(3, 1, 16))
    with pytest.raises(KernelInputError, match="no sequence 7"):
        cache.append([7], rand(1, 3, 1, 16), rand(1, 3, 1, 16))
    with pytest.raises(KernelInputError, match="page_size"):
        PagedKVCache(num_pages=2, page_size=12, kv_heads=1, head_dim=16, device=DEVICE)


def test_attention_over_the_cache_matches_the_reference():
    cache = PagedKVCache(num_pages=40, page_size=8, kv_heads=2, head_dim=32, device=DEVICE)
    gen = torch.Generator(DEVICE).manual_seed(2)
    seqs = [cache.new_sequence() for _ in range(3)]
    for seq, n in zip(seqs, (20, 1, 45)):
        cache.append(seq, rand(n, 2, 32, gen=gen), rand(n, 2, 32, gen=gen))
    seqs.append(cache.fork(seqs[2]))
    cache.append([seqs[2], seqs[3]], rand(2, 3, 2, 32, gen=gen), rand(2, 3, 2, 32, gen=gen))
    q = rand(4, 1, 4, 32, gen=gen)
    seqlens, table = cache.seqlens(seqs), cache.block_table(seqs)
    out, lse = attngen.attention_with_kvcache(q, cache.k_pages, cache.v_pages, seqlens, table, return_softmax_lse=True)
    ref, ref_lse = reference.kvcache_attention(q, cache.k_pages, cache.v_pages, seqlens.cpu(), table.cpu())
    assert (out.double() - ref).abs().max().item() < 2e-3 and (lse.double() - ref_lse).abs().max().item() < 2e-3


def simulate(device, steps, page_size=16, kv_heads=1, head_dim=16, seed=0):
    """A serving workload: requests arrive with a prompt, grow by a few tokens a step, finish at a
    random length, and some are forked (parallel sampling). Returns the time-averaged utilisation
    of the paged cache and of a contiguous cache reserving the maximum length per live sequence."""
    rng = random.Random(seed)
    max_len = 1024
    cache = PagedKVCache(num_pages=4096, page_size=page_size, kv_heads=kv_heads, head_dim=head_dim, device=device)
    target, live = {}, []
    paged, contiguous = [], []
    row = lambda n: torch.ones(n, kv_heads, head_dim, device=device, dtype=torch.float16)  # noqa: E731
    for _ in range(steps):
        for _ in range(rng.randint(0, 2)):  # arrivals, each with its prompt
            seq = cache.new_sequence()
            prompt = rng.randint(32, 400)
            cache.append(seq, row(prompt), row(prompt))
            target[seq] = rng.randint(prompt + 16, max_len)
            live.append(seq)
            if rng.random() < 0.15:  # parallel sampling: a fork shares the prompt's pages
                child = cache.fork(seq)
                target[child] = rng.randint(prompt + 16, max_len)
                live.append(child)
        if live:  # one decode step of 8 tokens (e.g. speculative decoding) for every live sequence
            cache.append(live, row(8 * len(live)).view(len(live), 8, kv_heads, head_dim),
                         row(8 * len(live)).view(len(live), 8, kv_heads, head_dim))
        for seq in [s for s in live if cache.length(s) >= target[s]]:
            cache.free(seq)
            live.remove(seq)
        if live:
            paged.append(cache.utilization())
            tokens = sum(cache.length(s) for s in live)
            contiguous.append(tokens / (len(live) * max_len))
    return sum(paged) / len(paged), sum(contiguous) / len(contiguous)


def test_simulated_serving_workload_utilisation():
    paged, contiguous = simulate(DEVICE, steps=150)
    print(f"\nKV memory utilisation (bytes holding tokens / bytes allocated), time-averaged over a simulated "
          f"workload: paged (16-token pages) {paged:.1%}, contiguous max-length reservation {contiguous:.1%}")
    assert paged >= 0.96
    assert contiguous < 0.6


@pytest.mark.gpu
def test_gpu_simulated_serving_workload_utilisation():
    paged, contiguous = simulate("cuda", steps=600, kv_heads=8, head_dim=128, seed=1)
    print(f"\n[gpu] KV memory utilisation: paged {paged:.1%}, contiguous max-length reservation {contiguous:.1%}")
    assert paged >= 0.96 and contiguous < 0.6


def test_append_kernel_compiles_for_sm90():
    """The interpreter accepts code the real compiler rejects: compile the append kernel for Hopper."""
    from probe import probe

    pointers = {name: "*bf16" for name in ("K_SRC", "V_SRC", "K_POOL", "V_POOL")}
    scales = {"K_SCALE": "*fp32", "V_SCALE": "*fp32"}
    # a 16-bit pool, and an FP8 one that bf16 appends are quantised into
    fp8 = dict(pointers, K_POOL="*fp8e4nv", V_POOL="*fp8e4nv")
    results = probe([dict(module="attngen.api.paged", kernel="_append_kv", num_warps=4, num_stages=1,
                          constexprs=dict(BLOCK_T=64, BLOCK_W=256, HEAD_DIM=128, QUANTIZE=quantize),
                          ptr_dtypes=dict(pool, SLOTS="*i64", **scales))
                     for pool, quantize in ((pointers, False), (fp8, True))])
    for result in results:
        assert "error" not in result, result
