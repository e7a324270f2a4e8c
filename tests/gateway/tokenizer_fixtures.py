"""Fixtures of the tokenizer tests (imported by them; not a conftest, so that it sits
beside the relay's): a real tokenizer from a PyPI wheel (never a hub download) and a
model directory around it with a chat template of our own.

The tokenizer is the MIT-licensed DeepSeek ``tokenizer.json`` shipped inside ``litellm``'s
wheel. It is fetched with ``pip download --no-deps`` once and cached under
``~/.cache/kvstream/tokenizers/`` (``KVSTREAM_TOKENIZER_CACHE`` to move it), checked by
its SHA-256 (kvstream.tools.tokenizer_file, which the demo and the benches use
too). Only an unreachable PyPI skips the tests, and not in CI (``CI=true``), where it
fails: a skipped tokenizer test must never pass for a green run.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from kvstream.tools.tokenizer_file import TokenizerFetchError, deepseek_tokenizer

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


def fetch_deepseek_tokenizer() -> Path:
    try:
        return deepseek_tokenizer()
    except TokenizerFetchError as exc:
        if not exc.unreachable or os.environ.get("CI", "").lower() == "true":
            pytest.fail(str(exc), pytrace=False)
        pytest.skip(str(exc))


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
