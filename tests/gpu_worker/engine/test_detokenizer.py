"""IncrementalDetokenizer with the built-in byte-level BPE tokenizer: streaming text and stop strings."""

from __future__ import annotations

import copy

import pytest

from gpu_worker.engine.detokenizer import IncrementalDetokenizer
from services.text.tokenizer import Tokenizer

TEXT = "Café naïve 🎉 日本語 the model, déjà vu! 👩\u200d👩\u200d👧 ok."
MULTIBYTE_TEXTS = [
    TEXT,
    "Ünïcödé àccents éverywhere: ça, señor, Øresund.",
    "中文测试：缓存的价格是多少？日本語のテキスト。한국어",
    "emoji 🚀🔥🎉 flags 🇫🇷🇯🇵 skin 👍🏽 family 👨\u200d👩\u200d👧\u200d👦!",
    "mixed: the cost 💰 of one token — 5 € ≈ ¥ 800…",
]


@pytest.fixture(scope="session")
def tokenizer(hf_tokenizer) -> Tokenizer:
    return Tokenizer(hf_tokenizer)


def stream(tokenizer: Tokenizer, token_ids: list[int], stop: list[str] | None = None):
    """Feed tokens one at a time as the engine does; returns (deltas, stop string hit, final text)."""
    detok = IncrementalDetokenizer(tokenizer, stop or [])
    deltas: list[str] = []
    hit = None
    for token_id in token_ids:
        hit = detok.add_token(token_id)
        deltas.append(detok.take_delta(finished=hit is not None))
        if hit is not None:
            break
    else:
        deltas.append(detok.take_delta(finished=True))
    return deltas, hit, detok.text


def test_texts_need_several_byte_tokens_per_character(tokenizer):
    """Guards the premise of the tests below: single tokens decode to partial UTF-8."""
    ids = tokenizer.encode(TEXT)
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids)


@pytest.mark.parametrize("text", MULTIBYTE_TEXTS)
def test_streamed_deltas_concatenate_to_the_full_decode(tokenizer, text):
    ids = tokenizer.encode(text)
    deltas, hit, final = stream(tokenizer, ids)
    assert hit is None
    assert "".join(deltas) == final == tokenizer.decode(ids) == text


@pytest.mark.parametrize("text", MULTIBYTE_TEXTS)
def test_no_delta_contains_a_replacement_character(tokenizer, text):
    deltas, _, _ = stream(tokenizer, tokenizer.encode(text))
    assert not [d for d in deltas if "\ufffd" in d]


def test_a_character_split_over_tokens_appears_whole_with_its_last_token(tokenizer):
    ids = tokenizer.encode("🎉")
    assert len(ids) > 1
    deltas, _, _ = stream(tokenizer, ids)
    assert deltas[:-2] == [""] * (len(ids) - 1) and deltas[-2] == "🎉"


@pytest.mark.parametrize("stop", ["déjà", "🎉", "日本", "model, d", " ok."])
def test_stop_string_is_returned_and_cut_from_the_text(tokenizer, stop):
    deltas, hit, final = stream(tokenizer, tokenizer.encode(TEXT), [stop])
    assert hit == stop
    expected = TEXT[:TEXT.index(stop)]
    assert final == expected
    assert "".join(deltas) == expected


def test_the_earliest_of_several_stop_strings_wins(tokenizer):
    deltas, hit, final = stream(tokenizer, tokenizer.encode(TEXT), ["vu!", "the model", "model"])
    assert hit == "the model"
    assert final == "".join(deltas) == TEXT[:TEXT.index("the model")]


@pytest.mark.parametrize("stop", [["déjà"], ["🎉"], ["日本語 the"], ["vu", "model, déjà vu! 👩"], ["ok."]])
def test_running_deltas_never_emit_text_that_becomes_part_of_a_stop_string(tokenizer, stop):
    detok = IncrementalDetokenizer(tokenizer, stop)
    emitted = ""
    for token_id in tokenizer.encode(TEXT):
        hit = detok.add_token(token_id)
        if hit is not None:
            break
        emitted += detok.take_delta(finished=False)
    assert hit is not None
    assert detok.text.startswith(emitted), f"{emitted!r} went out, but the text is cut to {detok.text!r}"
    assert not any(s in emitted for s in stop)


def test_text_that_only_starts_like_a_stop_string_is_released_in_full(tokenizer):
    ids = tokenizer.encode(TEXT)
    deltas, hit, final = stream(tokenizer, ids, ["model, dx", "🎉🎉"])
    assert hit is None
    assert "".join(deltas) == final == TEXT


def test_a_running_sequence_holds_back_at_most_the_longest_stop_string_minus_one(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, ["xyz!", "q"])
    emitted = ""
    for token_id in tokenizer.encode(TEXT):
        detok.add_token(token_id)
        emitted += detok.take_delta(finished=False)
        assert len(detok.text) - len(emitted) <= 3
    assert emitted == TEXT[:-3]
    assert detok.take_delta(finished=True) == TEXT[-3:]


@pytest.fixture(scope="module")
def sentencepiece_style_tokenizer():
    """A Metaspace ("▁word") tokenizer like Llama-2's and Mistral's: decoding drops a leading space."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = RawTokenizer(models.BPE(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    raw.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    raw.train_from_iterator(["Hello world, the world says hello to the model"] * 50,
                            trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>"], show_progress=False))
    return Tokenizer(PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>"))


def test_first_output_word_keeps_its_space_with_a_sentencepiece_style_tokenizer(sentencepiece_style_tokenizer):
    tok = sentencepiece_style_tokenizer
    prompt, output = tok.encode("Hello"), tok.encode(" world")[-1:]
    assert tok.decode(output) == "world"  # decoded alone, the space is lost
    detok = IncrementalDetokenizer(tok, [], prompt_tail=prompt[-5:])
    for token in output:
        detok.add_token(token)
    assert detok.take_delta(finished=True) == " world"
    assert tok.decode(prompt) + detok.text == tok.decode(prompt + output)


@pytest.mark.parametrize("clean_up", [False, True])
def test_decode_returns_what_transformers_decode_returns(hf_tokenizer, clean_up):
    hf = copy.deepcopy(hf_tokenizer)
    hf.clean_up_tokenization_spaces = clean_up
    ids = hf.encode("Hello , world ! It 's " + TEXT, add_special_tokens=True)
    for cut in range(1, len(ids) + 1):
        assert Tokenizer(hf).decode(ids[:cut]) == hf.decode(ids[:cut], skip_special_tokens=True)
