"""A real tokenizer without a model hub: the MIT-licensed DeepSeek ``tokenizer.json`` that
ships inside ``litellm``'s wheel on PyPI, fetched once with ``pip download --no-deps`` (a
pinned version), checked by its SHA-256 and cached under ``~/.cache/kvstream/tokenizers/``
(``KVSTREAM_TOKENIZER_CACHE`` moves it). The demo, the fleet and tokenizer benchmarks and
the tests load this one file."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

LITELLM = "litellm==1.110.2"
MEMBER = "litellm/litellm_core_utils/tokenizers/deepseek_tokenizer.json"
SHA256 = "4607b3d1929c5ca263a81d7153c6d6ecdbc71c9e933c0fb2df2abf181bf6df61"


class TokenizerFetchError(RuntimeError):
    """The tokenizer cannot be fetched; ``unreachable`` when PyPI cannot be reached."""

    def __init__(self, message: str, *, unreachable: bool) -> None:
        super().__init__(message)
        self.unreachable = unreachable


def tokenizer_cache_dir() -> Path:
    return Path(os.environ.get("KVSTREAM_TOKENIZER_CACHE", Path.home() / ".cache" / "kvstream" / "tokenizers"))


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def deepseek_tokenizer() -> Path:
    """The DeepSeek tokenizer.json of litellm's wheel, fetched once and checked by SHA-256."""
    target = tokenizer_cache_dir() / "deepseek_tokenizer.json"
    if target.is_file() and _sha256(target) == SHA256:
        return target
    try:
        urllib.request.urlopen("https://pypi.org/simple/litellm/", timeout=15).close()
    except (urllib.error.URLError, OSError) as exc:
        raise TokenizerFetchError(
            f"PyPI is unreachable ({exc}); the DeepSeek tokenizer comes from {LITELLM}'s wheel", unreachable=True
        ) from None
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        out = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", LITELLM, "-d", tmp],
            capture_output=True, text=True, timeout=900,
        )
        if out.returncode != 0:
            raise TokenizerFetchError(
                f"pip download {LITELLM} failed:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}", unreachable=False
            )
        wheels = list(Path(tmp).glob("litellm-*.whl"))
        if len(wheels) != 1:
            raise TokenizerFetchError(f"pip download {LITELLM} left {len(wheels)} wheels", unreachable=False)
        part = Path(tmp) / "deepseek_tokenizer.json"
        try:
            with zipfile.ZipFile(wheels[0]) as zf, zf.open(MEMBER) as src, open(part, "wb") as dst:
                shutil.copyfileobj(src, dst)
        except (KeyError, zipfile.BadZipFile) as exc:
            raise TokenizerFetchError(f"{wheels[0].name} has no {MEMBER}: {exc}", unreachable=False) from None
        if (got := _sha256(part)) != SHA256:
            raise TokenizerFetchError(f"{MEMBER} has SHA-256 {got}, expected {SHA256}", unreachable=False)
        os.replace(part, target)  # the cache never holds half a file
    return target
