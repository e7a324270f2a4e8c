"""``--tokenizer`` and ``--chat-template`` against ``transformers``: a local HF
``tokenizer.json`` (a small BPE trained here, with a BOS post-processor) gives the ids
transformers' fast tokenizer gives, for completions (special tokens added) and for chat
(``apply_chat_template`` with the same template)."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from .conftest import KVSTREAM, Emulator

TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
CORPUS = ["the quick brown fox jumps over the lazy dog", "a tokenizer trained for the emulator test",
          "hello world, hello fox; the dog sleeps"] * 20


@pytest.fixture(scope="module")
def tokenizer_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("tok")
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    specials = ["<unk>", "<s>", "<|user|>", "<|system|>", "<|assistant|>", "<|end|>"]
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    tok.save(str(d / "tokenizer.json"))
    (d / "template.jinja").write_text(TEMPLATE)
    return d / "tokenizer.json", d / "template.jinja"


def test_ids_match_transformers(emulator_factory: Callable[..., Emulator], tokenizer_files: tuple[Path, Path]) -> None:
    tok_path, template = tokenizer_files
    emu = emulator_factory("--speed", "20", "--tokenizer", str(tok_path), "--chat-template", str(template))
    ref = PreTrainedTokenizerFast(tokenizer_file=str(tok_path))
    text = "the lazy fox says hello world"
    expected = ref(text)["input_ids"]
    assert expected[0] == ref.convert_tokens_to_ids("<s>")
    status, tok = emu.post("/tokenize", {"prompt": text})
    assert status == 200 and tok["tokens"] == expected
    status, body = emu.post("/v1/completions", {"prompt": text, "max_tokens": 2})
    assert status == 200 and body["usage"]["prompt_tokens"] == len(expected) and body["choices"][0]["text"]
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello dog"}]
    chat_expected = ref.apply_chat_template(messages, chat_template=TEMPLATE, tokenize=True,
                                            add_generation_prompt=True)
    if not isinstance(chat_expected, list):  # newer transformers return a BatchEncoding
        chat_expected = chat_expected["input_ids"]
    status, chat = emu.post("/v1/chat/completions/render", {"messages": messages})
    assert status == 200 and chat["token_ids"] == list(chat_expected)
    status, body = emu.post("/v1/chat/completions", {"messages": messages, "max_tokens": 1})
    assert status == 200 and body["usage"]["prompt_tokens"] == len(chat_expected)
    # A token id past this vocabulary is refused, as vLLM refuses it.
    status, err = emu.post("/v1/completions", {"prompt": [5, ref.vocab_size + 10]})
    assert status == 400 and err["error"]["param"] == "prompt"


def test_an_unreadable_tokenizer_is_a_clear_startup_error(tmp_path: Path) -> None:
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not a tokenizer")
    run = subprocess.run([KVSTREAM, "emulate", "--tokenizer", str(bad), "--port", "1"], capture_output=True,
                         text=True, timeout=60, check=False)
    assert run.returncode != 0 and "cannot load the tokenizer" in run.stderr and "Traceback" not in run.stderr
