"""``kvstream bench tokenize``: ms to tokenize a long multi-turn chat prompt (8k and
100k tokens by default), fresh against through the prefix cache, in the same run.

The scenario is a conversation's next request: its history (system prompt and earlier
turns, already seen once) plus one new user message, a different one each time. Fresh:
render the chat template and tokenize the whole text, as every request costs without a
cache. Cached: the same with kvstream.gateway.tokenize's prefix cache warm from the
request before. Both give the same ids (checked); ``render_ms`` is the template's part,
which no tokenization cache removes.

The tokenizer defaults to the DeepSeek ``tokenizer.json`` from ``litellm``'s wheel on
PyPI (MIT; fetched once with ``pip download --no-deps`` into
``~/.cache/kvstream/tokenizers/``, or ``KVSTREAM_TOKENIZER_CACHE``), with a built-in
chat template on its added tokens; ``--tokenizer DIR`` runs a model's own.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import zipfile
from dataclasses import replace
from pathlib import Path

import click

from bench.common import emit, json_option, percentiles_us

LITELLM = "litellm==1.110.2"
MEMBER = "litellm/litellm_core_utils/tokenizers/deepseek_tokenizer.json"
SHA256 = "4607b3d1929c5ca263a81d7153c6d6ecdbc71c9e933c0fb2df2abf181bf6df61"

#: A ChatML-like template on DeepSeek's added tokens.
BENCH_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m.role == 'system' %}<｜begin▁sys｜>{{ m.content }}<｜end▁sys｜>"
    "{% elif m.role == 'user' %}<｜User｜>{{ m.content }}"
    "{% else %}<｜Assistant｜>{{ m.content }}{{ eos_token }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<｜Assistant｜>{% endif %}"
)


class TokenizerFetchError(RuntimeError):
    """The test tokenizer cannot be fetched; ``unreachable`` when PyPI cannot be reached."""

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


def _conversation(rng: random.Random, tokenizer, target_tokens: int) -> list[dict]:
    """A system prompt and alternating turns of about ``target_tokens`` in all."""
    words = ["routing", "cache", "kafka", "replica", "token", "prefix", "engine", "数据", "的", "42,", "(x)", "\n"]
    messages: list[dict] = []
    total = 0
    while total < target_tokens:
        role = "system" if not messages else ("user" if len(messages) % 2 else "assistant")
        size = 2000 if role == "system" else 400
        text = " ".join(rng.choice(words) for _ in range(size))
        messages.append({"role": role, "content": text})
        total += len(tokenizer.fresh_ids(text))
    return messages


@click.command("tokenize")
@click.option("--tokens", "sizes", multiple=True, type=click.IntRange(100), default=(8192, 100_000),
              show_default=True, help="Conversation length(s) in tokens; repeat for several.")
@click.option("--tokenizer", "tokenizer_path", type=click.Path(exists=True, path_type=Path),
              help="A model directory (tokenizer.json, tokenizer_config.json) or a tokenizer.json "
              "[default: DeepSeek's, from litellm's wheel].")
@click.option("--repeat", default=15, show_default=True, type=click.IntRange(3), help="Requests timed per size and path.")
@click.option("--seed", default=0, show_default=True)
@json_option
def tokenize_bench(sizes: tuple[int, ...], tokenizer_path: Path | None, repeat: int, seed: int, as_json: bool) -> None:
    """Tokenization of a long multi-turn chat request, fresh vs through the prefix cache."""
    from kvstream.gateway.options import ModelTokenizerConfig
    from kvstream.gateway.tokenize import LocalTokenizer

    if tokenizer_path is None:
        try:
            tokenizer_path = deepseek_tokenizer()
        except TokenizerFetchError as exc:
            raise click.ClickException(str(exc)) from None
    with tempfile.TemporaryDirectory() as tmp:
        model = tokenizer_path
        if tokenizer_path.is_file():
            # A bare tokenizer.json: a model directory around it with the bench's template.
            model = Path(tmp)
            (model / "tokenizer.json").symlink_to(tokenizer_path.resolve())
            (model / "tokenizer_config.json").write_text(json.dumps({
                "bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>",
                "chat_template": BENCH_TEMPLATE,
            }), encoding="utf-8")
        cfg = ModelTokenizerConfig(name="bench", tokenizer=model)
        fresh = LocalTokenizer.from_config(replace(cfg, prefix_cache_bytes=0))
        cached = LocalTokenizer.from_config(cfg)
    rng = random.Random(seed)
    result: dict[str, object] = {"bench": "tokenize", "tokenizer": str(tokenizer_path), "repeat": repeat}
    for size in sizes:
        history = _conversation(rng, fresh, size)

        def body(i: int) -> dict:
            return {"messages": history + [{"role": "user", "content": f"question {i}: what next?"}]}

        n_tokens = len(fresh.chat_ids(body(-1)))
        if cached.chat_ids(body(-1)) != fresh.chat_ids(body(-1)):
            raise click.ClickException("the cached path gave other ids than the fresh one")
        samples: dict[str, list[int]] = {"fresh": [], "cached": [], "render": []}
        for i in range(repeat):
            b = body(i)
            for name, fn in (("render", lambda: fresh.renderer.render(b)), ("fresh", lambda: fresh.chat_ids(b)),
                             ("cached", lambda: cached.chat_ids(b))):
                t0 = time.perf_counter_ns()
                fn()
                samples[name].append(time.perf_counter_ns() - t0)
        fresh_ms, cached_ms, render_ms = (percentiles_us(samples[k], 50)[0] / 1000 for k in ("fresh", "cached", "render"))
        k = f"{size // 1000}k" if size >= 1000 else str(size)
        result.update({
            f"tokens_{k}": n_tokens,
            f"messages_{k}": len(history) + 1,
            f"fresh_ms_{k}": round(fresh_ms, 3),
            f"cached_ms_{k}": round(cached_ms, 3),
            f"render_ms_{k}": round(render_ms, 3),
            f"speedup_{k}": round(fresh_ms / cached_ms, 2),
            f"fresh_tokens_per_s_{k}": round(n_tokens / fresh_ms * 1000),
        })
    stats = cached.cache.stats if cached.cache is not None else None
    if stats is not None:
        result.update(cache_segments=len(cached.cache), cache_bytes=cached.cache.bytes, cache_fallbacks=stats.fallbacks)
    emit(result, as_json)
