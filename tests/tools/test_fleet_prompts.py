"""The fleet's text prompts under the real tokenizer.json the engines and the gateways
load (kvstream.tools.fleet.local_tokenizer): one token per word, so a prompt keeps the
trace's scaled length, and equal hash ids give equal token prefixes; checked with
``transformers``' fast tokenizer over the same file."""

from __future__ import annotations

from kvstream.tools import fleet
from kvstream.tools.simulate.trace import Request


def test_text_prompts_are_one_token_per_word_under_the_real_tokenizer() -> None:
    from transformers import PreTrainedTokenizerFast

    scale = fleet.Scale(tokenizer=fleet.local_tokenizer())
    hf = PreTrainedTokenizerFast(tokenizer_file=str(scale.tokenizer))
    first = Request("a", 0, 6758, 500, tuple(range(14)))
    turn = Request("b", 0, 7322, 490, (*range(14), 90, 91))  # the conversation's next turn
    ids_a = hf(scale.text(first), add_special_tokens=True)["input_ids"]
    ids_b = hf(scale.text(turn), add_special_tokens=True)["input_ids"]
    assert len(ids_a) == len(scale.prompt(first)) and len(ids_b) == len(scale.prompt(turn))
    assert ids_b[: len(ids_a)] == ids_a
    # Distinct hash ids become distinct words.
    assert len(set(ids_b)) == len(set(scale.prompt(turn)))
    assert "--tokenizer" in scale.engine_flags()
