"""Looking at attention: an ASCII map for the terminal, a PNG grid of every head."""

from __future__ import annotations

from typing import Sequence

import numpy as np

RAMP = " .:-=+*#%@"  # denser character, larger weight


def ascii_attention(weights, row_labels: Sequence[str], col_labels: Sequence[str], ramp: str = RAMP) -> str:
    """Renders a `[rows, cols]` weight matrix with one character per cell.

    A weight w in [0, 1] takes `ramp[min(int(w * len(ramp)), len(ramp) - 1)]`: `@` is
    close to 1, a blank close to 0.

    Args:
      weights: `[rows, cols]` attention weights (rows: decoder steps, cols: source).
      row_labels: one label per row.
      col_labels: one label per column.
      ramp: characters from lightest to densest.

    Returns:
      The map as a multi-line string.
    """
    weights = np.asarray(weights, np.float64)
    if weights.shape != (len(row_labels), len(col_labels)):
        raise ValueError(f"weights shape {weights.shape} does not match "
                         f"{len(row_labels)} row labels x {len(col_labels)} column labels")
    top = len(ramp) - 1
    lines = ["        " + "".join(f"{c:>3}" for c in col_labels) + "   <- source (encoder)"]
    for label, row in zip(row_labels, weights):
        cells = "".join(f"  {ramp[min(max(int(w * len(ramp)), 0), top)]}" for w in row)
        lines.append(f"  {label:>5} {cells}")
    lines.append("  ^ decoder step")
    return "\n".join(lines)


def save_attention_grid(weights, path, row_labels: Sequence[str], col_labels: Sequence[str],
                        title: str = "cross-attention") -> None:
    """Saves a PNG heatmap of every layer and head.

    Args:
      weights: `[n_layer, n_head, rows, cols]` attention weights of one example.
      path: the PNG file to write.
      row_labels: labels of the rows (decoder steps).
      col_labels: labels of the columns (source positions).
      title: figure title.
    """
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    weights = np.asarray(weights, np.float64)
    n_layer, n_head = weights.shape[:2]
    fig, axes = plt.subplots(n_layer, n_head, figsize=(2.6 * n_head, 2.6 * n_layer), squeeze=False)
    for layer in range(n_layer):
        for head in range(n_head):
            ax = axes[layer, head]
            ax.imshow(weights[layer, head], cmap="viridis", vmin=0.0, vmax=1.0)
            ax.set_title(f"layer {layer} head {head}", fontsize=8)
            ax.set_xticks(range(len(col_labels)), col_labels, fontsize=6)
            ax.set_yticks(range(len(row_labels)), row_labels, fontsize=6)
    fig.suptitle(f"{title} (rows: decoder step, columns: source position)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
