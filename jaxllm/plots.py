"""Every figure jaxllm writes, in one style: headless (Agg), titled, axes labelled with units,
saved as a PNG (its folder made first; through jaxllm.outputs) and, when given its data, the JSON beside it
(``name.png`` -> ``name.json``), so a plotted number can always be read back exactly."""
from __future__ import annotations

import contextlib
import os
from typing import Optional

from . import outputs

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
        # through jaxllm.outputs: a temporary name renamed into place, never a file we did
        # not write (the format from the path's extension, as the temporary name has none)
        fmt = os.path.splitext(path)[1].lstrip(".").lower() or "png"
        with outputs.atomic_file(path) as tmp:
            fig.savefig(tmp, dpi=DPI, format=fmt)
        if data is not None:
            outputs.write_json(os.path.splitext(path)[0] + ".json", data)
    finally:
        plt.close(fig)


def running_mean(y, k: int):
    """Mean of each ``k`` consecutive values (len(y) - k + 1 of them)."""
    import numpy as np
    return np.convolve(np.asarray(y, float), np.ones(k) / k, "valid")
