"""Does the store hold fewer bytes than the distinct compressed layer blobs it came from?

Three images that share content (base; base + python3; base + python3 + a pip package)
are converted in that order into one fresh file store, in three scenarios:

- as published: the test layout, where each image reuses the layer blobs of the previous
  one. The converter skips a layer it converted before, so this mostly shows overhead.
- issue case: base, python, and `pip-onelayer` = base's layer + python3 and the pip
  package installed in ONE different layer (no layer blob in common with python's).
- flattened: every image squashed into a single layer of its own, so no layer is ever
  reused and only chunk-level dedup can save bytes.

After each conversion: the compressed source layer bytes of that image, the sum of the
distinct compressed layer blobs seen so far, the bytes the store holds (packs + index +
layers + images + refs) and their ratio. A ratio below 1 means the store is smaller than
keeping the layer blobs.

Run: .venv/bin/python bench/dedup.py
"""

from __future__ import annotations

import argparse
from pathlib import Path

from _common import (
    convert,
    derived_layout,
    fresh_store,
    images,
    layout_layers,
    store_bytes,
)
from _report import grouped_bars, machine_note, mb, pyplot, save_markdown, save_plot, table

HEADERS = [
    "step",
    "source layers MB",
    "distinct blobs so far MB",
    "store after MB",
    "packs MB",
    "meta MB",
    "store / distinct",
    "new chunks",
    "known chunks",
    "layers reused",
]


def scenario(name: str, steps: list[tuple[str, object, str]]) -> list[dict]:
    """Convert each (label, layout, tag) in order into one fresh store."""
    rows = []
    seen: dict[str, int] = {}
    with fresh_store(name.split()[0]) as store:
        for label, layout, tag in steps:
            layers = layout_layers(layout, tag)  # type: ignore[arg-type]
            for layer in layers:
                seen[layer["digest"]] = layer["size"]
            result, wall = convert(f"oci:{layout}:{tag}", store)
            sizes = store_bytes(store)
            total = sum(sizes.values())
            stats = result["stats"]
            rows.append(
                {
                    "step": label,
                    "source": sum(layer["size"] for layer in layers),
                    "distinct": sum(seen.values()),
                    "store": total,
                    "packs": sizes.get("packs", 0),
                    "meta": total - sizes.get("packs", 0),
                    "new": stats["chunks_new"],
                    "known": stats["chunks_known"],
                    "reused": f"{stats['layers_reused']}/{stats['layers']}",
                    "seconds": wall,
                }
            )
    return rows


def render(rows: list[dict]) -> str:
    return table(
        HEADERS,
        [
            [
                r["step"],
                mb(r["source"]),
                mb(r["distinct"]),
                mb(r["store"]),
                mb(r["packs"]),
                mb(r["meta"]),
                f"{r['store'] / r['distinct']:.3f}",
                r["new"],
                r["known"],
                r["reused"],
            ]
            for r in rows
        ],
    )


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()  # --help
    imgs = images()
    derived = derived_layout()
    scenarios = {
        "as published (layers shared)": [
            ("base", imgs.layout, "base"),
            ("+ python", imgs.layout, "python"),
            ("+ pip", imgs.layout, "pip"),
        ],
        "issue case (python3 + pip in one different layer)": [
            ("base", imgs.layout, "base"),
            ("+ python", imgs.layout, "python"),
            ("+ pip (one layer)", derived, "pip-onelayer"),
        ],
        "flattened (one fresh layer per image)": [
            ("base-flat", derived, "base-flat"),
            ("+ python-flat", derived, "python-flat"),
            ("+ pip-flat", derived, "pip-flat"),
        ],
    }
    results = {name: scenario(name, steps) for name, steps in scenarios.items()}

    sections = []
    for name, rows in results.items():
        text = render(rows)
        print(f"\n{name}\n{text}")
        sections.append((name, text))
    flat = results["flattened (one fresh layer per image)"]
    issue = results["issue case (python3 + pip in one different layer)"]
    summary = (
        f"Flattened: the store holds {mb(flat[-1]['store'])} MB for "
        f"{mb(flat[-1]['distinct'])} MB of distinct layer blobs "
        f"(ratio {flat[-1]['store'] / flat[-1]['distinct']:.3f}); "
        f"python-flat added {mb(flat[1]['store'] - flat[0]['store'])} MB for a "
        f"{mb(flat[1]['source'])} MB blob, pip-flat added "
        f"{mb(flat[2]['store'] - flat[1]['store'])} MB for a {mb(flat[2]['source'])} MB blob.\n"
        f"Issue case: the pip image's new {mb(issue[2]['distinct'] - issue[1]['distinct'])} MB "
        f"layer blob cost the store {mb(issue[2]['store'] - issue[1]['store'])} MB "
        f"(ratio after all three {issue[-1]['store'] / issue[-1]['distinct']:.3f}).\n\n"
        f"Machine: {machine_note()}. 'meta' = index + layers + images + refs objects."
    )
    print("\n" + summary)
    sections.append(("Summary", summary))
    path = save_markdown("dedup", "Store bytes vs distinct compressed layer blobs", sections)
    png = plot(results)
    print(f"\nwrote {path} and {png}")


def plot(results: dict[str, list[dict]]) -> Path:
    fig, axes = pyplot().subplots(1, len(results), figsize=(5 * len(results), 4.2), sharey=True)
    for ax, (name, rows) in zip(axes, results.items(), strict=True):
        x = range(len(rows))
        grouped_bars(
            ax,
            {
                "distinct layer blobs": [r["distinct"] / 1e6 for r in rows],
                "lazyfs store": [r["store"] / 1e6 for r in rows],
            },
        )
        for i, r in enumerate(rows):
            ax.annotate(
                f"{r['store'] / r['distinct']:.2f}",
                (i + 0.2, r["store"] / 1e6),
                ha="center",
                va="bottom",
                fontsize=8,
            )
        ax.set_xticks(list(x), [r["step"] for r in rows], fontsize=8)
        ax.set_title(name, fontsize=9)
        ax.set_ylabel("MB (cumulative)")
    axes[0].legend(fontsize=8)
    fig.suptitle("Store size vs distinct compressed layer blobs (labels: ratio)")
    fig.tight_layout()
    return save_plot(fig, "dedup")


if __name__ == "__main__":
    main()
