"""Fixtures of the gateway tests: a real tokenizer from a PyPI wheel (never a hub
download) and a model directory around it with a chat template of our own.

The tokenizer is the MIT-licensed DeepSeek ``tokenizer.json`` shipped inside ``litellm``'s
wheel. It is fetched with ``pip download --no-deps`` once and cached under
``~/.cache/kvstream/tokenizers/`` (``KVSTREAM_TOKENIZER_CACHE`` to move it), checked by
its SHA-256. Only an unreachable PyPI skips the tests, and not in CI (``CI=true``), where
it fails: a skipped tokenizer test must never pass for a green run.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

import pytest

LITELLM = "litellm==1.110.2"
MEMBER = "litellm/litellm_core_utils/tokenizers/deepseek_tokenizer.json"
SHA256 = "4607b3d1929c5ca263a81d7153c6d6ecdbc71c9e933c0fb2df2abf181bf6df61"

#: ChatML-like, on DeepSeek's added tokens: system, user, assistant (tool calls), tool.
CHAT_TEMPLATE = """{{ bos_token }}
{% if tools %}
<｜begin▁sys｜># Tools
{% for tool in tools %}
{{ tool | tojson }}
{% endfor %}
<｜end▁sys｜>
{% endif %}
{% for message in messages %}
    {% if message.role == 'system' %}
<｜begin▁sys｜>{{ message.content }}<｜end▁sys｜>
    {% elif message.role == 'user' %}
<｜User｜>{{ message.content }}
    {% elif message.role == 'assistant' %}
<｜Assistant｜>{% generation %}{{ message.content | default('', true) }}
        {% if message.tool_calls %}
<｜tool▁calls▁begin｜>{% for call in message.tool_calls %}<｜tool▁call▁begin｜>{{ call.function.name }}<｜tool▁sep｜>{{ call.function.arguments | tojson }}<｜tool▁call▁end｜>{% endfor %}<｜tool▁calls▁end｜>
        {% endif %}
{% endgeneration %}{{ eos_token }}
    {% elif message.role == 'tool' %}
<｜tool▁output▁begin｜>{{ message.content }}<｜tool▁output▁end｜>
    {% else %}
{{ raise_exception('unknown role: ' + message.role) }}
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
<｜Assistant｜>{% if enable_thinking %}<think>{% endif %}
{% endif %}"""


def _cache_dir() -> Path:
    return Path(os.environ.get("KVSTREAM_TOKENIZER_CACHE", Path.home() / ".cache" / "kvstream" / "tokenizers"))


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _pypi_unreachable() -> str | None:
    try:
        urllib.request.urlopen("https://pypi.org/simple/litellm/", timeout=15).close()
    except (urllib.error.URLError, OSError) as exc:
        return f"PyPI is unreachable ({exc}); the tokenizer tests need {LITELLM}'s wheel"
    return None


def fetch_deepseek_tokenizer() -> Path:
    target = _cache_dir() / "deepseek_tokenizer.json"
    if target.is_file() and _sha256(target) == SHA256:
        return target
    if (why := _pypi_unreachable()) is not None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(why, pytrace=False)
        pytest.skip(why)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        out = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", LITELLM, "-d", tmp],
            capture_output=True, text=True, timeout=900,
        )
        if out.returncode != 0:
            pytest.fail(f"pip download {LITELLM} failed:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}", pytrace=False)
        (wheel,) = Path(tmp).glob("litellm-*.whl")
        with zipfile.ZipFile(wheel) as zf:
            part = Path(tmp) / "deepseek_tokenizer.json"
            with zf.open(MEMBER) as src, open(part, "wb") as dst:
                shutil.copyfileobj(src, dst)
        if _sha256(part) != SHA256:
            pytest.fail(f"{MEMBER} in {wheel.name} has SHA-256 {_sha256(part)}, expected {SHA256}", pytrace=False)
        os.replace(part, target)  # the cache never holds half a file
    return target


@pytest.fixture(scope="session")
def deepseek_tokenizer_json() -> Path:
    """The DeepSeek tokenizer.json from litellm's wheel (cached)."""
    return fetch_deepseek_tokenizer()


@pytest.fixture(scope="session")
def model_dir(deepseek_tokenizer_json: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model directory: the tokenizer, and a tokenizer_config.json with our chat template
    and bos/eos tokens (``add_bos_token`` too, which transformers ignores next to a
    tokenizer.json: the tests check we do the same)."""
    d = tmp_path_factory.mktemp("model")
    shutil.copyfile(deepseek_tokenizer_json, d / "tokenizer.json")
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": {"content": "<｜begin▁of▁sentence｜>", "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "__type": "AddedToken"},
        "eos_token": "<｜end▁of▁sentence｜>",
        "add_bos_token": True,
        "add_eos_token": False,
        "model_max_length": 131072,
        "chat_template": CHAT_TEMPLATE,
    }), encoding="utf-8")
    return d
