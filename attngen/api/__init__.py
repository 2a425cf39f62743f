"""The user-facing drop-ins: `sdpa` (attention), `kvcache` (attention_with_kvcache, merge_states), `paged`
(PagedKVCache)."""
