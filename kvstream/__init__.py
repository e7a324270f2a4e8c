"""kvstream: tells an LLM inference fleet where every KV-cache block lives.

Packages follow the data flow of docs/DESIGN (worker → kafka → replica → router):
``hashing`` and ``events`` are shared vocabulary, ``worker`` produces events, ``kafka``
carries them, ``replica`` folds them into ``router`` state, ``tools`` reads them.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("kvstream")
except PackageNotFoundError:  # running from a source tree without an install
    __version__ = "0.0.0+source"
