"""Tokenizers as they ship: SentencePiece ``tokenizer.model`` and tiktoken ``*.tiktoken`` files, or
directories holding one, and GGUF files, load through ``--tokenizer`` with the ids of the reference encoders.

``tests/data/llama-cpp-vocab`` holds four of llama.cpp's vocabulary files with their reference
tokenizations (``.inp`` texts, ``.out`` ids), as the llama-cpp-python sdist ships them
(``vendor/llama.cpp/models/``, MIT licence, ``LICENSE`` beside them)."""

from __future__ import annotations

import base64
import json
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import sentencepiece
import tiktoken
from transformers.convert_slow_tokenizer import TikTokenConverter

from pipeline.build import build
from pipeline.config import PackConfig
from pipeline.encode.tokenizer import GGUF_CONTROL, GGUF_USER_DEFINED, GgufVocab, gguf_reference, load_tokenizer
from pipeline.errors import InputError
from pipeline.pack import main
from tests.test_pipeline_e2e import read_examples

LLAMA_CPP_VOCAB = Path(__file__).parent / "data" / "llama-cpp-vocab"
# The four vocabularies transformers' GGUF conversion tokenized unlike llama.cpp (issue 27 item 6):
# Falcon regrouped digit runs, llama-spm lost leading whitespace, StarCoder and DeepSeek-coder split "½" apart.
GGUF_VOCABS = ("falcon", "llama-spm", "starcoder", "deepseek-coder")

TEXTS = [
    "Hello world. The quick brown fox 12 jumps over the lazy dog 345!",
    "  two leading spaces,   three inside, and a tab\there",
    "Unicode: café, naïve, 東京, emoji 🙂.",
    "line one\nline two\n\nline four",
]
CORPUS = [f"The quick brown fox {i} jumps over the lazy dog number {i * 7}. Hello world, café!" for i in range(400)]


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("VARPACK_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture(scope="module", params=["bpe", "unigram"])
def sentencepiece_model(request, tmp_path_factory):
    """A SentencePiece model trained here, with <s> and </s>."""
    prefix = tmp_path_factory.mktemp(request.param) / "tokenizer"
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS), model_prefix=str(prefix), vocab_size=400, model_type=request.param,
        character_coverage=1.0, byte_fallback=True, minloglevel=2,
    )
    return prefix.with_suffix(".model")


@pytest.fixture(scope="module")
def tiktoken_ranks(tmp_path_factory):
    """A tiktoken ranks file (base64 token, rank) of all bytes and a few merges, and its reference encoder."""
    ranks = {bytes([b]): b for b in range(256)}
    for merge in [b"he", b"ll", b"llo", b"hello", b" w", b"or", b" wor", b" world", b"th", b" th", b" the", b" fox"]:
        ranks[merge] = len(ranks)
    path = tmp_path_factory.mktemp("tiktoken") / "tiny.tiktoken"
    path.write_text("".join(f"{base64.b64encode(token).decode()} {rank}\n" for token, rank in ranks.items()))
    reference = tiktoken.Encoding("tiny", pat_str=TikTokenConverter().pattern, mergeable_ranks=ranks, special_tokens={})
    return path, reference


def test_sentencepiece_model_file_and_directory_load(sentencepiece_model, tmp_path):
    reference = sentencepiece.SentencePieceProcessor(model_file=str(sentencepiece_model))
    directory = tmp_path / "spm"
    directory.mkdir()
    shutil.copyfile(sentencepiece_model, directory / "tokenizer.model")
    for spec in (str(sentencepiece_model), str(directory)):
        tokenizer = load_tokenizer(spec)
        assert (tokenizer.bos_token, tokenizer.eos_token) == ("<s>", "</s>")
        for text in TEXTS:
            assert tokenizer.backend().encode(text, add_special_tokens=False).ids == reference.encode(text), text
    assert load_tokenizer(str(directory)).content_hash == load_tokenizer(str(sentencepiece_model)).content_hash


def test_tiktoken_file_and_directory_load(tiktoken_ranks, tmp_path):
    path, reference = tiktoken_ranks
    directory = tmp_path / "tk"
    directory.mkdir()
    shutil.copyfile(path, directory / "tiny.tiktoken")
    llama3_style = tmp_path / "llama3" / "tokenizer.model"  # tiktoken ranks under the SentencePiece name
    llama3_style.parent.mkdir()
    shutil.copyfile(path, llama3_style)
    for spec in (str(path), str(directory), str(llama3_style.parent)):
        tokenizer = load_tokenizer(spec)
        for text in TEXTS:
            assert tokenizer.backend().encode(text, add_special_tokens=False).ids == reference.encode(text), text


def test_packing_with_a_sentencepiece_directory_gives_its_ids(sentencepiece_model, tmp_path):
    directory = tmp_path / "spm"
    directory.mkdir()
    shutil.copyfile(sentencepiece_model, directory / "tokenizer.model")
    records = [{"text": text} for text in TEXTS]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    result = build(PackConfig(dataset=str(data), out=str(tmp_path / "out"), tokenizer=str(directory), max_len=256,
                              progress=False))
    reference = sentencepiece.SentencePieceProcessor(model_file=str(sentencepiece_model))
    examples = read_examples(result.out_dir)
    eos = reference.eos_id()
    for i, text in enumerate(TEXTS):
        tokens = examples[i][0].tolist()
        assert tokens[-1] == eos and reference.encode(text) == [t for t in tokens[:-1] if t != reference.bos_id()]
    assert result.manifest.inputs.tokenizer.eos_token_id == eos


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        ("empty", "the directory is empty"),
        ("corrupt model", "not a SentencePiece model"),
        ("corrupt ranks", "not a tiktoken BPE file"),
        ("other file", "not a tokenizer file"),
    ],
)
def test_unloadable_tokenizers_fail_in_one_line(setup, message, tmp_path, capsys):
    (tmp_path / "data.jsonl").write_text('{"text": "hello"}\n')
    target = {
        "empty": tmp_path / "empty",
        "corrupt model": tmp_path / "bad" / "tokenizer.model",
        "corrupt ranks": tmp_path / "bad.tiktoken",
        "other file": tmp_path / "vocab.txt",
    }[setup]
    if setup == "empty":
        target.mkdir()
    else:
        target.parent.mkdir(exist_ok=True)
        target.write_bytes(b"garbage\x00\x01\n")
    assert main(["--dataset", str(tmp_path / "data.jsonl"), "--tokenizer", str(target), "--no-progress"]) == 1
    error = capsys.readouterr().err.strip()
    assert error.startswith("varpack: error: ") and error.count("\n") == 0, error
    assert message in error and "save_pretrained" in error
    with pytest.raises(InputError):
        load_tokenizer(str(target))


def test_several_models_in_one_directory_are_named(tiktoken_ranks, tmp_path):
    path, _ = tiktoken_ranks
    for name in ("a.tiktoken", "b.tiktoken"):
        shutil.copyfile(path, tmp_path / name)
    with pytest.raises(InputError, match=r"holds several tokenizer models \(a.tiktoken, b.tiktoken\)"):
        load_tokenizer(str(tmp_path))
    assert np.array_equal(
        load_tokenizer(str(tmp_path / "a.tiktoken")).backend().encode("hello world").ids,
        load_tokenizer(str(path)).backend().encode("hello world").ids,
    )


def test_a_bare_sentencepiece_model_adds_the_bos_it_reports(sentencepiece_model):
    """Issue 27 item 6: a tokenizer.model reported BOS <s> but put none before an example, while the
    layout line showed [bos]. It now puts the model's BOS there, as llama.cpp and LlamaTokenizer do."""
    reference = sentencepiece.SentencePieceProcessor(model_file=str(sentencepiece_model))
    tokenizer = load_tokenizer(str(sentencepiece_model))
    assert tokenizer.prefix_ids == (reference.bos_id(),) and tokenizer.bos_token == reference.id_to_piece(reference.bos_id())
    assert tokenizer.describe_affixes().startswith(f"BOS <s> ({reference.bos_id()}), EOS </s> ({reference.eos_id()})")


@pytest.fixture(scope="module")
def gguf_tokenizers(gguf_cache):
    """The GGUF_VOCABS files as load_tokenizer converts them, each once, into ``gguf_cache`` (conftest.py)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VARPACK_CACHE_DIR", str(gguf_cache))
        yield {name: load_tokenizer(str(LLAMA_CPP_VOCAB / f"ggml-vocab-{name}.gguf")) for name in GGUF_VOCABS}


@pytest.mark.parametrize("name", GGUF_VOCABS)
def test_gguf_tokenizers_reproduce_llama_cpps_reference_tokenizations(name, gguf_tokenizers):
    """Every text of llama.cpp's reference (``3333`` as ``333,3`` for Falcon, leading spaces for llama-spm, ...)."""
    reference = gguf_reference(LLAMA_CPP_VOCAB / f"ggml-vocab-{name}.gguf")
    assert reference is not None and len(reference) == 46
    backend = gguf_tokenizers[name].backend()
    wrong = [text for text, ids in reference if backend.encode(text, add_special_tokens=False).ids != ids]
    assert not wrong, f"{len(wrong)} of {len(reference)} differ: {wrong[:3]}"


@pytest.mark.parametrize("name", GGUF_VOCABS)
def test_gguf_tokenizers_keep_the_files_vocabulary_size_bos_eos_and_special_token_ids(name, gguf_tokenizers):
    """DeepSeek-coder's BOS and EOS (32013, 32014 of 32,256 tokens) were added again past the vocabulary."""
    path = LLAMA_CPP_VOCAB / f"ggml-vocab-{name}.gguf"
    vocab, tokenizer = GgufVocab.read(path), gguf_tokenizers[name]
    backend = tokenizer.backend()
    assert backend.get_vocab_size(with_added_tokens=True) == len(vocab.tokens)
    assert backend.token_to_id(tokenizer.bos_token) == vocab.bos_id and backend.token_to_id(tokenizer.eos_token) == vocab.eos_id
    assert tokenizer.suffix_ids == (vocab.eos_id,) and tokenizer.prefix_ids in ((), (vocab.bos_id,))
    whole = [i for i, kind in enumerate(vocab.token_types) if kind in (GGUF_CONTROL, GGUF_USER_DEFINED)]
    assert [backend.token_to_id(vocab.tokens[i]) for i in whole] == whole
    assert all(i < len(vocab.tokens) for i in backend.get_added_tokens_decoder())
    ids = backend.encode(f"{vocab.tokens[whole[-1]]}x", add_special_tokens=False).ids if whole else [0]
    assert not whole or ids[0] == whole[-1]


def test_a_gguf_conversion_with_other_bos_eos_or_vocabulary_size_is_refused_naming_the_file(gguf_tokenizers):
    path = LLAMA_CPP_VOCAB / "ggml-vocab-deepseek-coder.gguf"
    vocab = GgufVocab.read(path)
    vocab.check_ids(path, gguf_tokenizers["deepseek-coder"])
    for changed, what in ((replace(vocab, bos_id=32257), "BOS id 32013, the GGUF file 32257"),
                          (replace(vocab, eos_id=1), "EOS id 32014, the GGUF file 1"),
                          (replace(vocab, tokens=vocab.tokens[:-1]), "vocabulary size 32256, the GGUF file 32255")):
        with pytest.raises(InputError, match=rf"^tokenizer {path}: its conversion has {what}; "):
            changed.check_ids(path, gguf_tokenizers["deepseek-coder"])


def test_a_gguf_conversion_that_does_not_reproduce_its_reference_is_refused_naming_the_file(gguf_tokenizers, gguf_cache,
                                                                                            tmp_path, monkeypatch, capsys):
    """Refused when converted, and when the conversion of the same content is already cached (the reference files may
    have appeared since): the pack command then stops in one line naming the file."""
    vocab = tmp_path / "ggml-vocab-starcoder.gguf"
    shutil.copyfile(LLAMA_CPP_VOCAB / vocab.name, vocab)
    shutil.copyfile(LLAMA_CPP_VOCAB / f"{vocab.name}.inp", f"{vocab}.inp")
    lines = (LLAMA_CPP_VOCAB / f"{vocab.name}.out").read_text(encoding="utf-8").split("\n")
    lines[10] = " 1 2 3"  # not what llama.cpp makes of "Hello world"
    Path(f"{vocab}.out").write_text("\n".join(lines), encoding="utf-8")
    with pytest.raises(InputError, match=rf"tokenizer {vocab}: its conversion does not reproduce llama.cpp's tokenization of 1 of"):
        load_tokenizer(str(vocab))
    (tmp_path / "data.jsonl").write_text('{"text": "hello"}\n')
    monkeypatch.setenv("VARPACK_CACHE_DIR", str(gguf_cache))  # holds StarCoder's conversion, made by gguf_tokenizers
    assert main(["--dataset", str(tmp_path / "data.jsonl"), "--tokenizer", str(vocab), "--no-progress"]) == 1
    error = capsys.readouterr().err.strip()
    assert error.startswith(f"varpack: error: tokenizer {vocab}: ") and "\n" not in error
    assert "its conversion does not reproduce llama.cpp's tokenization of 1 of" in error


def test_a_gguf_tokenizer_is_converted_once_and_cached_by_content(gguf_tokenizers, gguf_cache, tmp_path, monkeypatch):
    """Each file's load converted it into one cache entry; a second load, of the same file under another name, reads
    the cached conversion: transformers is not called."""
    monkeypatch.setenv("VARPACK_CACHE_DIR", str(gguf_cache))
    first = gguf_tokenizers["deepseek-coder"]
    cached = sorted(p.name for p in (gguf_cache / "tokenizers").iterdir())
    assert len(cached) == len(GGUF_VOCABS)
    copy = tmp_path / "model.gguf"
    shutil.copyfile(LLAMA_CPP_VOCAB / "ggml-vocab-deepseek-coder.gguf", copy)

    def refuse(*args, **kwargs):
        raise AssertionError("converted again")

    monkeypatch.setattr("transformers.AutoTokenizer.from_pretrained", refuse)
    again = load_tokenizer(str(copy))
    assert again.content_hash == first.content_hash and sorted(p.name for p in (gguf_cache / "tokenizers").iterdir()) == cached
