#!/usr/bin/env python3
"""Draws the curves of bench_ttft: time to N committed tokens after the end of
prefill, blocking bf16 / 8-bit / 4-bit against Lynx 8 = 4 + 4, one panel per
prompt length and link rate, from the CSV that `bench_ttft --csv FILE` writes.

    ./build/release/bench/bench_ttft --csv ttft.csv
    python3 bench/plot_ttft.py ttft.csv bench/figures/ttft.svg [--model gpu]

Needs matplotlib (`pip install matplotlib` or Debian's python3-matplotlib).
"""
import argparse
import csv
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv")
    ap.add_argument("out", help="output file (.svg or .png)")
    ap.add_argument("--cost", default="gpu", help="cost model of the rows to draw (gpu or cpu)")
    ap.add_argument("--model", default="Llama-3-8B", help="model of the rows (Llama-3-8B, Gemma-3-270M)")
    ap.add_argument("--gbps", default="10,100", help="link rates to draw, comma separated")
    ap.add_argument("--batch", default="1", help="decode batch of the rows to draw (bench_ttft --batch)")
    args = ap.parse_args()

    rows = [r for r in csv.DictReader(open(args.csv))
            if r["cost"] == args.cost and r["model"] == args.model and r["batch"] == args.batch]
    if not rows:
        print(f"no rows of {args.model}, cost model {args.cost}, batch {args.batch} in {args.csv}",
              file=sys.stderr)
        return 1
    rates = [float(x) for x in args.gbps.split(",")]
    prompts = sorted({int(r["tokens"]) for r in rows})
    fig, axes = plt.subplots(len(prompts), len(rates), figsize=(5.2 * len(rates), 3.9 * len(prompts)),
                             squeeze=False)
    series = [
        ("bf16_s", "blocking bf16", "tab:gray", "-"),
        ("blocking8_s", "blocking 8-bit", "tab:red", "-"),
        ("blocking4_s", "blocking 4-bit (lossy)", "tab:orange", ":"),
        ("lynx_all_s", "Lynx 8 = 4 + 4, every draft accepted", "tab:blue", "-"),
        ("lynx_prefix_s", "Lynx, first drafts accepted (stated prefix)", "tab:blue", "--"),
        ("lynx_none_s", "Lynx, no draft accepted", "tab:blue", ":"),
    ]
    for i, tokens in enumerate(prompts):
        for j, gbps in enumerate(rates):
            ax = axes[i][j]
            sel = sorted((r for r in rows if int(r["tokens"]) == tokens and float(r["gbps"]) == gbps),
                         key=lambda r: int(r["n"]))
            if not sel:
                ax.set_visible(False)
                continue
            ns = [int(r["n"]) for r in sel]
            for key, label, color, style in series:
                ax.plot([float(r[key]) * 1e3 for r in sel], ns, style, color=color, marker="o",
                        markersize=3, label=label)
            prov = float(sel[0]["first_provisional_s"]) * 1e3
            if prov > 0:
                ax.axvline(prov, color="tab:green", linestyle="-.", linewidth=1,
                           label="Lynx first provisional token")
            ax.set_title(f"{tokens // 1024}K prompt tokens, {gbps:g} Gbit/s "
                         f"({args.cost} cost model, decode batch {args.batch})", fontsize=10)
            ax.set_xlabel("ms after the end of prefill")
            ax.set_ylabel("committed tokens")
            ax.grid(alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=9)
    fig.suptitle(f"{args.model} KV cache: time to N committed tokens after the end of prefill",
                 fontsize=11)
    fig.tight_layout(rect=(0, 0.08, 1, 0.96))
    fig.savefig(args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
