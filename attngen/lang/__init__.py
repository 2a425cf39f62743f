"""The spec language: the grammar (attn.lark), `Spec` and its parser (`spec`), the specs the API writes (`builtin`)."""
