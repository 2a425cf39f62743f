"""Markdown tables of attngen's speed against its peers, from the rows `attngen bench` wrote.

    python benchmarks/table.py benchmarks/results/nvidia_h200.json          the README's summary
    python benchmarks/table.py benchmarks/results/nvidia_h200.json --full   every row (docs/performance.md)

A ratio is attngen's throughput over a peer's at the same shape (above 1: attngen is faster). The
summary has one row per prefill direction, head dim and mask, with the range of the ratio over the
sequence lengths, and one row per decode batch size with the range over context lengths. Peers:
cuDNN (`sdpa_cudnn`), FlexAttention (`flex`, compiled) and FA2 (`sdpa_flash`: torch SDPA's flash
backend is FlashAttention-2). Decode compares CUDA-graph timings on both sides: attngen's contiguous
call with `cache_seqlens` as an int (`attngen_contiguous_graph`) against the peers' single calls,
and, in the [layers] column, several layers' calls in one graph (`*_layers`).
"""

from __future__ import annotations

import argparse
import json
import sys

PEERS = (("cuDNN", "sdpa_cudnn"), ("Flex", "flex"), ("FA2", "sdpa_flash"))


def _index(rows, suite, value):
    """{(provider, shape): throughput} for one suite's rows that have a value; a shape is the
    direction and the params as a sorted tuple."""
    return {(r["provider"], _shape(r)): r[value] for r in rows if r["suite"] == suite and r.get(value)}


def _shape(row):
    return (row["direction"],) + tuple(sorted(row["params"].items()))


def _span(ratios):
    """'lo-hi' of a list of ratios (one value when they agree to two decimals), '-' for none."""
    if not ratios:
        return "-"
    digits = 1 if min(ratios) >= 3 else 2  # "4.7-23.8x" reads better than "4.69-23.80x"
    lo, hi = f"{min(ratios):.{digits}f}", f"{max(ratios):.{digits}f}"
    return lo if lo == hi else f"{lo}-{hi}"


def _length(n):
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def _ratios(speed, mine, peer, shapes):
    """attngen's throughput over the peer's at each shape both measured."""
    return [speed[(mine, s)] / speed[(peer, s)] for s in shapes if (mine, s) in speed and (peer, s) in speed]


def prefill_groups(rows):
    """(direction, head_dim, causal) -> the params keys of attngen's prefill rows, by sequence length."""
    groups = {}
    for r in rows:
        if r["suite"] == "prefill" and r["provider"] == "attngen" and r.get("tflops"):
            p = r["params"]
            groups.setdefault((r["direction"], p["head_dim"], p["causal"]), []).append(_shape(r))
    for shapes in groups.values():
        shapes.sort(key=lambda s: dict(s[1:])["seqlen"])
    return dict(sorted(groups.items(), key=lambda g: (g[0][0] != "forward", g[0][1], g[0][2])))


def decode_groups(rows):
    """batch -> the params keys of attngen's contiguous [graph] decode rows, by context length."""
    groups = {}
    for r in rows:
        if r["suite"] == "decode" and r["provider"] == "attngen_contiguous_graph" and r.get("gbps"):
            groups.setdefault(r["params"]["batch"], []).append(_shape(r))
    for shapes in groups.values():
        shapes.sort(key=lambda s: dict(s[1:])["context"])
    return dict(sorted(groups.items()))


def summary(data):
    """The README's table: ratio ranges per prefill group and per decode batch."""
    rows = data["rows"]
    tflops, gbps = _index(rows, "prefill", "tflops"), _index(rows, "decode", "gbps")
    peers = " | ".join(f"vs {name}" for name, _ in PEERS)
    out = [f"| workload | lengths | attngen | {peers} |", "|---|---|---|" + "---|" * len(PEERS)]
    for (direction, d, causal), shapes in prefill_groups(rows).items():
        lengths = [dict(s[1:])["seqlen"] for s in shapes]
        top = tflops[("attngen", shapes[-1])]
        cells = [_span(_ratios(tflops, "attngen", peer, shapes)) for _, peer in PEERS]
        out.append(f"| {direction} d={d} {'causal' if causal else 'no mask'} | {_length(lengths[0])}-"
                   f"{_length(lengths[-1])} | {top:.0f} TFLOP/s at {_length(lengths[-1])} | " + " | ".join(cells) + " |")
    for batch, shapes in decode_groups(rows).items():
        contexts = [dict(s[1:])["context"] for s in shapes]
        top = gbps[("attngen_contiguous_graph", shapes[-1])]
        cells = [_span(_ratios(gbps, "attngen_contiguous_graph", peer, shapes)) for _, peer in PEERS]
        # cuDNN is the decode target: its [layers] timing (several layers in one graph) is shown too
        layers = _span(_ratios(gbps, "attngen_contiguous_layers", "sdpa_cudnn_layers", shapes))
        cells[0] += f" ([layers] {layers})"
        out.append(f"| decode batch {batch} | {_length(contexts[0])}-{_length(contexts[-1])} | "
                   f"{top:.0f} GB/s at {_length(contexts[-1])} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def _cell(speed, key, digits=0):
    return f"{speed[key]:.{digits}f}" if key in speed else "-"


def full(data):
    """Every prefill and decode row of attngen and its peers, with attngen's ratios."""
    rows = data["rows"]
    tflops, gbps = _index(rows, "prefill", "tflops"), _index(rows, "decode", "gbps")
    names = " | ".join(name for name, _ in PEERS)
    vs = " | ".join(f"vs {name}" for name, _ in PEERS)
    out = [f"| direction | d | mask | N | attngen | {names} | {vs} |", "|---|---|---|---|---|" + "---|" * 2 * len(PEERS)]
    for (direction, d, causal), shapes in prefill_groups(rows).items():
        for s in shapes:
            speeds = [_cell(tflops, (peer, s)) for _, peer in PEERS]
            ratios = [_span(_ratios(tflops, "attngen", peer, [s])) for _, peer in PEERS]
            out.append(f"| {direction} | {d} | {'causal' if causal else 'none'} | {dict(s[1:])['seqlen']} | "
                       f"{tflops[('attngen', s)]:.0f} | " + " | ".join(speeds + ratios) + " |")
    columns = (("contiguous", "attngen_contiguous_graph"), ("contiguous, lengths tensor", "attngen_contiguous_lens_graph"),
               ("paged 16", "attngen_paged_16_graph"), ("cuDNN", "sdpa_cudnn"), ("Flex", "flex"),
               ("FA2", "sdpa_flash"), ("contiguous [layers]", "attngen_contiguous_layers"),
               ("paged 16 [layers]", "attngen_paged_16_layers"), ("cuDNN [layers]", "sdpa_cudnn_layers"))
    out += ["", "| batch | context | " + " | ".join(name for name, _ in columns) + " | vs cuDNN | vs cuDNN [layers] | "
            "paged 16 / contiguous |", "|---|---|" + "---|" * (len(columns) + 3)]
    for batch, shapes in decode_groups(rows).items():
        for s in shapes:
            cells = [_cell(gbps, (provider, s)) for _, provider in columns]
            cells += [_span(_ratios(gbps, "attngen_contiguous_graph", "sdpa_cudnn", [s])),
                      _span(_ratios(gbps, "attngen_contiguous_layers", "sdpa_cudnn_layers", [s])),
                      _span(_ratios(gbps, "attngen_paged_16_graph", "attngen_contiguous_graph", [s]))]
            out.append(f"| {batch} | {_length(dict(s[1:])['context'])} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", help="benchmarks/results/<gpu>.json, as `attngen bench` writes it")
    parser.add_argument("--full", action="store_true", help="every row instead of the summary")
    args = parser.parse_args(argv)
    with open(args.results) as f:
        data = json.load(f)
    print(f"{data['device']}, {data['date']} (torch {data['torch']}, Triton {data['triton']})\n")
    print(full(data) if args.full else summary(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
