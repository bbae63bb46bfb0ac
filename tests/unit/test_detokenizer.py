"""Incremental detokenization (never half a UTF-8 character) and stop strings across tokens."""

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from ferry.engine.detokenizer import IncrementalDetokenizer, StopStringFilter

pytestmark = pytest.mark.unit

CORPUS = ["hello world, naïve café", "日本語のテキスト", "emoji 🚀🎉 party", "plain ascii text here"] * 20


class Decoder:
    """The decode() surface the engine uses, over a real byte-level BPE."""

    def __init__(self, tok):
        self.tok = self.backend = tok

    def decode(self, ids, skip_special_tokens=True):
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.fixture(scope="module")
def tok():
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    t.train_from_iterator(CORPUS, trainer)
    return t


@pytest.mark.parametrize("text", ["naïve café 🚀 日本語 x", "🎉🎉🎉", "hello world"])
def test_streamed_text_equals_full_decode_and_has_no_half_chars(tok, text):
    prompt = tok.encode("plain ").ids
    ids = tok.encode(text).ids
    detok = IncrementalDetokenizer(Decoder(tok), prompt)
    deltas = [detok.add([i]) for i in ids]
    assert "".join(deltas) == tok.decode(ids)
    assert not any("\ufffd" in d for d in deltas)
    assert any(d == "" for d in deltas) or text == "hello world"  # multi-byte chars waited


def test_stop_string_across_deltas_is_cut_and_never_emitted():
    f = StopStringFilter(["STOP"])
    out = []
    for delta in ["abc S", "T", "O", "Pxyz"]:
        text, stopped = f.add(delta)
        out.append(text)
        if stopped:
            break
    assert stopped and "".join(out) == "abc " and f.text == "abc "


def test_false_start_is_released():
    f = StopStringFilter(["STOP"])
    emitted = "".join(f.add(d)[0] for d in ["a ST", "x"]) + f.flush()
    assert emitted == "a STx"


def test_earliest_of_several_stop_strings_wins():
    f = StopStringFilter(["world", "lo"])
    text, stopped = f.add("hello world")
    assert stopped and text == "hel"


def test_no_stop_strings_emits_immediately():
    f = StopStringFilter([])
    assert f.add("abc") == ("abc", False)
