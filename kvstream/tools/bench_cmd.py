"""``kvstream bench NAME``: the entry to the benchmark harness, which is no part of the
installed package: it lives in ``bench/`` of a kvstream source checkout (with the tests;
it starts brokers, peer routers and load generators, and installs wrk/oha when absent).

From a checkout (installed with ``pip install -e .``, or on ``PYTHONPATH``) this command
is the harness's own group; from a wheel it says what to do in one line.
"""

from __future__ import annotations

import click

#: Said when the harness cannot be imported.
MISSING = (
    "the benchmark harness is not installed (it is bench/ in a kvstream source checkout): "
    "run `kvstream bench` from a checkout installed with `pip install -e .`, or with the checkout on PYTHONPATH"
)

try:
    from bench import bench
except ModuleNotFoundError as exc:
    if exc.name != "bench":  # the harness is there but needs something: say that instead
        raise

    @click.command(
        "bench",
        context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
        help=f"Benchmarks of the hot paths (unavailable: {MISSING}).",
    )
    @click.argument("args", nargs=-1, type=click.UNPROCESSED)
    def bench(args: tuple[str, ...]) -> None:  # type: ignore[misc]  # the harness's stand-in
        raise click.ClickException(MISSING)
