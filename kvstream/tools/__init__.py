"""Operator and developer tools, each behind a ``kvstream`` command and built on the same
pieces as production: ``hash_cmd`` (``kvstream hash``), ``config_cmd`` (``kvstream config
show``), ``replay`` (``kvstream replay``: the log folded again to dump, rebuild, explain,
diff), ``simulate`` (``kvstream simulate``: fleets on traces), ``fleet`` (an emulated
fleet with a trace replayed through it, for ``kvstream demo`` and ``kvstream bench
fleet``), ``demo`` (``kvstream demo``), ``procs`` (the processes they start), ``output``
(one JSON object or aligned lines), ``plotting`` (matplotlib, the ``plot`` extra) and
``bench_cmd`` (``kvstream bench``: the entry to the harness in ``bench/`` of a checkout).
"""
