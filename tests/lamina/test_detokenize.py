"""Incremental detokenization against whole decodes: byte-level BPE (multi-byte characters split
across tokens, special tokens), SentencePiece-style spaces, a decoder that cleans up spaces."""
import random

import pytest

tokenizers = pytest.importorskip("tokenizers")
from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402

from lamina.engine.detokenize import IncrementalText, stop_found  # noqa: E402
from lamina.engine.request import Request, Status  # noqa: E402
from lamina.outputs import StreamCursor, output_text  # noqa: E402
from lamina.types import SamplingParams  # noqa: E402

CORPUS = ["héllo wörld, ünïcödé: 日本語のテキスト 😀 emoji . , ! " * 3,
          "the quick brown fox jumps over the lazy dog . " * 5]


def _byte_level() -> PreTrainedTokenizerFast:
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=400, show_progress=False, special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


class _CleanUp:
    """A tokenizer whose decode removes the space before "." and "," (as WordPiece's clean-up
    does): text at a window's edge changes once the next ids arrive."""

    def __init__(self, tok):
        self.tok = tok

    def __getattr__(self, name):
        return getattr(self.tok, name)

    def __len__(self) -> int:
        return len(self.tok)

    def __call__(self, *args, **kwargs):
        return self.tok(*args, **kwargs)

    def decode(self, ids, **kwargs) -> str:
        return self.tok.decode(ids, **kwargs).replace(" .", ".").replace(" ,", ",")


def _metaspace() -> PreTrainedTokenizerFast:
    tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=300, show_progress=False, special_tokens=["<unk>", "<s>", "</s>"]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


TOKENIZERS = {"byte-level": _byte_level, "metaspace": _metaspace,
              "clean-up": lambda: _CleanUp(_byte_level())}


def _sequences(tok, rng: random.Random) -> list[list[int]]:
    """Random ids (bytes that need not form UTF-8, special tokens) and real text's ids."""
    out = [[rng.randrange(len(tok)) for _ in range(rng.randrange(1, 60))] for _ in range(40)]
    out += [tok(t, add_special_tokens=False).input_ids for t in CORPUS]
    out.append(tok("dog , ! héllo . 日本 😀 fox .", add_special_tokens=False).input_ids)
    if "\u0120" in tok.get_vocab():  # byte-level: a space on its own, then "." (cleaned up: " ." -> ".")
        out.append(tok.convert_tokens_to_ids(["d", "o", "g", "\u0120", ".", "\u0120", ","]))
    return out


@pytest.mark.parametrize("kind", list(TOKENIZERS))
def test_the_text_grown_a_few_ids_at_a_time_is_the_whole_decode(kind):
    tok = TOKENIZERS[kind]()
    rng = random.Random(0)
    for ids in _sequences(tok, rng):
        inc, grown = IncrementalText(), []
        while len(grown) < len(ids):
            grown += ids[len(grown):len(grown) + rng.randrange(1, 4)]
            inc.update(grown, tok)
            assert inc.text == tok.decode(grown[:inc.read], skip_special_tokens=True)
            assert not inc.text.endswith("\ufffd")
        whole = tok.decode(ids, skip_special_tokens=True)
        if not whole.endswith("\ufffd"):  # else the last character is still held back
            assert inc.text == whole, (kind, ids)


def test_an_incomplete_character_waits_for_the_ids_that_complete_it():
    tok = _byte_level()
    # "a" and then the emoji's four bytes, one id each: the first three decode to U+FFFD
    symbols = "".join(s for s, _ in
                      pre_tokenizers.ByteLevel(add_prefix_space=False).pre_tokenize_str("a😀"))
    pieces = [tok.convert_tokens_to_ids(c) for c in symbols]
    inc = IncrementalText()
    for n in range(1, len(pieces) + 1):
        inc.update(pieces[:n], tok)
        if n < len(pieces):
            assert (inc.text, inc.read) == ("a", 1)
    assert (inc.text, inc.read) == ("a😀", 5)


def test_a_stop_string_across_windows_is_found_once_it_is_complete():
    tok = _byte_level()
    ids = tok("the quick brown fox jumps", add_special_tokens=False).input_ids
    inc, found = IncrementalText(), []
    for n in range(1, len(ids) + 1):
        found.append(stop_found(inc, ids[:n], tok, ["brown f", "zzz"]))
    first = found.index(True)
    assert "brown f" in tok.decode(ids[:first + 1]) and "brown f" not in tok.decode(ids[:first])
    assert not any(found[:first])


def test_streamed_deltas_add_up_to_the_finished_text():
    tok = _byte_level()
    ids = tok("héllo wörld 日本語 the lazy dog . !", add_special_tokens=False).input_ids
    req = Request(0, [1], SamplingParams(max_tokens=len(ids), stop=["lazy d"]))
    cursor, streamed = StreamCursor(), ""
    for i, t in enumerate(ids):
        req.output_ids.append(t)
        if i == len(ids) - 1:
            req.status = Status.FINISHED
        streamed += cursor.advance(req, tok)[1]
    assert streamed == output_text(req, tok) == "héllo wörld 日本語 the "
