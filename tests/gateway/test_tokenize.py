"""Token ids inside the path, on a real tokenizer (DeepSeek's, from litellm's wheel):
chat ids equal ``transformers``' ``apply_chat_template`` ids, completion ids equal the
tokenizer's own with special tokens, the prefix cache never changes an id (hypothesis),
bad input gets a clear error, and asking an engine's ``/tokenize`` asks one worker."""

from __future__ import annotations

import json
import re
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Regex, normalizers, pre_tokenizers

from kvstream.gateway.errors import TokenizeError, TokenizerConfigError
from kvstream.gateway.prefix_cache import WORD_SPLIT_PATTERNS, PrefixCache, WordCuts
from kvstream.gateway.options import ModelTokenizerConfig
from kvstream.gateway.tokenize import LocalTokenizer, local_tokenizers
from kvstream.settings import load_settings

from .tokenizer_fixtures import deepseek_tokenizer_json, model_dir  # noqa: F401 (fixtures)

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # transformers reads the local directory only

SLOW = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def listed(ids: np.ndarray | list[int]) -> list[int]:
    """Ids as a list: text's come as one uint32 array (what routing reads), given ids as
    they were given."""
    if isinstance(ids, np.ndarray):
        assert ids.dtype == np.uint32 and ids.ndim == 1
        return ids.tolist()
    assert isinstance(ids, list)
    return ids


@pytest.fixture(scope="module")
def local(model_dir: Path) -> LocalTokenizer:
    return LocalTokenizer.from_config(ModelTokenizerConfig(name="ds", tokenizer=model_dir))


@pytest.fixture(scope="module")
def reference(model_dir: Path):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(model_dir))


# Text that stresses the tokenizer: added tokens, their pieces, digits, CJK, whitespace.
FRAGMENTS = [
    "<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>", "<think>", "</think>", "<dsml:", "｜DSML｜",
    "<｜", "<｜User", "｜>", "<", ">", "<dsml", "<think", "\n", "\n\n", " ", "  ", "\t", "123456", "日本語", "ｶﾀｶﾅ",
    "hello", " world", "x", "é", "🙂", "{\"a\": 1}",
]
texts = st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.text(max_size=8)), max_size=30).map("".join)

roles = st.sampled_from(["system", "user", "assistant", "tool"])
tool_calls = st.lists(
    st.fixed_dictionaries({
        "type": st.just("function"),
        "function": st.fixed_dictionaries({
            "name": st.sampled_from(["get_weather", "search"]),
            "arguments": st.dictionaries(st.sampled_from(["city", "q", "n"]), st.one_of(st.integers(), texts), max_size=2),
        }),
    }),
    min_size=1, max_size=2,
)


@st.composite
def message(draw) -> dict:
    role = draw(roles)
    m = {"role": role, "content": draw(texts)}
    if role == "assistant" and draw(st.booleans()):
        m["tool_calls"] = draw(tool_calls)
    return m


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather <b>now</b> & later",
                                             "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
conversations = st.lists(message(), min_size=1, max_size=8)


@SLOW
@given(conversations, st.booleans(), st.booleans(), st.booleans())
def test_chat_ids_equal_transformers(local, reference, messages, generation, with_tools, thinking) -> None:
    body = {"model": "ds", "messages": messages, "add_generation_prompt": generation,
            "chat_template_kwargs": {"enable_thinking": thinking}}
    kwargs = {}
    if with_tools:
        body["tools"] = kwargs["tools"] = TOOLS
    want = reference.apply_chat_template(
        messages, add_generation_prompt=generation, tokenize=True, return_dict=False, enable_thinking=thinking,
        **kwargs,
    )
    assert listed(local.chat_ids(body)) == want
    assert listed(local.chat_ids(body)) == want  # again, now through the cache


def test_chat_defaults_and_options_as_vllm(local, reference) -> None:
    messages = [{"role": "user", "content": "hi", "name": None}, {"role": "assistant", "content": "Hello"}]
    # vLLM adds the generation prompt unless told not to; null keys are dropped.
    assert listed(local.chat_ids({"messages": messages})) == reference.apply_chat_template(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello"}],
        add_generation_prompt=True, tokenize=True, return_dict=False,
    )
    assert listed(local.chat_ids({"messages": messages, "add_generation_prompt": False,
                           "continue_final_message": True})) == reference.apply_chat_template(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello"}],
        continue_final_message=True, tokenize=True, return_dict=False,
    )
    # Content parts: this template wants a string, so text parts are joined (vLLM's way).
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b <think>"}]
    assert listed(local.chat_ids({"messages": [{"role": "user", "content": parts}]})) == reference.apply_chat_template(
        [{"role": "user", "content": "a\nb <think>"}], add_generation_prompt=True, tokenize=True, return_dict=False,
    )
    with pytest.raises(TokenizeError, match="only text content parts"):
        local.chat_ids({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]})
    # Tool call arguments as the OpenAI API sends them (a JSON string) are parsed.
    call = {"type": "function", "function": {"name": "search", "arguments": '{"q": "x"}'}}
    parsed = {"type": "function", "function": {"name": "search", "arguments": {"q": "x"}}}
    got = listed(local.chat_ids({"messages": [{"role": "assistant", "content": "", "tool_calls": [call]}]}))
    assert got == reference.apply_chat_template(
        [{"role": "assistant", "content": "", "tool_calls": [parsed]}], add_generation_prompt=True,
        tokenize=True, return_dict=False,
    )


@SLOW
@given(texts)
def test_completion_ids_equal_the_tokenizers_with_special_tokens(local, reference, text) -> None:
    assert listed(local.completion_ids(text)) == reference(text)["input_ids"]


def test_token_id_prompts_are_used_as_given_and_checked(local) -> None:
    assert listed(local.completion_ids([0, 5, 2**32 - 1])) == [0, 5, 2**32 - 1]
    for bad, where in (([1, -1], "prompt[1]"), ([2**32], "prompt[0]"), ([1, True], "prompt[1]"),
                       ([1.0], "prompt[0]"), (["1"], "prompt[0]"), ([], "empty")):
        with pytest.raises(TokenizeError, match=re.escape(where)):
            local.completion_ids(bad)
    with pytest.raises(TokenizeError, match="string or a list"):
        local.completion_ids({"a": 1})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"messages": []}, "non-empty list"),
        ({"messages": "hi"}, "non-empty list"),
        ({"messages": [3]}, "must be an object"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "unknown role: robot"),
        ({"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ 7 }}"}, "must name one of"),
        ({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"messages": []}}, "may not set"),
        ({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": []}, "must be an object"),
        ({"messages": [{"role": "user", "content": "x"}], "tools": "all"}, "tools must be a list"),
        ({"messages": [{"role": "user", "content": "x"}], "continue_final_message": True}, "cannot both be true"),
    ],
)
def test_bad_chat_bodies_get_clear_errors(local, body, message) -> None:
    with pytest.raises(TokenizeError, match=message):
        local.chat_ids(body)


def test_tokenizer_config_errors(tmp_path: Path, deepseek_tokenizer_json: Path) -> None:
    with pytest.raises(TokenizerConfigError, match="neither a directory nor a file"):
        LocalTokenizer.from_config(ModelTokenizerConfig(name="m", tokenizer=tmp_path / "missing"))
    with pytest.raises(TokenizerConfigError, match="does not exist"):
        LocalTokenizer.from_config(ModelTokenizerConfig(name="m", tokenizer=tmp_path))
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(TokenizerConfigError, match="cannot load"):
        LocalTokenizer.from_config(ModelTokenizerConfig(name="m", tokenizer=bad))
    template = tmp_path / "t.jinja"
    template.write_text("{% for %}")
    with pytest.raises(TokenizerConfigError, match="does not compile"):
        LocalTokenizer.from_config(ModelTokenizerConfig(name="m", tokenizer=deepseek_tokenizer_json, chat_template=template))
    # A bare tokenizer.json: completions work, chat says why it cannot.
    bare = LocalTokenizer.from_config(ModelTokenizerConfig(name="m", tokenizer=deepseek_tokenizer_json))
    assert listed(bare.completion_ids("hello")) == bare.fresh_ids("hello")
    with pytest.raises(TokenizeError, match="no chat template"):
        bare.chat_ids({"messages": [{"role": "user", "content": "x"}]})


def test_named_templates(tmp_path: Path, deepseek_tokenizer_json: Path) -> None:
    d = tmp_path / "m"
    d.mkdir()
    (d / "tokenizer.json").write_bytes(deepseek_tokenizer_json.read_bytes())
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        {"name": "default", "template": "D{% for m in messages %}{{ m.content }}{% endfor %}"},
        {"name": "tool_use", "template": "T{{ tools | length }}"},
        {"name": "rag", "template": "R{{ documents | tojson }}"},
        {"name": "parts", "template": "{% for m in messages %}{% for p in m['content'] %}[{{ p.text }}]{% endfor %}{% endfor %}"},
    ]}))
    tok = LocalTokenizer.from_config(ModelTokenizerConfig(name="m", tokenizer=d))
    msgs = [{"role": "user", "content": "x<y>"}]
    assert listed(tok.chat_ids({"messages": msgs})) == tok.fresh_ids("Dx<y>")
    assert listed(tok.chat_ids({"messages": msgs, "tools": [{"a": 1}]})) == tok.fresh_ids("T1")
    docs = [{"title": "<&>", "text": "é"}]
    assert listed(tok.chat_ids({"messages": msgs, "chat_template": "rag", "documents": docs})) == tok.fresh_ids(
        "R" + json.dumps(docs, ensure_ascii=False))  # tojson: no HTML escaping, no ASCII escaping
    # A template that loops over the content parts gets them as given.
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert listed(tok.chat_ids({"messages": [{"role": "user", "content": parts}], "chat_template": "parts"})) == tok.fresh_ids("[a][b]")
    assert listed(tok.chat_ids({"messages": [{"role": "user", "content": parts}]})) == tok.fresh_ids("Da\nb")


def test_models_are_configured_in_toml(tmp_path: Path, model_dir: Path) -> None:
    config = tmp_path / "kvstream.toml"
    config.write_text(f'[[gateway.models]]\nname = "ds"\ntokenizer = "{model_dir}"\nprefix_cache_bytes = 1000000\n')
    (model,) = load_settings(config).gateway.models
    assert (model.name, model.tokenizer, model.prefix_cache_bytes) == ("ds", model_dir, 1_000_000)
    config.write_text('[[gateway.models]]\nname = "ds"\ntokenizer = "/x"\nunknown = 1\n')
    with pytest.raises(ValueError, match="unknown"):
        load_settings(config)
    config.write_text('[[gateway.models]]\nname = "ds"\n')
    with pytest.raises(ValueError, match="tokenizer"):
        load_settings(config)
    config.write_text(f'[[gateway.models]]\nname = "ds"\ntokenizer = "{model_dir}"\n')
    made = local_tokenizers(load_settings(config).gateway.models)
    assert listed(made["ds"].completion_ids("hi")) == made["ds"].fresh_ids("hi")
    with pytest.raises(TokenizerConfigError, match="twice"):
        local_tokenizers(load_settings(config).gateway.models * 2)


# -- the prefix cache -----------------------------------------------------------------


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(0, 4), texts), min_size=1, max_size=8))
def test_cache_never_changes_ids_of_texts(local, steps) -> None:
    texts_through_a_small_cache(local, steps, 4000)


def texts_through_a_small_cache(tok: LocalTokenizer, steps: list[tuple[int, str]], cache_bytes: int) -> None:
    """Texts that extend, branch from and cut earlier ones, through one small cache
    (evicting), against tokenizing each whole."""
    tok.cache = PrefixCache(cache_bytes)
    seen: list[str] = [""]
    for base, extra in steps:
        prev = seen[base % len(seen)]
        text = prev[: len(prev) * 2 // 3] + extra if base == 3 else prev + extra
        assert listed(tok.text_ids(text)) == tok.fresh_ids(text)
        assert listed(tok.completion_ids(text)) == tok.fresh_ids(text)  # this post-processor adds nothing
        seen.append(text)
    assert tok.cache.bytes <= cache_bytes and tok.cache.stats.fallbacks == 0


@SLOW
@given(st.lists(conversations, min_size=1, max_size=4))
def test_cache_never_changes_ids_of_growing_conversations(local, turns) -> None:
    local.cache = PrefixCache(1 << 20)
    messages: list[dict] = []
    for turn in turns:
        messages = messages + turn
        body = {"messages": messages}
        assert listed(local.chat_ids(body)) == local.fresh_ids(local.renderer.render(body))
    assert local.cache.stats.fallbacks == 0
    if len(turns) > 1:  # every later turn starts with the segments of the one before
        assert local.cache.stats.hit_segments >= len(turns) - 1


def long_conversation(turns: int, words: int) -> list[dict]:
    import random

    rng = random.Random(7)
    vocab = ["routing", "cache", "kafka", "replica", "token", "block", "prefix", "engine", "12", "，", "数据", "\n"]
    out = [{"role": "system", "content": " ".join(rng.choice(vocab) for _ in range(words * 4))}]
    for i in range(turns):
        role = "user" if i % 2 == 0 else "assistant"
        out.append({"role": role, "content": " ".join(rng.choice(vocab) for _ in range(words))})
    return out


def test_cached_path_is_faster_than_fresh_on_a_long_shared_prefix(model_dir) -> None:
    tok = LocalTokenizer.from_config(ModelTokenizerConfig(name="ds", tokenizer=model_dir))
    fresh = LocalTokenizer.from_config(ModelTokenizerConfig(name="ds", tokenizer=model_dir, prefix_cache_bytes=0))
    history = long_conversation(turns=40, words=300)
    tok.chat_ids({"messages": history})  # the earlier turns, seen once

    def next_turn(i: int) -> dict:
        return {"messages": history + [{"role": "user", "content": f"and now question {i}?"}]}

    def best(t: LocalTokenizer) -> float:
        times = []
        for i in range(5):
            t0 = time.perf_counter()
            t.chat_ids(next_turn(i))
            times.append(time.perf_counter() - t0)
        return min(times)

    assert listed(tok.chat_ids(next_turn(0))) == listed(fresh.chat_ids(next_turn(0)))
    assert len(fresh.chat_ids(next_turn(0))) > 15_000
    cached_s, fresh_s = best(tok), best(fresh)
    assert cached_s < fresh_s, (cached_s, fresh_s)


def test_cache_is_thread_safe(model_dir) -> None:
    tok = LocalTokenizer.from_config(ModelTokenizerConfig(name="ds", tokenizer=model_dir, prefix_cache_bytes=20_000))
    history = long_conversation(turns=6, words=40)
    bodies = [{"messages": history[: 2 + i % 5] + [{"role": "user", "content": f"q{i}"}]} for i in range(40)]
    want = [tok.fresh_ids(tok.renderer.render(b)) for b in bodies]
    errors: list[BaseException] = []

    def work(k: int) -> None:
        try:
            for j in range(len(bodies)):
                i = (j * 7 + k) % len(bodies)
                assert listed(tok.chat_ids(bodies[i])) == want[i]
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]


def test_tokenize_bench_reports_both_paths_of_one_run(deepseek_tokenizer_json) -> None:
    from click.testing import CliRunner

    from bench import bench

    out = CliRunner().invoke(bench, ["tokenize", "--json", "--tokens", "3000", "--repeat", "3",
                                     "--tokenizer", str(deepseek_tokenizer_json)])
    assert out.exit_code == 0, out.output
    r = json.loads(out.output.strip().splitlines()[-1])
    assert r["tokens_3k"] >= 3000 and r["cache_fallbacks"] == 0
    assert r["speedup_3k"] == pytest.approx(r["fresh_ms_3k"] / r["cached_ms_3k"], rel=0.02)
    # The document case (its ids checked against whole tokenization in the run).
    assert r["doc_tokens_3k"] >= 3000
    assert r["doc_speedup_3k"] == pytest.approx(r["doc_fresh_ms_3k"] / r["doc_cached_ms_3k"], rel=0.02)
    assert r["doc_first_sight_speedup_3k"] == pytest.approx(r["doc_fresh_ms_3k"] / r["doc_first_sight_ms_3k"], rel=0.02)


def test_lru_evicts_the_ends_of_chains_first() -> None:
    cache = PrefixCache(600)  # room for two one-character segments of one id (287 bytes each)
    cuts = [(1, "a"), (2, "b"), (3, "c")]
    one, two, three = (np.array([i], dtype=np.uint32).tobytes() for i in (1, 2, 3))
    cache.insert(0, [("a", one), ("b", two), ("c", three)], [])
    assert cache.stats.evicted == 1 and cache.bytes <= 600
    found, _, ids, _ = cache.longest("abc", cuts)
    assert (found, ids) == (2, [one, two])  # the chain's end went, its start is still reachable
    assert cache.stats.hit_tokens == 2


# -- word cuts (long texts without added tokens) ----------------------------------------

# Words and what sits between them: the cut is only ever at ``x y``, so the text around it
# must try every neighbour the patterns treat apart (punctuation, digits, marks, CJK,
# whitespace runs, newlines, an apostrophe's contractions).
WORDISH = st.lists(st.one_of(
    st.sampled_from(["the", "cache", "x", "Z", "it's", "don'T", " ", "  ", "\n", " \n ", "\t", ".", ", ", "!?", "(a)",
                     "12", "3456", "é", "e\u0301", "日本", "ｶﾀ", "🙂", "-", "'", "_", "<｜User｜>", "<｜"]),
    st.text(alphabet="ab Z\n.'1é", max_size=6),
), max_size=60).map(" ".join)


@pytest.fixture(scope="module")
def cut_small(model_dir: Path) -> LocalTokenizer:
    """The DeepSeek tokenizer with a word cut every few characters (the default stride
    leaves texts this short whole)."""
    from kvstream.gateway.tokenize import load

    return LocalTokenizer(load(ModelTokenizerConfig(name="ds", tokenizer=model_dir)), word_cut_stride=8)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(0, 4), WORDISH), min_size=1, max_size=6))
def test_word_cuts_never_change_ids(cut_small, steps) -> None:
    texts_through_a_small_cache(cut_small, steps, 20_000)


def test_a_long_document_asked_again_is_tokenized_from_its_cached_words(model_dir: Path) -> None:
    import random

    tok = LocalTokenizer.from_config(ModelTokenizerConfig(name="ds", tokenizer=model_dir))
    rng = random.Random(3)
    words = ["routing", "cache", "kafka", "replica", "token", "block", "prefix", "engine", "of", "the", "12,", "é."]
    doc = " ".join(rng.choice(words) for _ in range(12_000))
    first = listed(tok.text_ids(doc + " What is the first question?"))
    assert first == tok.fresh_ids(doc + " What is the first question?")
    before = tok.cache.stats.hit_tokens
    second = doc + " And the second one?"
    assert listed(tok.text_ids(second)) == tok.fresh_ids(second)
    # All but the last stride of the document came from the cache.
    assert tok.cache.stats.hit_tokens - before >= len(tok.fresh_ids(doc)) * (1 - 2 * 2048 / len(doc))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(WORDISH, st.lists(WORDISH, min_size=2, max_size=5))
def test_questions_on_one_text_never_change_ids(cut_small, doc, questions) -> None:
    """Texts that leave the cache where earlier ones did (one text, other endings): the
    part they share is cut at its last word and cached; ids stay those of the whole."""
    for budget in (1 << 20, 1_500):  # ample, and so small that it evicts all the time
        cut_small.cache = PrefixCache(budget)
        for q in questions:
            text = "a document " + doc + " " + q
            assert listed(cut_small.text_ids(text)) == cut_small.fresh_ids(text)
            assert cut_small.cache.bytes <= budget
        assert cut_small.cache.stats.fallbacks == 0


def test_a_document_asked_many_questions_is_tokenized_up_to_its_end_from_the_cache(model_dir: Path) -> None:
    import random

    tok = LocalTokenizer.from_config(ModelTokenizerConfig(name="ds", tokenizer=model_dir))
    rng = random.Random(5)
    words = ["routing", "cache", "kafka", "replica", "token", "block", "prefix", "engine", "of", "the"]
    doc = " ".join(rng.choice(words) for _ in range(3_000))
    questions = [f" {first} " + " ".join(rng.choice(["why", "how", "does", "it", "route", "when"]) for _ in range(12)) + "?"
                 for first in ("Why", "How", "Does", "When")]
    doc_tokens = len(tok.fresh_ids(doc))
    for n, q in enumerate(questions):
        before = tok.cache.stats.hit_tokens
        assert listed(tok.text_ids(doc + q)) == tok.fresh_ids(doc + q)
        if n >= 2:  # the second left the cache where the first did: the document's end is a segment since
            assert tok.cache.stats.hit_tokens - before >= doc_tokens - 1
        else:  # the first two tokenize the document's last stride
            assert tok.cache.stats.hit_tokens - before < doc_tokens - 100


def _trained(pre_tokenizer, normalizer=None):
    """A small BPE trained here with ``pre_tokenizer``: the rule is the pre-tokenizer's,
    whatever the vocabulary."""
    from tokenizers import Tokenizer, decoders, models, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.ByteLevel()
    if normalizer is not None:
        tok.normalizer = normalizer
    corpus = ["the cache of a replica's routing, it's 12345 tokens!", "don't stop\n\n the engine at 3 am  ", "日本語 ｶﾀｶﾅ é"] * 50
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, show_progress=False,
                                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


def _split_then_bytes(patterns: tuple[str, ...]):
    return pre_tokenizers.Sequence([*(pre_tokenizers.Split(Regex(p), "isolated") for p in patterns),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


#: Every pre-tokenizer the rule is claimed for (the module's own list, and GPT-2's).
PROVEN = {
    "GPT-2": lambda: pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    **{name: (lambda pats=pats: _split_then_bytes(pats)) for pats, name in WORD_SPLIT_PATTERNS.items()},
}


#: Each proven pre-tokenizer's trained tokenizer, trained once.
_TRAINED: dict[str, object] = {}


def _trained_cached(name: str):
    if name not in _TRAINED:
        _TRAINED[name] = _trained(PROVEN[name]())
    return _TRAINED[name]


@pytest.mark.parametrize("name", sorted(PROVEN))
@settings(max_examples=150, deadline=None)
@given(text=WORDISH)
def test_each_proven_pre_tokenizer_splits_at_every_word_cut(name, text) -> None:
    tok = _trained_cached(name)
    cuts = WordCuts.proven_for(tok, stride=1)
    assert cuts is not None
    whole = tok.encode(text, add_special_tokens=False).ids
    for c, _ in cuts.boundaries(text):
        left = tok.encode(text[:c], add_special_tokens=False).ids
        right = tok.encode(text[c:], add_special_tokens=False).ids
        assert left + right == whole, (text[:c], text[c:])


def test_word_cuts_are_off_where_no_proof_covers_the_tokenizer(model_dir: Path) -> None:
    unproven = {
        "a pattern not on the list": pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex("\\w+|[^\\w\\s]+"), "isolated"), pre_tokenizers.ByteLevel(use_regex=False)]),
        "a prefix space": pre_tokenizers.ByteLevel(add_prefix_space=True),
        "Metaspace (a first piece differs)": pre_tokenizers.Metaspace(),
        "whitespace split": pre_tokenizers.Whitespace(),
    }
    for why, pre in unproven.items():
        assert WordCuts.proven_for(_trained(pre)) is None, why
    assert WordCuts.proven_for(_trained(PROVEN["Llama 3 (cl100k)"](), normalizers.NFKC())) is None, "a normalizer"
    assert WordCuts.proven_for(_trained_cached("Llama 3 (cl100k)")) is not None
    from tokenizers import Tokenizer

    deepseek = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    assert WordCuts.proven_for(deepseek) is not None
    deepseek.add_tokens([AddedToken("two words", normalized=False)])
    assert WordCuts.proven_for(deepseek) is None, "an added token holding a space"
