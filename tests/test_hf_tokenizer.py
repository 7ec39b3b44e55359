"""--tokenizer-type HuggingFaceTokenizer --tokenizer-model: a tokenizer.json built here with the tokenizers
library (nothing downloaded), preprocessed to the ids of tokenizers' own encode (megatron-core reads the
files), int32 tokens past 65500 ids, 2 training iterations of a tiny Llama-style model, the checkpoint's
tokenizer in generate, and the refusals."""
from __future__ import annotations

import json

import numpy as np
import pytest

from gptrain.cli import main as gptrain
from megatron_reference import MegatronIndexedDataset
from tiny import TINY_FLAGS

tokenizers = pytest.importorskip("tokenizers")

DOCS = ["The quick brown fox jumps over the lazy dog.", "Llama-style models, tokenized by tokenizers </s> itself.",
        "ünïcödé text 🙂 and numbers 12345", ""]


def _bpe_folder(folder, config: dict | None):
    """A byte-level BPE trained on DOCS, with <s> and </s>; the template adds <s> to each text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(DOCS * 4, trainers.BpeTrainer(vocab_size=320, special_tokens=["<s>", "</s>"],
                                                          initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    if config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return tok


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf") / "tok"
    tok = _bpe_folder(folder, {"eos_token": {"content": "</s>", "special": True}, "bos_token": "<s>"})
    return folder, tok


def _jsonl(path, docs):
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return path


def _preprocess(tmp_path, model, docs, *extra, name="o"):
    rc = gptrain(["preprocess", "--input", str(_jsonl(tmp_path / f"{name}.jsonl", docs)), "--output-prefix",
                  str(tmp_path / name), "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(model),
                  "--append-eod", "--workers", "2", "--no-progress", *extra])
    assert rc == 0
    return tmp_path / f"{name}_text_document"


@pytest.mark.parametrize("template", [False, True], ids=["megatron-default", "include-special-tokens"])
def test_preprocess_ids_are_tokenizers_encode_plus_eod(tmp_path, bpe, template):
    folder, tok = bpe
    prefix = _preprocess(tmp_path, folder, DOCS, *(["--tokenizer-hf-include-special-tokens"] if template else []))
    ds = MegatronIndexedDataset(str(prefix))
    eod = tok.token_to_id("</s>")
    encoded = [tok.encode(d, add_special_tokens=template).ids for d in DOCS]  # "" is [<s>] with the template
    want = [ids + [eod] for ids in encoded if ids]  # Megatron: no eod after no tokens
    assert [ds[i].tolist() for i in range(len(ds))] == want
    assert ds[0].dtype == np.uint16 and (ds[0][0] == 0) == template  # the template's <s> only when asked
    assert tok.token_to_id("</s>") in ds[1].tolist()[:-1]  # "</s>" written in a text is the special token
    record = json.loads(prefix.with_suffix(".json").read_text())["tokenizer"]
    assert (record["type"], record["eod"], record["bos"], record["vocab_size"]) == \
        ("HuggingFaceTokenizer", eod, 0, tok.get_vocab_size())


def test_vocabulary_past_65500_writes_int32_that_megatron_reads(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(69999)} | {"<|endoftext|>": 69999}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "big.json"))  # the file itself, no folder files: eod from the vocabulary
    docs = ["w1 w65535 w69998", "w65500 w2 w40000 w69000"]
    prefix = _preprocess(tmp_path, tmp_path / "big.json", docs)
    ds = MegatronIndexedDataset(str(prefix))
    assert ds[0].dtype == np.int32
    assert [ds[i].tolist() for i in range(len(ds))] == [tok.encode(d).ids + [69999] for d in docs]
    assert ds[1].tolist() == [65500, 2, 40000, 69000, 69999]


def test_train_two_iterations_of_a_tiny_llama_then_generate_with_its_tokenizer(tmp_path, bpe):
    from gptrain.inference.load import load_for_inference
    from gptrain.train.run import train_main

    folder, tok = bpe
    prefix = _preprocess(tmp_path, folder, DOCS * 8)
    lines = []
    result = train_main(["--data-path", str(prefix), "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                         str(folder), *TINY_FLAGS, "--swiglu", "--normalization", "RMSNorm",
                         "--position-embedding-type", "rope", "--group-query-attention", "--num-query-groups", "2",
                         "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--seq-length", "16",
                         "--max-position-embeddings", "16", "--micro-batch-size", "2", "--global-batch-size", "2",
                         "--train-iters", "2", "--eval-iters", "0", "--split", "1,0,0", "--device", "cpu",
                         "--data-cache-path", str(tmp_path / "cache"), "--save", str(tmp_path / "ck")],
                        log=lines.append)
    assert result.exit_code == 0, lines[-5:]
    assert f" > padded vocab (size: {tok.get_vocab_size()}) with 64 dummy tokens (new size: 384)" in lines
    assert "> building HuggingFaceTokenizer tokenizer ..." in lines
    loaded = load_for_inference(tmp_path / "ck")  # the run's --tokenizer-model, from its checkpoint
    assert loaded.tokenizer.eod == tok.token_to_id("</s>")
    assert loaded.tokenizer.encode(DOCS[0]) == tok.encode(DOCS[0], add_special_tokens=False).ids


def test_eos_from_the_vocabulary_without_transformers_files_and_bits_per_byte(tmp_path):
    from gptrain.hf_tokenizer import HuggingFaceTokenizer
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator(DOCS, trainers.BpeTrainer(vocab_size=300, special_tokens=["<|begin_of_text|>",
                            "<|end_of_text|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    (tmp_path / "t").mkdir()
    tok.save(str(tmp_path / "t" / "tokenizer.json"))
    ours = HuggingFaceTokenizer(tmp_path / "t")
    assert (ours.eod, ours.bos) == (1, 0)
    with pytest.raises(UnicodeEncodeError):  # preprocess counts the line as lone_surrogate, as with GPT-2's
        ours.encode("a \ud800 b")
    lengths = ours.token_byte_lengths()
    assert lengths[ours.encode(DOCS[2])].sum() == len(DOCS[2].encode()) and lengths[1] == 0
    assert ours.decode(ours.encode(DOCS[2])) == DOCS[2]


@pytest.mark.parametrize("flags, message", [
    (["--tokenizer-model", "{tmp}/missing"], "--tokenizer-model {tmp}/missing: no such file or folder"),
    (["--tokenizer-model", "{tmp}"], "--tokenizer-model {tmp}: the folder holds no tokenizer.json"),
    ([], "--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model"),
    (["--tokenizer-model", "{tmp}", "--vocab-size", "10"], "--vocab-size is NullTokenizer's"),
], ids=["missing-path", "no-tokenizer-json", "no-model", "other-types-flag"])
def test_refusals_are_one_line(tmp_path, capsys, flags, message):
    _jsonl(tmp_path / "in.jsonl", DOCS)
    argv = ["preprocess", "--input", str(tmp_path / "in.jsonl"), "--output-prefix", str(tmp_path / "o"),
            "--tokenizer-type", "HuggingFaceTokenizer", *[f.format(tmp=tmp_path) for f in flags]]
    assert gptrain(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"gptrain: error: {message.format(tmp=tmp_path)}") and err.count("\n") == 1, err
    assert not list(tmp_path.glob("o*"))


def test_unknown_type_and_a_tokenizer_without_eos_refused(tmp_path, capsys):
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({"a": 0, "b": 1}, unk_token="a")).save(str(tmp_path / "t.json"))
    _jsonl(tmp_path / "in.jsonl", ["a b"])
    base = ["preprocess", "--input", str(tmp_path / "in.jsonl"), "--output-prefix", str(tmp_path / "o")]
    assert gptrain(base + ["--tokenizer-type", "SentencePieceTokenizer"]) == 2
    assert "--tokenizer-type SentencePieceTokenizer: not supported (gptrain has GPT2BPETokenizer, " \
           "HuggingFaceTokenizer, NullTokenizer)" in capsys.readouterr().err
    assert gptrain(base + ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tmp_path / "t.json"),
                           "--append-eod"]) == 2
    assert "--append-eod: the tokenizer" in capsys.readouterr().err
    from gptrain.train.run import train_main

    failed = train_main(["--mock-data", "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                         str(tmp_path / "missing"), *TINY_FLAGS, "--train-iters", "1"], log=lambda line: None)
    assert failed.exit_code == 2 and "no such file or folder" in capsys.readouterr().err


def test_null_tokenizer_preprocesses_and_trains_on_token_ids(tmp_path):
    """Megatron's NullTokenizer: documents of space-separated ids, eod N, a vocabulary of N + 1."""
    from gptrain.train.run import train_main

    docs = [" ".join(str((7 * i + j) % 90) for j in range(5 + i % 7)) for i in range(40)]
    rc = gptrain(["preprocess", "--input", str(_jsonl(tmp_path / "ids.jsonl", docs)), "--output-prefix",
                  str(tmp_path / "ids"), "--tokenizer-type", "NullTokenizer", "--vocab-size", "90", "--append-eod",
                  "--no-progress"])
    assert rc == 0
    ds = MegatronIndexedDataset(str(tmp_path / "ids_text_document"))
    assert ds[1].tolist() == [int(t) for t in docs[1].split()] + [90]
    lines = []
    result = train_main(["--data-path", str(tmp_path / "ids_text_document"), "--tokenizer-type", "NullTokenizer",
                         "--vocab-size", "90", *TINY_FLAGS, "--seq-length", "16", "--max-position-embeddings", "16",
                         "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "2", "--eval-iters",
                         "0", "--split", "1,0,0", "--device", "cpu", "--data-cache-path", str(tmp_path / "cache")],
                        log=lines.append)
    assert result.exit_code == 0, lines[-5:]
    assert " > padded vocab (size: 91) with 37 dummy tokens (new size: 128)" in lines
