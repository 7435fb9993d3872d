"""Every figure jaxllm writes, in one style: headless (Agg), titled, axes labelled with units,
saved as a PNG (its folder made first) and, when given its data, the JSON beside it
(``name.png`` -> ``name.json``), so a plotted number can always be read back exactly."""
from __future__ import annotations

import contextlib
import json
import os
from typing import Optional

DPI = 120
TITLE_SIZE = 10


@contextlib.contextmanager
def figure(path: str, title: Optional[str] = None, *, size=(9, 4), data=None, **subplots):
    """``with figure("out/x.png", "title", size=(w, h), ncols=2) as axes:`` draw on ``axes``
    (one Axes, or an array as ``plt.subplots`` returns it); on leaving, the figure is titled,
    laid out, saved to ``path`` and closed (also when drawing fails, so no figure leaks).
    ``data``: JSON-serialisable numbers the figure shows, written to ``path`` with ``.json``."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(figsize=size, **subplots)
    try:
        yield axes
        if title:
            fig.suptitle(title, fontsize=TITLE_SIZE)
        fig.tight_layout()
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        fig.savefig(path, dpi=DPI)
        if data is not None:
            with open(os.path.splitext(path)[0] + ".json", "w") as f:
                json.dump(data, f, indent=1)
    finally:
        plt.close(fig)


def running_mean(y, k: int):
    """Mean of each ``k`` consecutive values (len(y) - k + 1 of them)."""
    import numpy as np
    return np.convolve(np.asarray(y, float), np.ones(k) / k, "valid")
