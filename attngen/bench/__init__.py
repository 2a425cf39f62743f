"""`attngen bench`: the prefill suite (`prefill`), the decode suite (`decode`) and what both share (`common`)."""
