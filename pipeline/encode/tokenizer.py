"""Load a tokenizer and describe it by content (vocabulary, merges, special tokens), not by name.

A tokenizer is a Hugging Face Hub id, a local directory, a ``tokenizer.json`` file, a
SentencePiece model (``tokenizer.model``), a tiktoken BPE ranks file (``*.tiktoken``), or the
embedded default: the Mistral-7B v0.1 tokenizer that ships inside ``mistral-common``. Model
files, and directories holding only one, are converted once to a fast tokenizer through
transformers and cached under ``$VARPACK_CACHE_DIR/tokenizers`` (default ``~/.cache/varpack``),
keyed by the file's content; later runs load the cached ``tokenizer.json`` with ``tokenizers``
alone, without importing transformers.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import re
import shutil
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

from pipeline.encode.chat_templates import MISTRAL_INSTRUCT_V01_CHAT_TEMPLATE
from pipeline.config import DEFAULT_TOKENIZER
from pipeline.errors import ConfigError, InputError
from pipeline.read import hub
from schemas import TokenizerInputs, VarpackError, WriteError, atomic_output, cache_dir, file_sha256

DEFAULT_TOKENIZER_FILE = "tokenizer.model.v1"  # in mistral_common/data, Apache-2.0
MISTRAL_V01_TOKENIZER_CONFIG = {
    "tokenizer_class": "LlamaTokenizer",
    # Mistral expects <s> before every sequence and </s> only where the data puts it.
    "add_bos_token": True,
    "add_eos_token": False,
    "bos_token": "<s>",
    "eos_token": "</s>",
    "unk_token": "<unk>",
}



# Names models give their end- and beginning-of-sequence tokens, most common first: used when a
# tokenizer (a bare tokenizer.json) does not say which of its special tokens they are.
EOS_NAMES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|eos|>", "<|im_end|>", "<|eot_id|>")
BOS_NAMES = ("<s>", "<|begin_of_text|>", "<bos>", "<|startoftext|>")
# --bos-token none: put no BOS before examples.
NO_TOKEN = "none"


@dataclass(frozen=True)
class LoadedTokenizer:
    """A fast tokenizer as its serialized ``tokenizer.json`` plus the special tokens the model expects.

    ``prefix_ids`` and ``suffix_ids`` go around every prompt/response or text example: what the
    tokenizer's post-processor adds around one sequence (``[1]`` before, for Mistral), with its
    EOS after when the post-processor adds nothing there. ``bos_token`` and ``eos_token`` are
    the special tokens chat templates use. It pickles as text, so Beam ships it to workers,
    which rebuild the Rust tokenizer once each.
    """

    name: str
    serialized: str
    bos_token: str | None
    eos_token: str | None
    chat_template: str | None
    content_hash: str
    prefix_ids: tuple[int, ...] = ()
    suffix_ids: tuple[int, ...] = ()
    # What a run should be told about how the tokenizer was made (a guessed split pattern).
    notes: tuple[str, ...] = ()

    @classmethod
    def from_backend(
        cls, name: str, backend: Any, bos_token: str | None, eos_token: str | None, chat_template: str | None
    ) -> LoadedTokenizer:
        """Describe a ``tokenizers.Tokenizer``; BOS and EOS not given are found in its special tokens.

        The hash covers its own serialization, which lists the vocabulary, merges, added tokens,
        normalizer and pre/post-processors in a fixed order whatever the file's layout, plus
        the special tokens and what goes around each example.
        """
        prefix, suffix = _post_processor_affixes(backend)
        specials = _special_tokens(backend)
        bos_token = bos_token or _named(specials, prefix[:1] or (), BOS_NAMES, backend)
        eos_token = eos_token or _named(specials, suffix[-1:] or (), EOS_NAMES, backend)
        if not suffix and eos_token is not None:
            suffix = (backend.token_to_id(eos_token),)
        loaded = cls(name, backend.to_str(), bos_token, eos_token, chat_template, "", prefix, suffix)
        return loaded._rehashed(backend)

    def _rehashed(self, backend: Any) -> LoadedTokenizer:
        """This tokenizer with its content hash computed; ``backend`` is cached under it."""
        loaded = replace(self, content_hash=self._digest(self.serialized))
        _BACKENDS[loaded.content_hash] = backend
        return loaded

    def _digest(self, serialized: str) -> str:
        """The content hash of this tokenizer with ``serialized`` as its text."""
        digest = hashlib.sha256(serialized.encode())
        specials = {"bos_token": self.bos_token, "eos_token": self.eos_token, "prefix": self.prefix_ids, "suffix": self.suffix_ids}
        digest.update(json.dumps(specials, sort_keys=True).encode())
        return digest.hexdigest()

    def without_text(self) -> LoadedTokenizer:
        """This tokenizer without its serialized text, which is most of its pickle (1.8 MB for Mistral's).

        Beam pickles, compresses and unpickles a step's function several times per build and per
        worker; a step holds this instead, and ``with_text`` puts the text back once per process.
        """
        _TEXTS[self.content_hash] = self.serialized
        return replace(self, serialized="")

    def with_text(self, read: Callable[[], str]) -> LoadedTokenizer:
        """This tokenizer with its serialized text: this process's copy, else ``read()``, checked against the
        content hash (WrongTokenizerError when it differs) and kept for the process's later builds."""
        if self.serialized:
            return self
        text = _TEXTS.get(self.content_hash)
        if text is None:
            text = read()
            if self._digest(text) != self.content_hash:
                raise WrongTokenizerError(f"the tokenizer read for tokenizer {self.name} is not the one the build planned "
                                          f"(content hash {self.content_hash[:16]}); run the build again")
            _TEXTS[self.content_hash] = text
        return replace(self, serialized=text)

    def with_added_special_tokens(self, tokens: tuple[str, ...]) -> LoadedTokenizer:
        """This tokenizer with ``--special-tokens`` added: each one token, after the vocabulary, in order.

        BOS and EOS not known before are then found among them by their usual names.
        """
        if not tokens:
            return self
        from tokenizers import AddedToken, Tokenizer

        backend = Tokenizer.from_str(self.serialized)
        backend.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in tokens])
        added = LoadedTokenizer.from_backend(self.name, backend, self.bos_token, self.eos_token, self.chat_template)
        return replace(added, notes=self.notes)

    def with_special_tokens(self, bos_token: str | None, eos_token: str | None) -> LoadedTokenizer:
        """This tokenizer with ``--bos-token`` / ``--eos-token`` applied (None: keep; ``none`` BOS: no BOS)."""
        if bos_token is None and eos_token is None:
            return self
        backend, changed = self.backend(), self
        if bos_token == NO_TOKEN:
            changed = replace(changed, prefix_ids=())
        elif bos_token is not None:
            changed = replace(changed, bos_token=bos_token, prefix_ids=(self._id_of(bos_token, "--bos-token"),))
        if eos_token is not None:
            changed = replace(changed, eos_token=eos_token, suffix_ids=(self._id_of(eos_token, "--eos-token"),))
        return changed._rehashed(backend)

    def _id_of(self, token: str, option: str) -> int:
        token_id = self.backend().token_to_id(token)
        if token_id is None:
            known = ", ".join(_special_tokens(self.backend())[:8]) or "none"
            raise ConfigError(f"{option} {token!r} is not a token of tokenizer {self.name} (its special tokens: {known})")
        return token_id

    def backend(self):
        """The Rust ``tokenizers.Tokenizer``, built once per process."""
        return _backend(self.serialized, self.content_hash)

    def token_id(self, token: str | None) -> int | None:
        """The id of a special token, or None."""
        return None if token is None else self.backend().token_to_id(token)

    @property
    def bos_token_id(self) -> int | None:
        return self.token_id(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return self.token_id(self.eos_token)

    def describe_affixes(self) -> str:
        """What goes around each example, for the report: ``BOS <s> (1), EOS </s> (2)``."""
        backend = self.backend()

        def names(ids: tuple[int, ...]) -> str:
            return " ".join(f"{backend.id_to_token(i)} ({i})" for i in ids) or "none"

        return f"BOS {names(self.prefix_ids)}, EOS {names(self.suffix_ids)}"

    def inputs(self) -> TokenizerInputs:
        """The tokenizer's part of the fingerprint."""
        return TokenizerInputs(
            name=self.name,
            content_hash=self.content_hash,
            vocab_size=self.backend().get_vocab_size(with_added_tokens=True),
            bos_token_id=self.prefix_ids[-1] if self.prefix_ids else None,
            eos_token_id=self.suffix_ids[-1] if self.suffix_ids else self.eos_token_id,
        )

    def special_tokens(self) -> dict[str, str]:
        """The special tokens a chat template may use (``bos_token``, ``eos_token``)."""
        return {k: v for k, v in (("bos_token", self.bos_token), ("eos_token", self.eos_token)) if v is not None}


def _post_processor_affixes(backend: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The ids the tokenizer's post-processor adds before and after one sequence."""
    plain = backend.encode("a", add_special_tokens=False).ids
    full = backend.encode("a", add_special_tokens=True).ids
    at = next((k for k in range(len(full) - len(plain) + 1) if full[k : k + len(plain)] == plain), 0)
    return tuple(full[:at]), tuple(full[at + len(plain) :])


def _special_tokens(backend: Any) -> list[str]:
    """The contents of the tokenizer's special added tokens, in id order."""
    decoder = backend.get_added_tokens_decoder()
    return [decoder[i].content for i in sorted(decoder) if decoder[i].special]


# An added token's text that reads as a control marker: <|EOT|>, <｜fim▁hole｜>, <pad>, [PAD32000]; not an added
# word, letter or run of spaces.
_CONTROL_TEXT = re.compile(r"<[^<>\s]+>|\[[^\[\]\s]+\]")


def control_tokens(backend: Any) -> list[str]:
    """The contents of the added tokens that tokenize text holding them as one control token: the special
    ones, and those not flagged special that read as markers (DeepSeek-coder's GGUF ``<|EOT|>``), since
    the tokenizer matches every added token whole, special or not, in id order."""
    decoder = backend.get_added_tokens_decoder()
    return [
        decoder[i].content for i in sorted(decoder) if decoder[i].special or _CONTROL_TEXT.fullmatch(decoder[i].content)
    ]


def _named(specials: list[str], added: tuple[int, ...], names: tuple[str, ...], backend: Any) -> str | None:
    """The token the post-processor adds (``added``), else the first special token with a usual name."""
    if added:
        return backend.id_to_token(added[0])
    return next((name for name in names if name in specials), None)


_BACKENDS: dict[str, Any] = {}
# Serialized tokenizers by content hash, for ``LoadedTokenizer.with_text``: one copy per process.
_TEXTS: dict[str, str] = {}


class WrongTokenizerError(VarpackError):
    """A tokenizer's text, read back for a worker, is not the one its content hash names."""


def _backend(serialized: str, content_hash: str):
    if content_hash not in _BACKENDS:
        from tokenizers import Tokenizer

        _BACKENDS[content_hash] = Tokenizer.from_str(serialized)
    return _BACKENDS[content_hash]


def _token_text(value: Any) -> str | None:
    """A special token from a tokenizer_config.json entry (a string or an AddedToken dict)."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _from_files(name: str, tokenizer_json: Path, config_json: Path | None, chat_template: str | None = None) -> LoadedTokenizer:
    """A tokenizer from a tokenizer.json and, when present, its tokenizer_config.json."""
    config: dict[str, Any] = {}
    if config_json is not None and config_json.is_file():
        config = json.loads(config_json.read_text(encoding="utf-8"))
    template = config.get("chat_template") if isinstance(config.get("chat_template"), str) else None
    jinja = tokenizer_json.with_name("chat_template.jinja")
    if template is None and jinja.is_file():
        template = jinja.read_text(encoding="utf-8")
    from tokenizers import Tokenizer

    return LoadedTokenizer.from_backend(
        name,
        Tokenizer.from_file(str(tokenizer_json)),
        _token_text(config.get("bos_token")),
        _token_text(config.get("eos_token")),
        chat_template or template,
    )


def _default_model_file() -> Path:
    spec = importlib.util.find_spec("mistral_common")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("the default tokenizer needs the package mistral-common: pip install 'mistral-common>=1.5'")
    path = Path(spec.submodule_search_locations[0]) / "data" / DEFAULT_TOKENIZER_FILE
    if not path.is_file():
        raise ConfigError(f"{path} is missing: reinstall mistral-common, or pass --tokenizer")
    return path


# A line of a tiktoken BPE ranks file: a base64 token, a space, its rank.
_TIKTOKEN_LINE = re.compile(rb"[A-Za-z0-9+/]+={0,2} \d+\r?\n")
SENTENCEPIECE = "sentencepiece"
TIKTOKEN = "tiktoken"
CONVERT_HINT = (
    "pass a tokenizer.json, a tokenizer.model (SentencePiece) or .tiktoken file, a directory holding one, or a Hub id; "
    "or convert it with transformers (AutoTokenizer.from_pretrained(SRC).save_pretrained(DIR)) and pass --tokenizer DIR"
)


def _first_line(err: BaseException) -> str:
    """The first line of an exception's message (transformers' run over many lines)."""
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


def model_file_kind(path: Path) -> str | None:
    """``tiktoken`` or ``sentencepiece`` for a tokenizer model file, else None.

    A tiktoken ranks file is text (``*.tiktoken``, or a ``tokenizer.model`` as Llama 3 ships
    it); any other ``*.model`` is taken for a SentencePiece protobuf.
    """
    if path.suffix == ".tiktoken":
        return TIKTOKEN
    if path.suffix != ".model":
        return None
    with open(path, "rb") as f:
        head = f.read(4096)
    return TIKTOKEN if _TIKTOKEN_LINE.match(head) else SENTENCEPIECE


def _save_converted(tokenizer: Any, target: Path) -> None:
    """Save a transformers tokenizer (or a ``tokenizers.Tokenizer``) under ``target``, atomically."""
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        with atomic_output(target, directory=True) as converted:
            if hasattr(tokenizer, "save_pretrained"):
                tokenizer.save_pretrained(str(converted))
            else:
                tokenizer.save(str(converted / "tokenizer.json"))
    except WriteError:
        if not (target / "tokenizer.json").is_file():  # another process may have won the race
            raise


CACHED_SHA256 = "tokenizer.json.sha256"  # beside a cached tokenizer.json: the sha256 of what was written there


def _cached_conversion(target: Path, convert: Callable[[Path], None]) -> Path:
    """The directory of a converted tokenizer: ``target`` in the cache, converted there first when it is missing.

    A cached ``tokenizer.json`` that is not JSON (cut short, or edited), or whose sha256 is not the one recorded
    beside it when it was written (altered, or cached by an older version), is converted again, with a line that
    names it. A cache that cannot be written (read-only) gets a conversion in a temporary directory for this
    process, with a line that says so, so a build is still packed or reused.
    """
    cached = target / "tokenizer.json"
    if cached.is_file():
        try:
            content = cached.read_bytes()
            recorded = (target / CACHED_SHA256).read_text().strip() if (target / CACHED_SHA256).is_file() else "none"
            digest = hashlib.sha256(content).hexdigest()
            if digest == recorded:  # what was written there, which was JSON: not parsed again on every load
                return target
            json.loads(content)
            print(f"varpack: {cached}: the cached tokenizer is not the one converted there (sha256 {digest[:16]}, "
                  f"recorded {recorded[:16]}); converting it again", file=sys.stderr)
        except (OSError, ValueError) as err:
            print(f"varpack: {cached}: the cached tokenizer cannot be read ({_first_line(err)}); converting it again",
                  file=sys.stderr)
    try:
        if target.exists():
            shutil.rmtree(target)
        convert(target)
        _record_sha256(target)
        return target
    except (OSError, WriteError) as err:
        fallback = Path(tempfile.mkdtemp(prefix="varpack-tokenizer-")) / target.name
        print(f"varpack: the tokenizer cache {target.parent} cannot be written ({_first_line(err)}); converted into "
              f"{fallback} for this run; point $VARPACK_CACHE_DIR at a writable directory to keep it", file=sys.stderr)
        convert(fallback)
        return fallback


def _record_sha256(target: Path) -> None:
    """Write the sha256 of ``target/tokenizer.json`` beside it (a new file renamed into place)."""
    digest = file_sha256(target / "tokenizer.json")
    with tempfile.NamedTemporaryFile("w", dir=target, prefix=f".{CACHED_SHA256}.", delete=False) as f:
        f.write(digest + "\n")
    Path(f.name).replace(target / CACHED_SHA256)


def _convert_sentencepiece(model_file: Path, target: Path, config: dict[str, Any] | None = None) -> None:
    """Convert a SentencePiece model to a fast tokenizer with transformers and save it under ``target``.

    ``config`` is a tokenizer_config.json to convert with (the class and special tokens).
    ``LlamaTokenizer(vocab_file=...)`` silently yields an empty tokenizer in transformers 5, so
    the model goes into a folder, beside the config when there is one.
    """
    from transformers import AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        source = Path(tmp) / "source"
        source.mkdir()
        shutil.copyfile(model_file, source / "tokenizer.model")
        if config is not None:
            (source / "tokenizer_config.json").write_text(json.dumps(config))
        tokenizer = AutoTokenizer.from_pretrained(str(source))
        if len(tokenizer) < 2:
            raise ConfigError(f"converting {model_file} gave an empty tokenizer; check the transformers version")
        _save_converted(tokenizer, target)


# A possessive quantifier: ?+ *+ ++ {m,n}+ (not the + after \p{L}).
_POSSESSIVE = re.compile(r"([?*+]|\{\d+(?:,\d*)?\})\+")


@dataclass(frozen=True)
class TiktokenEncoding:
    """What a tiktoken ranks file does not hold: the split pattern and the special tokens with their ids.

    They come from a JSON file beside the ranks file, named after it (``qwen.tiktoken.json``;
    ``tokenizer.model.json`` beside a Llama 3 ``tokenizer.model``), holding ``pat_str`` and
    ``special_tokens``, the arguments tiktoken's own encodings are defined by::

        {"pat_str": "(?i:'s|'t|...)|\\s+", "special_tokens": {"<|endoftext|>": 151643, "<|im_start|>": 151644}}

    tiktoken's own encodings (``cl100k_base.tiktoken``, ``o200k_base.tiktoken``, ...) are known
    by their content and need no JSON. Otherwise the pattern is a guess (transformers' default,
    that of cl100k_base and Llama 3).
    """

    pat_str: str | None = None
    special_tokens: tuple[tuple[str, int], ...] = ()

    @classmethod
    def of(cls, ranks_file: Path) -> tuple[TiktokenEncoding, Path | None]:
        """The encoding of ``ranks_file``: the JSON beside it, else tiktoken's own encoding of that content
        (empty when neither), and the JSON file read (or None)."""
        encoding, described_by = cls.beside(ranks_file)
        if described_by is None:
            encoding = tiktoken_encodings().get(file_sha256(ranks_file), encoding)
        return encoding, described_by

    @property
    def split_pattern(self) -> str | None:
        """``pat_str`` for the tokenizers library, whose regex engine (Oniguruma) reads tiktoken's
        possessive quantifiers (``?+``, ``++``, ``{1,3}+``) otherwise: as greedy ones, which split alike."""
        return None if self.pat_str is None else _POSSESSIVE.sub(r"\1", self.pat_str)

    def to_json(self) -> str:
        return json.dumps({"pat_str": self.pat_str, "special_tokens": dict(self.special_tokens)}, sort_keys=True)

    @classmethod
    def beside(cls, ranks_file: Path) -> tuple[TiktokenEncoding, Path | None]:
        """The encoding the JSON file beside ``ranks_file`` describes, and that file; empty and None without one."""
        path = ranks_file.with_name(ranks_file.name + ".json")
        if not path.is_file():
            return cls(), None
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            specials = data.get("special_tokens", {})
            pattern = data.get("pat_str")
            if not isinstance(specials, dict) or not all(isinstance(i, int) and i >= 0 for i in specials.values()):
                raise ValueError("special_tokens must map each token to its id")
            if pattern is not None and not isinstance(pattern, str):
                raise ValueError("pat_str must be a regular expression")
        except (ValueError, AttributeError) as err:
            raise InputError(f"{path}: {_first_line(err)}; expected {{\"pat_str\": ..., \"special_tokens\": {{TOKEN: ID}}}}") from err
        return cls(pattern, tuple(sorted(specials.items(), key=lambda item: item[1]))), path


@functools.cache
def tiktoken_encodings() -> dict[str, TiktokenEncoding]:
    """tiktoken's own encodings (cl100k_base, o200k_base, ...) by the sha256 of their ranks file.

    tiktoken defines each one by a function that downloads its ranks file and checks its hash;
    each is run here with a loader that downloads nothing and notes the hash it expects.
    """
    from tiktoken_ext import openai_public

    expected: list[str] = []

    def note_hash(url: str, expected_hash: str | None = None) -> dict[bytes, int]:
        if expected_hash:
            expected.append(expected_hash)
        return {}

    def no_data_gym(*args: Any, **kwargs: Any) -> dict[bytes, int]:
        return {}  # gpt2's vocab.bpe and encoder.json are no ranks file

    loaders = (openai_public.load_tiktoken_bpe, openai_public.data_gym_to_mergeable_bpe_ranks)
    openai_public.load_tiktoken_bpe, openai_public.data_gym_to_mergeable_bpe_ranks = note_hash, no_data_gym
    known: dict[str, TiktokenEncoding] = {}
    try:
        for make in openai_public.ENCODING_CONSTRUCTORS.values():
            expected.clear()
            definition = make()
            for sha256 in expected[-1:]:
                specials = tuple(sorted(definition["special_tokens"].items(), key=lambda item: item[1]))
                known.setdefault(sha256, TiktokenEncoding(definition["pat_str"], specials))
    finally:
        openai_public.load_tiktoken_bpe, openai_public.data_gym_to_mergeable_bpe_ranks = loaders
    return known


def _convert_tiktoken(ranks_file: Path, target: Path, encoding: TiktokenEncoding) -> None:
    """Convert a tiktoken BPE ranks file with transformers' TikTokenConverter and save it under ``target``.

    The special tokens get the ids ``encoding`` gives them; ids it skips between the ranks and
    them are held by ``<|unused_ID|>`` special tokens, so that every id is the model's.
    """
    from tokenizers import AddedToken
    from transformers.convert_slow_tokenizer import TikTokenConverter

    options = {"pattern": encoding.split_pattern} if encoding.pat_str else {}
    converted = TikTokenConverter(vocab_file=str(ranks_file), **options).converted()
    for token, token_id in encoding.special_tokens:
        size = converted.get_vocab_size(with_added_tokens=True)
        if token_id < size:
            raise InputError(f"{ranks_file}: special token {token!r} has id {token_id}, which an earlier token holds")
        unused = [AddedToken(f"<|unused_{i}|>", special=True, normalized=False) for i in range(size, token_id)]
        converted.add_special_tokens([*unused, AddedToken(token, special=True, normalized=False)])
    _save_converted(converted, target)


def _check_sentencepiece(model_file: Path) -> None:
    """Raise InputError unless ``model_file`` is a SentencePiece model that sentencepiece itself can load."""
    import sentencepiece

    try:
        sentencepiece.SentencePieceProcessor(model_file=str(model_file))
    except (OSError, RuntimeError) as err:
        raise InputError(f"tokenizer {model_file}: not a SentencePiece model ({_first_line(err)}); {CONVERT_HINT}") from err


def _with_model_bos(loaded: LoadedTokenizer, model_file: Path) -> LoadedTokenizer:
    """``loaded`` with the BOS piece of SentencePiece model ``model_file`` before every example, as llama.cpp
    and transformers' LlamaTokenizer put it (transformers' conversion of a bare model adds none); unchanged
    for a model that defines no BOS."""
    import sentencepiece

    model = sentencepiece.SentencePieceProcessor(model_file=str(model_file))
    if model.bos_id() < 0:
        return loaded
    return loaded.with_special_tokens(model.id_to_piece(model.bos_id()), None)


def _converted(model_file: Path, kind: str, name: str) -> LoadedTokenizer:
    """A SentencePiece or tiktoken model file as a fast tokenizer, converted once and cached by content
    (a tiktoken file's with the JSON beside it, see TiktokenEncoding)."""
    key = file_sha256(model_file)
    encoding, described_by = TiktokenEncoding.of(model_file) if kind == TIKTOKEN else (TiktokenEncoding(), None)
    if encoding != TiktokenEncoding():
        key = hashlib.sha256((key + encoding.to_json()).encode()).hexdigest()

    def convert(target: Path) -> None:
        if kind == SENTENCEPIECE:
            _check_sentencepiece(model_file)
            _convert_sentencepiece(model_file, target)
        else:
            try:
                _convert_tiktoken(model_file, target, encoding)
            except ValueError as err:  # tiktoken's message names the line it cannot parse
                raise InputError(f"tokenizer {model_file}: not a tiktoken BPE file ({_first_line(err)}); {CONVERT_HINT}") from err

    target = _cached_conversion(cache_dir() / "tokenizers" / f"{kind}-{key[:16]}", convert)
    loaded = _from_files(name, target / "tokenizer.json", target / "tokenizer_config.json")
    if kind == SENTENCEPIECE and not loaded.prefix_ids:
        loaded = _with_model_bos(loaded, model_file)
    if kind == TIKTOKEN and encoding.pat_str is None:
        guess = (
            f"tokenizer {model_file}: a tiktoken ranks file holds no split pattern, so cl100k_base's is a guess, and "
            "text splits differently where the model's own pattern differs (Qwen's, o200k's); put its pat_str in "
            f"{model_file.name}.json beside it"
        )
        loaded = replace(loaded, notes=(guess,))
    return loaded


def load_default_tokenizer() -> LoadedTokenizer:
    """The embedded Mistral-7B v0.1 tokenizer, converted once and cached, and read once per process."""
    model_file = _default_model_file()
    target = _cached_conversion(cache_dir() / "tokenizers" / f"{DEFAULT_TOKENIZER}-{file_sha256(model_file)[:16]}",
                                lambda target: _convert_sentencepiece(model_file, target, MISTRAL_V01_TOKENIZER_CONFIG))
    written = (target / "tokenizer.json").stat()
    return _converted_default(target, (written.st_ino, written.st_size, written.st_mtime_ns))


@functools.lru_cache(maxsize=4)
def _converted_default(target: Path, written: tuple[int, int, int]) -> LoadedTokenizer:
    """The default tokenizer from its converted files in ``target``; ``written`` (inode, size and modification time
    of its tokenizer.json) is part of the key, so files converted again are read again."""
    return _from_files(
        DEFAULT_TOKENIZER, target / "tokenizer.json", target / "tokenizer_config.json", MISTRAL_INSTRUCT_V01_CHAT_TEMPLATE
    )


def _from_transformers(spec: str) -> LoadedTokenizer:
    """A Hub id or local directory loaded with AutoTokenizer; it must have a fast (Rust) backend."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(spec)
    except (OSError, ValueError) as err:
        if not Path(spec).exists() and hub.is_offline():
            raise hub.unreachable_error("tokenizer", spec, "HF_HUB_OFFLINE is set and it is not in the local cache") from err
        raise InputError(f"tokenizer {spec!r} could not be loaded ({_first_line(err)}); {CONVERT_HINT}") from err
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise InputError(f"tokenizer {spec!r} has no fast (tokenizers) backend; {CONVERT_HINT}")
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else None
    return LoadedTokenizer.from_backend(spec, backend, tokenizer.bos_token, tokenizer.eos_token, template)


# How llama.cpp splits text before byte-level BPE, by the GGUF's ``tokenizer.ggml.pre``, for the
# pre-tokenizers transformers' GGUF conversion does not set (it then splits as GPT-2 does). Each
# expression splits the pieces the one before left, keeping what lies between matches, as
# llama.cpp's ``unicode_regex_split`` does (src/llama-vocab.cpp, MIT licence).
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
GGUF_SPLITS: dict[str, tuple[str, ...]] = {
    "falcon": (r"[\p{P}\$\+<=>\^~\|`]+", _GPT2_SPLIT, r"[0-9][0-9][0-9]"),
    **dict.fromkeys(
        ("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva"), (r"\p{N}", _GPT2_SPLIT)
    ),
    **dict.fromkeys(("gpt-2", "mpt", "olmo", "jais"), (_GPT2_SPLIT,)),
    "deepseek-coder": (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", '[一-龥ࠀ-一가-\ud7ff]+', r"\p{N}"),
    "deepseek-llm": (
        '[\r\n]',
        (
            '\\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-'
            'ὅὈ-Ὅὐ-ὗὙὛὝὟ-ώᾀ-ᾴᾶ-ᾼιῂ-ῄῆ-ῌῐ-ΐῖ-Ίῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤΩℨK-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ'
            '-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃]+'
        ),
        '\\s?[!-/:-~！-／：-～‘-‟\u3000-。]+',
        '\\s+$',
        '[一-龥ࠀ-一가-\ud7ff]+',
        '\\p{N}+',
    ),
}
# The conversion's version, part of its cache key: a new one converts every GGUF file again.
GGUF_CONVERSION = "gguf3"
# llama.cpp's token types (tokenizer.ggml.token_type) of the tokens matched whole before splitting:
# control tokens (BOS, EOS, ...), special, and user-defined ones.
GGUF_CONTROL, GGUF_USER_DEFINED = 3, 4
# llama.cpp's reference tokenizations beside a vocabulary file: NAME.gguf.inp holds texts separated
# by this line, NAME.gguf.out the ids of each, one line per text.
GGUF_REFERENCE_SEPARATOR = "\n__ggml_vocab_test__\n"


@dataclass(frozen=True)
class GgufVocab:
    """What a GGUF file says of its tokenizer beyond the vocabulary: ``tokenizer.ggml.model`` (``llama``
    for SentencePiece, ``gpt2`` for byte-level BPE), ``tokenizer.ggml.pre``, whether SentencePiece
    text gets a space before it (``tokenizer.ggml.add_space_prefix``, true when absent), the tokens
    with their types, and the ids of BOS and EOS."""

    model: str | None
    pre: str | None
    add_space_prefix: bool
    tokens: tuple[str, ...] = ()
    token_types: tuple[int, ...] = ()
    bos_id: int | None = None
    eos_id: int | None = None

    @classmethod
    def read(cls, path: Path) -> GgufVocab:
        from gguf import GGUFReader

        try:
            fields = GGUFReader(str(path)).fields
        except (ValueError, OSError) as err:
            raise InputError(f"tokenizer {path}: not a GGUF file ({_first_line(err)}); {CONVERT_HINT}") from err

        def value(key: str) -> Any:
            return fields[key].contents() if key in fields else None

        return cls(
            value("tokenizer.ggml.model"),
            value("tokenizer.ggml.pre"),
            value("tokenizer.ggml.add_space_prefix") is not False,
            tuple(value("tokenizer.ggml.tokens") or ()),
            tuple(value("tokenizer.ggml.token_type") or ()),
            value("tokenizer.ggml.bos_token_id"),
            value("tokenizer.ggml.eos_token_id"),
        )

    def with_gguf_ids(self, backend: Any) -> Any:
        """``backend`` with every control and user-defined token of the GGUF file an added token at its
        GGUF id (control ones special), and added tokens the file lacks dropped: transformers' conversion
        keeps control tokens in byte-level form and adds BOS and EOS again past the vocabulary."""
        from tokenizers import Tokenizer

        whole = {text: i for i, (text, kind) in enumerate(zip(self.tokens, self.token_types)) if kind in (GGUF_CONTROL, GGUF_USER_DEFINED)}
        if not whole:
            return backend
        data = json.loads(backend.to_str())
        moved: dict[int, int] = {}
        added: dict[int, dict[str, Any]] = {}
        for token in data["added_tokens"]:
            if token["id"] < len(self.tokens) and self.tokens[token["id"]] == token["content"]:
                added[token["id"]] = token
            elif token["content"] in whole:  # re-added past the vocabulary: back to its GGUF id
                moved[token["id"]] = whole[token["content"]]
                added[whole[token["content"]]] = {**token, "id": whole[token["content"]]}
        for text, i in whole.items():
            special = self.token_types[i] == GGUF_CONTROL
            added.setdefault(i, {"id": i, "content": text, "single_word": False, "lstrip": False, "rstrip": False,
                                 "normalized": False, "special": special})
        data["added_tokens"] = [added[i] for i in sorted(added)]
        vocab = data["model"]["vocab"]
        if isinstance(vocab, dict):  # BPE, WordPiece: the model's entry of each whole token holds its GGUF text
            text_of = {i: text for text, i in vocab.items()}
            for i, token in added.items():
                if text_of.get(i, token["content"]) != token["content"] and token["content"] not in vocab:
                    del vocab[text_of[i]]
                    vocab[token["content"]] = i
        for entry in ((data.get("post_processor") or {}).get("special_tokens") or {}).values():
            entry["ids"] = [moved.get(i, i) for i in entry["ids"]]
        return Tokenizer.from_str(json.dumps(data))

    def check_ids(self, path: Path, loaded: LoadedTokenizer) -> None:
        """Raise InputError, naming the file, when the converted tokenizer's vocabulary size, BOS or EOS id
        differs from the GGUF file's own (``tokenizer.ggml.tokens``, ``bos_token_id``, ``eos_token_id``)."""
        backend = loaded.backend()
        found = {
            "vocabulary size": (backend.get_vocab_size(with_added_tokens=True), len(self.tokens)),
            "BOS id": (backend.token_to_id(loaded.bos_token) if loaded.bos_token else None, self.bos_id),
            "EOS id": (backend.token_to_id(loaded.eos_token) if loaded.eos_token else None, self.eos_id),
        }
        for what, (got, expected) in found.items():
            if expected is not None and got != expected:
                raise InputError(
                    f"tokenizer {path}: its conversion has {what} {got}, the GGUF file {expected}; "
                    f"convert the model's own tokenizer instead ({CONVERT_HINT})"
                )

    def fix(self, backend: Any) -> None:
        """Make ``backend`` (transformers' conversion) split text as llama.cpp does, in place: the
        pre-tokenizer of GGUF_SPLITS for byte-level BPE, and for SentencePiece a space before the text
        even when it starts with one (transformers' Metaspace adds none then)."""
        from tokenizers import Regex, normalizers, pre_tokenizers

        if self.model == "gpt2" and self.pre in GGUF_SPLITS:
            splits = [pre_tokenizers.Split(Regex(pattern), behavior="isolated") for pattern in GGUF_SPLITS[self.pre]]
            backend.pre_tokenizer = pre_tokenizers.Sequence(
                [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
            )
        elif self.model == "llama" and (json.loads(backend.to_str()).get("pre_tokenizer") or {}).get("type") == "Metaspace":
            spaces = [normalizers.Replace(" ", "▁")]
            backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), *spaces] if self.add_space_prefix else spaces)
            backend.pre_tokenizer = None


def gguf_reference(path: Path) -> list[tuple[str, list[int]]] | None:
    """llama.cpp's reference tokenizations of a GGUF file, from ``NAME.gguf.inp`` and ``NAME.gguf.out``
    beside it: (text, ids) pairs, or None without them."""
    texts_file, ids_file = path.with_name(path.name + ".inp"), path.with_name(path.name + ".out")
    if not (texts_file.is_file() and ids_file.is_file()):
        return None
    texts = texts_file.read_text(encoding="utf-8").split(GGUF_REFERENCE_SEPARATOR)
    lines = ids_file.read_text(encoding="utf-8").split("\n")
    texts, lines = texts[:-1] if texts and not texts[-1] else texts, lines[:-1] if lines and not lines[-1] else lines
    if len(texts) != len(lines):
        raise InputError(f"{ids_file}: {len(lines)} lines of token ids for the {len(texts)} texts of {texts_file.name}")
    return [(text, [int(i) for i in line.split()]) for text, line in zip(texts, lines)]


def check_gguf_reference(path: Path, backend: Any) -> int:
    """Raise InputError, naming the file, when the converted tokenizer of GGUF file ``path`` does not
    reproduce llama.cpp's reference tokenizations beside it; returns how many texts were checked."""
    reference = gguf_reference(path)
    if reference is None:
        return 0
    encodings = backend.encode_batch([text for text, _ in reference], add_special_tokens=False)
    wrong = [(text, ids, encoding.ids) for (text, ids), encoding in zip(reference, encodings) if encoding.ids != ids]
    if wrong:
        text, expected, got = wrong[0]
        raise InputError(
            f"tokenizer {path}: its conversion does not reproduce llama.cpp's tokenization of {len(wrong)} of the "
            f"{len(reference)} texts in {path.name}.inp (the first, {text[:40]!r}: {got[:12]} for {expected[:12]}); "
            f"convert the model's own tokenizer instead ({CONVERT_HINT})"
        )
    return len(reference)


def _from_gguf(path: Path) -> LoadedTokenizer:
    """A GGUF file's tokenizer, converted once with transformers (its splits made llama.cpp's), cached by
    the file's content, and checked against llama.cpp's reference tokenizations beside it."""
    target = cache_dir() / "tokenizers" / f"{GGUF_CONVERSION}-{file_sha256(path)[:16]}"
    cached = (target / "tokenizer.json").is_file()
    if not cached:
        vocab = GgufVocab.read(path)
        from huggingface_hub.errors import StrictDataclassError
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        except (OSError, ValueError, StrictDataclassError) as err:  # the last: a model config transformers cannot read
            raise InputError(f"tokenizer {path} could not be converted ({_first_line(err)}); {CONVERT_HINT}") from err
        vocab.fix(tokenizer.backend_tokenizer)
        tokenizer._tokenizer = vocab.with_gguf_ids(tokenizer.backend_tokenizer)
        check_gguf_reference(path, tokenizer.backend_tokenizer)
        _save_converted(tokenizer, target)
    loaded = _from_files(str(path), target / "tokenizer.json", target / "tokenizer_config.json")
    if cached:  # the reference files may have appeared since
        check_gguf_reference(path, loaded.backend())
    else:
        vocab.check_ids(path, loaded)
    return loaded


def _from_tokenizer_json(path: Path) -> LoadedTokenizer:
    """A ``tokenizer.json`` file, with the tokenizer_config.json beside it when there is one."""
    try:
        return _from_files(str(path), path, path.with_name("tokenizer_config.json"))
    except Exception as err:  # tokenizers raises a bare Exception for a malformed file
        raise InputError(f"tokenizer {path} could not be read: {err}") from err


def _from_directory(path: Path) -> LoadedTokenizer:
    """A tokenizer directory: transformers' files, or a single SentencePiece or tiktoken model to convert."""
    names = sorted(p.name for p in path.iterdir() if p.is_file() and not p.name.startswith("."))
    if not names:
        raise InputError(f"tokenizer {path}: the directory is empty; {CONVERT_HINT}")
    if {"tokenizer.json", "tokenizer_config.json"} & set(names):
        return _from_transformers(str(path))
    models = [(path / n, kind) for n in names if (kind := model_file_kind(path / n)) is not None]
    if len(models) > 1:
        listed = ", ".join(model.name for model, _ in models)
        raise InputError(f"tokenizer {path}: holds several tokenizer models ({listed}); pass the one to use")
    if models:
        model, kind = models[0]
        return _converted(model, kind, str(path))
    return _from_transformers(str(path))


def holds_tokenizer(directory: Path) -> bool:
    """Whether a directory (a model's, say) holds a tokenizer: transformers' files or a tokenizer model file."""
    return directory.is_dir() and any(
        p.name in ("tokenizer.json", "tokenizer_config.json") or (p.is_file() and model_file_kind(p) is not None)
        for p in directory.iterdir()
    )


def check_model_tokenizer(model: str, recorded: TokenizerInputs) -> None:
    """Raise ConfigError when the ``--model`` directory (or its GGUF file) holds a tokenizer that is
    not, by content, the one the shards were built with (``inputs.tokenizer``); a model without one passes."""
    if not (Path(model).is_file() or holds_tokenizer(Path(model))) or matches_recorded(model, recorded):
        return
    raise ConfigError(
        f"--model {model}: its tokenizer differs from the one the shards were built with ({recorded.name}, content "
        f"{recorded.content_hash[:12]}), so token ids would mean other text; pack with --tokenizer {model}, or pass "
        "--allow-tokenizer-mismatch"
    )


def matches_recorded(spec: str, recorded: TokenizerInputs) -> bool:
    """Whether the tokenizer ``spec`` names is, by content, the one a build recorded (``inputs.tokenizer``).

    It matches as it loads, or with the BOS and EOS the build recorded applied, as
    ``--bos-token`` / ``--eos-token`` did when packing.
    """
    loaded = _load(spec)
    if loaded.content_hash == recorded.content_hash:
        return True
    backend = loaded.backend()
    bos = NO_TOKEN if recorded.bos_token_id is None else backend.id_to_token(recorded.bos_token_id)
    eos = None if recorded.eos_token_id is None else backend.id_to_token(recorded.eos_token_id)
    try:
        return loaded.with_special_tokens(bos, eos).content_hash == recorded.content_hash
    except ConfigError:
        return False


def load_tokenizer(
    spec: str = DEFAULT_TOKENIZER,
    bos_token: str | None = None,
    eos_token: str | None = None,
    special_tokens: tuple[str, ...] = (),
) -> LoadedTokenizer:
    """Load the tokenizer named by ``spec`` (the default, a tokenizer file, a directory or a Hub id),
    with ``--special-tokens`` added and ``--bos-token`` / ``--eos-token`` applied."""
    return _load(spec).with_added_special_tokens(special_tokens).with_special_tokens(bos_token, eos_token)


def _load(spec: str) -> LoadedTokenizer:
    if spec == DEFAULT_TOKENIZER:
        return load_default_tokenizer()
    path = Path(spec)
    if path.is_file():
        if path.suffix == ".json":
            return _from_tokenizer_json(path)
        if path.suffix == ".gguf":
            return _from_gguf(path)
        kind = model_file_kind(path)
        if kind is None:
            raise InputError(f"tokenizer {spec}: not a tokenizer file; {CONVERT_HINT}")
        return _converted(path, kind, spec)
    if path.is_dir():
        return _from_directory(path)
    if spec.startswith((".", "/", "~")) or spec.count("/") > 1:
        raise InputError(f"tokenizer {spec}: no such file or directory")
    hub.require_reachable("tokenizer", spec)
    return _from_transformers(spec)
