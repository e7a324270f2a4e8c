"""matplotlib for the plots of ``kvstream simulate`` and ``kvstream bench``: an extra
(``pip install 'kvstream[plot]'``), imported only when a plot is drawn."""

from __future__ import annotations

from types import ModuleType

import click

#: Said when the extra is absent.
MISSING = "plots need matplotlib, which the 'plot' extra installs: pip install 'kvstream[plot]'"


def pyplot() -> ModuleType:
    """``matplotlib.pyplot`` on the Agg backend (files, no display); a one-line error
    naming the extra when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        raise click.ClickException(MISSING) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
