"""Figures as the run's artifacts show them: a matplotlib figure as PNG bytes, drawn without a
screen, and PNG bytes as markdown the Prefect UI renders inline (a data: URI, no image hosting)."""
from __future__ import annotations

import base64
import io
from typing import Any


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend: no screen is needed where the flow runs."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def png_bytes(figure: Any) -> bytes:
    """The figure as PNG bytes; the figure is closed."""
    buf = io.BytesIO()
    figure.savefig(buf, format="png")
    pyplot().close(figure)
    return buf.getvalue()


def png_markdown(png: bytes, alt: str) -> str:
    return f"![{alt}](data:image/png;base64,{base64.b64encode(png).decode()})"
