"""``kvstream bench tokenize``: ms to tokenize a long multi-turn chat prompt (8k and
100k tokens by default), fresh against through the prefix cache, in the same run.

The scenario is a conversation's next request: its history (system prompt and earlier
turns, already seen once) plus one new user message, a different one each time. Fresh:
render the chat template and tokenize the whole text, as every request costs without a
cache (``fresh_ids``: no cut at all). Cached: the same with kvstream.gateway.tokenize's
prefix cache warm from the request before. Both give the same ids (checked); ``render_ms`` is the template's part,
which no tokenization cache removes.

The second scenario is a long document asked many questions, as a completion prompt with
no added token in it (a RAG context, a file to review): the document plus a new question
each time. Fresh: tokenize it whole. Cached: the same document seen before, through the
prefix cache's cuts between words. First sight: a new document each time through the
cached tokenizer (nothing to reuse; its chunks are tokenized at once).

The tokenizer defaults to the DeepSeek ``tokenizer.json`` from ``litellm``'s wheel
(kvstream.tools.tokenizer_file), with a built-in chat template on its added tokens; ``--tokenizer DIR`` runs a model's own.
"""

from __future__ import annotations

import json
import random
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import click

from bench.common import emit, json_option, percentiles_us
from kvstream.tools.tokenizer_file import TokenizerFetchError, deepseek_tokenizer

#: A ChatML-like template on DeepSeek's added tokens.
BENCH_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m.role == 'system' %}<｜begin▁sys｜>{{ m.content }}<｜end▁sys｜>"
    "{% elif m.role == 'user' %}<｜User｜>{{ m.content }}"
    "{% else %}<｜Assistant｜>{{ m.content }}{{ eos_token }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<｜Assistant｜>{% endif %}"
)


def _document(rng: random.Random, tokenizer, target_tokens: int) -> str:
    """Prose of about ``target_tokens``: words, punctuation, numbers and paragraphs."""
    words = ["the", "routing", "of", "cache", "blocks", "is", "kept", "by", "each", "replica", "and", "engine",
             "prefix", "tokens", "in", "a", "long", "document", "that", "users", "ask", "about", "again"]
    ends = ["", "", "", "", ",", ".", ".\n\n", " 42", " (2026)", ";"]
    out: list[str] = []
    while len(tokenizer.fresh_ids(" ".join(out))) < target_tokens:
        out += [rng.choice(words) + rng.choice(ends) for _ in range(500)]
    return " ".join(out)


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

        whole = fresh.fresh_ids(fresh.renderer.render(body(-1)))
        n_tokens = len(whole)
        if cached.chat_ids(body(-1)).tolist() != whole:
            raise click.ClickException("the cached path gave other ids than the fresh one")
        samples: dict[str, list[int]] = {"fresh": [], "cached": [], "render": []}
        for i in range(repeat):
            b = body(i)
            for name, fn in (("render", lambda: fresh.renderer.render(b)),
                             ("fresh", lambda: fresh.fresh_ids(fresh.renderer.render(b))),
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
        _document_case(rng, fresh, cached, size, repeat, k, result)
    stats = cached.cache.stats if cached.cache is not None else None
    if stats is not None:
        result.update(cache_segments=len(cached.cache), cache_bytes=cached.cache.bytes, cache_fallbacks=stats.fallbacks)
    emit(result, as_json)


def _document_case(rng: random.Random, fresh, cached, size: int, repeat: int, k: str, result: dict) -> None:
    """A long document asked many questions (module docstring): ``doc_*`` figures."""
    doc = _document(rng, fresh, size)
    others = [_document(rng, fresh, size) for _ in range(repeat)]

    def prompt(d: str, i: int) -> str:
        return f"{d} Question {i}: what does it say about the cache?"

    if cached.text_ids(prompt(doc, -1)).tolist() != fresh.fresh_ids(prompt(doc, -1)):
        raise click.ClickException("the cached path gave other ids than the fresh one (document)")
    samples: dict[str, list[int]] = {"fresh": [], "cached": [], "first": []}
    for i in range(repeat):
        for name, fn in (("fresh", lambda: fresh.fresh_ids(prompt(doc, i))),
                         ("cached", lambda: cached.text_ids(prompt(doc, i))),
                         ("first", lambda: cached.text_ids(prompt(others[i], i)))):
            t0 = time.perf_counter_ns()
            fn()
            samples[name].append(time.perf_counter_ns() - t0)
    if cached.text_ids(prompt(others[0], 0)).tolist() != fresh.fresh_ids(prompt(others[0], 0)):
        raise click.ClickException("the cached path gave other ids than the fresh one (document, first sight)")
    fresh_ms, cached_ms, first_ms = (percentiles_us(samples[n], 50)[0] / 1000 for n in ("fresh", "cached", "first"))
    result.update({
        f"doc_tokens_{k}": len(fresh.fresh_ids(prompt(doc, 0))),
        f"doc_fresh_ms_{k}": round(fresh_ms, 3),
        f"doc_cached_ms_{k}": round(cached_ms, 3),
        f"doc_first_sight_ms_{k}": round(first_ms, 3),
        f"doc_speedup_{k}": round(fresh_ms / cached_ms, 2),
        f"doc_first_sight_speedup_{k}": round(fresh_ms / first_ms, 2),
    })
