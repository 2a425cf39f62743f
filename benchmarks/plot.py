"""Plot benchmark results in the style of the FlashAttention README.

    python benchmarks/plot.py benchmarks/results/nvidia_h200.json [OUT_DIR]

Needs matplotlib (the `bench` extra): plots are drawn here from the JSON `attngen bench` wrote on
the GPU machine, which need not have matplotlib. Writes, per GPU:
  <gpu>_prefill_forward.png, <gpu>_prefill_backward.png   TFLOP/s against N, a panel per (d, causal)
  <gpu>_decode.png                                         GB/s of K/V read against context length
  variants_<gpu>.png (from variants_<gpu>.json)             TFLOP/s on kept scores per variant and provider
  shapes_<gpu>.png (from shapes_<gpu>.json)                 TFLOP/s on kept scores per head shape and provider
"""

from __future__ import annotations

import json
import os
import sys

STYLE = {"attngen": ("tab:red", "o"), "flex": ("tab:blue", "s"), "sdpa_flash": ("tab:green", "^"),
         "sdpa_cudnn": ("tab:purple", "D"), "sdpa_efficient": ("tab:orange", "v"), "naive": ("tab:gray", "x")}
# attngen's decode variants, in reds and browns, apart from the peers' colours above.
DECODE_COLORS = {"attngen_contiguous_graph": "tab:red", "attngen_paged_16_graph": "darkred",
                 "attngen_contiguous": "salmon", "attngen_paged_16": "rosybrown", "attngen_paged_64": "sienna",
                 "attngen_contig_1_split": "chocolate", "attngen_contiguous_layers": "crimson",
                 "attngen_paged_16_layers": "maroon", "attngen_contiguous_lens_graph": "orange",
                 "attngen_paged_16_lens_graph": "peru"}


def _style(provider):
    base = provider.split("[")[0].removesuffix("_layers").removesuffix("_graph")
    return STYLE.get(base, ("black", "."))


def plot_prefill(rows, device, slug, out_dir):
    import matplotlib.pyplot as plt

    paths = []
    for direction in ("forward", "backward"):
        sel = [r for r in rows if r["suite"] == "prefill" and r["direction"] == direction and r.get("tflops")]
        if not sel:
            continue
        panels = sorted({(r["params"]["head_dim"], r["params"]["causal"]) for r in sel})
        fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), squeeze=False)
        for ax, (d, causal) in zip(axes[0], panels):
            for provider in sorted({r["provider"] for r in sel}, key=lambda p: (p != "attngen", p)):
                pts = sorted((r["params"]["seqlen"], r["tflops"]) for r in sel
                             if r["provider"] == provider and (r["params"]["head_dim"], r["params"]["causal"]) == (d, causal))
                if pts:
                    color, marker = _style(provider)
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker, color=color, label=provider,
                            linewidth=2.2 if provider == "attngen" else 1.2)
            ax.set_xscale("log", base=2)
            ax.set_title(f"head dim {d}, {'causal' if causal else 'non-causal'}")
            ax.set_xlabel("sequence length N")
            ax.set_ylabel("TFLOP/s")
            ax.grid(alpha=0.3)
        axes[0][0].legend(fontsize=8)
        fig.suptitle(f"{direction}, bf16, batch x N = 16384, hidden 2048 -- {device}")
        fig.tight_layout()
        path = os.path.join(out_dir, f"{slug}_prefill_{direction}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def plot_decode(rows, device, slug, out_dir):
    import matplotlib.pyplot as plt

    sel = [r for r in rows if r["suite"] == "decode" and r.get("gbps")]
    if not sel:
        return []
    batches = sorted({r["params"]["batch"] for r in sel})
    fig, axes = plt.subplots(1, len(batches), figsize=(4.2 * len(batches), 3.6), squeeze=False)
    for ax, batch in zip(axes[0], batches):
        for provider in sorted({r["provider"] for r in sel}, key=lambda p: (not p.startswith("attngen"), p)):
            pts = sorted((r["params"]["context"], r["gbps"]) for r in sel if r["provider"] == provider and r["params"]["batch"] == batch)
            if pts:
                color, marker = _style(provider)
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker, label=provider,
                        linestyle="--" if provider.endswith("_layers") else "-",
                        color=DECODE_COLORS.get(provider, "black") if provider.startswith("attngen") else color,
                        linewidth=2.2 if provider.startswith("attngen") else 1.2)
        ax.set_xscale("log", base=2)
        ax.set_title(f"batch {batch}")
        ax.set_xlabel("context length")
        ax.set_ylabel("GB/s of K/V read")
        ax.grid(alpha=0.3)
    # one legend for the three panels, right of them: the providers are the same in each
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.suptitle(f"decode, bf16, 32 query / 8 KV heads, d=128 -- {device}")
    fig.tight_layout()
    path = os.path.join(out_dir, f"{slug}_decode.png")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return [path]


def plot_variants(rows, device, slug, out_dir):
    """TFLOP/s on kept scores per variant, a bar per provider, a panel per direction."""
    sel = [r for r in rows if r["suite"] == "variants" and r.get("tflops")]
    if not sel:
        return []
    first = sel[0]["params"]
    return _bars(sel, "variant", f"variants, bf16, B={first['batch']} H={first['heads']} N={first['seqlen']} "
                 f"d={first['head_dim']} -- {device}", slug, out_dir)


def plot_shapes(rows, device, slug, out_dir):
    """TFLOP/s on kept scores per head shape, a bar per provider, a panel per direction."""
    sel = [r for r in rows if r["suite"] == "shapes" and r.get("tflops")]
    if not sel:
        return []
    return _bars(sel, "shape", f"head shapes, bf16 -- {device}", slug, out_dir)


def _bars(sel, key, title, slug, out_dir):
    """Bars of the rows' TFLOP/s: a group per `params[key]`, a bar per provider, a panel per direction."""
    import matplotlib.pyplot as plt

    directions = [d for d in ("forward", "backward") if any(r["direction"] == d for r in sel)]
    groups = list(dict.fromkeys(r["params"][key] for r in sel))
    names = [p for p in STYLE if any(r["provider"] == p for r in sel)]
    width = 0.8 / len(names)
    fig, axes = plt.subplots(1, len(directions), figsize=(6.5 * len(directions), 3.8), squeeze=False)
    for ax, direction in zip(axes[0], directions):
        for i, provider in enumerate(names):
            xs, ys = [], []
            for j, group in enumerate(groups):
                r = next((r for r in sel if (r["direction"], r["provider"], r["params"][key]) ==
                          (direction, provider, group)), None)
                if r:
                    xs.append(j + (i - (len(names) - 1) / 2) * width)
                    ys.append(r["tflops"])
            ax.bar(xs, ys, width, color=_style(provider)[0], label=provider)
        ax.set_xticks(range(len(groups)))
        ax.set_xticklabels(groups, rotation=30, ha="right", fontsize=8)
        ax.set_title(direction)
        ax.set_ylabel("TFLOP/s (kept scores)")
        ax.grid(alpha=0.3, axis="y")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    path = os.path.join(out_dir, f"{slug}.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def main(path, out_dir=None):
    with open(path) as f:
        data = json.load(f)
    out_dir = out_dir or os.path.dirname(path)
    slug = os.path.splitext(os.path.basename(path))[0]
    plots = (plot_prefill(data["rows"], data["device"], slug, out_dir) + plot_decode(data["rows"], data["device"], slug, out_dir)
             + plot_variants(data["rows"], data["device"], slug, out_dir)
             + plot_shapes(data["rows"], data["device"], slug, out_dir))
    for p in plots:
        print(p)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)
