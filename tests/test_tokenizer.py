import tiktoken
from hypothesis import given, settings
from hypothesis import strategies as st
from tiktoken.load import data_gym_to_mergeable_bpe_ranks

from gptrain.tokenizer import GPT2_PATTERN, GPT2Tokenizer, default_vocab_files

FIXED = [
    "", " ", "   ", "\n", "\n\n\n", "\t\t x", "hello world", "Hello  world\n\n  indented",
    "trailing spaces   ", "emoji 😀🎉👍🏽 family 👨‍👩‍👧", "CJK 東京都 中文字符 한국어", "combining e\u0301 a\u0300\u0323",
    "<|endoftext|>", "a<|endoftext|>b", "I'll we've they're it's S'S", "numbers 3.14159 2024-11-21 1e10",
    "\u00a0nbsp\u2003em space\u3000ideographic", "RTL עברית العربية", "\x00\x01 control \x7f",
    "mixed\r\nnewlines\rhere", "a" * 500, "🙂" * 50,
]


def tiktoken_reference() -> tiktoken.Encoding:
    vocab, merges = default_vocab_files()
    ranks = data_gym_to_mergeable_bpe_ranks(str(merges), str(vocab))
    return tiktoken.Encoding("gpt2-ref", pat_str=GPT2_PATTERN, mergeable_ranks=ranks,
                             special_tokens={"<|endoftext|>": 50256})


REF = tiktoken_reference()


def test_vocabulary_facts(tokenizer):
    assert tokenizer.vocab_size == 50257
    assert tokenizer.eod == 50256
    assert tokenizer.encode("<|endoftext|>", allow_special=True) == [50256]
    # inside a document it is ordinary text, as in Megatron's tokenizer
    assert tokenizer.encode("<|endoftext|>") == [27, 91, 437, 1659, 5239, 91, 29]
    assert tokenizer.encode("") == []
    assert tokenizer.encode("Hello world") == [15496, 995]


def test_fixed_cases_match_references(tokenizer, hf_reference_tokenizer):
    for text in FIXED:
        ids = tokenizer.encode(text)
        assert ids == REF.encode_ordinary(text), text
        assert ids == hf_reference_tokenizer.encode(text).ids, text
        assert tokenizer.encode_array(text).tolist() == ids
        assert tokenizer.decode(ids) == text


@settings(max_examples=400, deadline=None)
@given(st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=200))
def test_any_unicode_matches_tiktoken_and_round_trips(tokenizer, text):
    ids = tokenizer.encode(text)
    assert ids == REF.encode_ordinary(text)
    assert tokenizer.decode(ids) == text


@settings(max_examples=150, deadline=None)
@given(st.lists(st.sampled_from([" ", "  ", "\n", "\t", "a", "ab", "'s", "1", "22", "!", "é", "東", "😀", "\u00a0"]),
                max_size=60).map("".join))
def test_whitespace_and_mixed_runs_match_hf(tokenizer, hf_reference_tokenizer, text):
    assert tokenizer.encode(text) == hf_reference_tokenizer.encode(text).ids


def test_explicit_files_equal_default(tmp_path):
    vocab, merges = default_vocab_files()
    (tmp_path / "gpt2-vocab.json").write_bytes(vocab.read_bytes())
    (tmp_path / "gpt2-merges.txt").write_bytes(merges.read_bytes())
    tok = GPT2Tokenizer(tmp_path / "gpt2-vocab.json", tmp_path / "gpt2-merges.txt")
    assert tok.encode("same ids either way") == GPT2Tokenizer().encode("same ids either way")
    assert tok.fingerprint == GPT2Tokenizer().fingerprint


def test_missing_file_is_a_clear_error(tmp_path):
    import pytest

    with pytest.raises(FileNotFoundError, match="--vocab-file"):
        GPT2Tokenizer(tmp_path / "nope.json", tmp_path / "nope.txt")
    with pytest.raises(ValueError, match="both"):
        GPT2Tokenizer(tmp_path / "nope.json", None)


def _tiny_bpe(tmp_path, name, merges, extra=None):
    """A small real GPT-2-format pair: the 256 byte tokens, ``merges`` and <|endoftext|>, ids in
    tiktoken's rank order (so tiktoken's own loader accepts it)."""
    import json

    from tiktoken.load import data_gym_to_mergeable_bpe_ranks  # noqa: F401  (the format's reference)

    from gptrain.tokenizer import _byte_decoder

    chars = list(_byte_decoder())
    encoder = {ch: i for i, ch in enumerate(chars)}
    for a, b in merges:
        encoder[a + b] = len(encoder)
    encoder["<|endoftext|>"] = len(encoder)
    encoder.update(extra or {})
    vocab, merge = tmp_path / f"{name}-vocab.json", tmp_path / f"{name}-merges.txt"
    vocab.write_text(json.dumps(encoder))
    merge.write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
    return vocab, merge


def test_changed_files_at_the_same_path_are_read_again(tmp_path):
    """tiktoken's loader caches by path (data-gym-cache): the second pair must be encoded with its own
    merges, and fingerprinted by its own bytes."""
    vocab, merge = _tiny_bpe(tmp_path, "v", [("h", "e")])
    first = GPT2Tokenizer(vocab, merge)
    assert first.encode("he") == [256]
    vocab, merge = _tiny_bpe(tmp_path, "v", [("l", "o"), ("h", "e")])  # same paths, new contents
    second = GPT2Tokenizer(vocab, merge)
    assert second.encode("he") == [257] and second.encode("lo") == [256]
    assert second.vocab_size == 259 and second.fingerprint != first.fingerprint
    reference = tiktoken.Encoding("tiny", pat_str=GPT2_PATTERN,
                                  mergeable_ranks=data_gym_to_mergeable_bpe_ranks(str(merge), str(vocab)),
                                  special_tokens={})
    assert second.encode("hello, lo he") == reference.encode_ordinary("hello, lo he")


def test_vocabulary_not_matching_merges_is_one_line(tmp_path):
    import json

    import pytest

    vocab, merge = _tiny_bpe(tmp_path, "m", [("h", "e"), ("l", "o")])
    encoder = json.loads(vocab.read_text())
    encoder["he"], encoder["lo"] = encoder["lo"], encoder["he"]
    vocab.write_text(json.dumps(encoder))
    with pytest.raises(ValueError) as err:
        GPT2Tokenizer(vocab, merge)
    assert "does not match" in str(err.value) and "\n" not in str(err.value)


def test_largest_id_is_recorded(tmp_path):
    vocab, merge = _tiny_bpe(tmp_path, "e", [("h", "e")])
    import json

    encoder = json.loads(vocab.read_text())
    encoder["<|endoftext|>"] = 70000
    vocab.write_text(json.dumps(encoder))
    tok = GPT2Tokenizer(vocab, merge)
    assert tok.eod == 70000 and tok.max_id == 70000 and tok.vocab_size == 258


def test_the_bpe_tables_come_back_from_the_cache(tmp_path, monkeypatch):
    """A second tokenizer of the same files reads the tables kept by the first (no BPE rebuild) and
    encodes alike; a damaged cache file is rebuilt."""
    from gptrain import tokenizer as tk

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    first = tk.GPT2Tokenizer()
    text = "Hello world, naïve café 東京 😀 — it's"

    def refuse(*args):
        raise AssertionError("the BPE tables were built again")

    with monkeypatch.context() as m:
        m.setattr(tk, "_load_bpe", refuse)
        again = tk.GPT2Tokenizer()
    assert again.encode(text) == first.encode(text)
    assert (again.eod, again.vocab_size, again.max_id) == (first.eod, first.vocab_size, first.max_id) == (50256, 50257, 50256)
    (kept,) = (tmp_path / "cache" / "gptrain").glob("gpt2-bpe-v*.npz")
    kept.write_bytes(kept.read_bytes()[:1000])  # cut short
    assert tk.GPT2Tokenizer().encode(text) == first.encode(text)
