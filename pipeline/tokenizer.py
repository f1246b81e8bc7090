"""Byte-level BPE encoding with a tokenizer.json (HF `tokenizers`), fast.

The same vocabulary and merges are loaded into `tiktoken` when it is installed, because its batch
encoder is several times faster; the tokenizer.json is checked first so that both backends produce
the same ids, and the plain HF path is used whenever that cannot be guaranteed. Training a
tokenizer.json is a tool's job (tools/data/train_tokenizer.py, ``python -m tools tokenizer``).
"""

from __future__ import annotations

import json
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
from tokenizers import Tokenizer


EOS_TOKEN = "<|endoftext|>"
# GPT-2's pre-tokenization split; HF's ByteLevel(use_regex=True) applies the
# same expression, so tiktoken must be given exactly this one.
GPT2_SPLIT_PATTERN = (
    r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
)


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map.

    Byte-level BPE vocabularies store every token as a string of these
    characters; inverting the map recovers the token's raw bytes.
    """
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("\N{INVERTED EXCLAMATION MARK}"), ord("\N{NOT SIGN}") + 1),
        *range(ord("\N{REGISTERED SIGN}"), ord("\N{LATIN SMALL LETTER Y WITH DIAERESIS}") + 1),
    ]
    mapping = {byte: chr(byte) for byte in printable}
    shifted = 0
    for byte in range(256):
        if byte not in mapping:
            mapping[byte] = chr(256 + shifted)
            shifted += 1
    return mapping


def _merge_pairs(merges: list) -> list[tuple[str, str]]:
    """tokenizer.json stores merges as ["a", "b"] pairs or, in older files, "a b"."""
    pairs = []
    for merge in merges:
        left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
        pairs.append((left, right))
    return pairs


def tiktoken_tables(config: dict) -> tuple[dict[bytes, int], dict[str, int]]:
    """Translate a tokenizer.json into tiktoken's (mergeable_ranks, special_tokens).

    tiktoken ranks a merge by the id of the token it produces, while HF ranks
    it by its position in the merge list; the two agree only for a plain
    GPT-2-style byte-level BPE whose merge results have increasing ids.
    Raises ValueError for anything else, since ids would then silently differ.
    """

    def require(condition: bool, problem: str) -> None:
        if not condition:
            raise ValueError(f"tokenizer.json is not a plain byte-level BPE: {problem}")

    require(config.get("normalizer") is None, "it has a normalizer")
    pre = config.get("pre_tokenizer") or {}
    require(pre.get("type") == "ByteLevel", f"pre-tokenizer is {pre.get('type')}, not ByteLevel")
    require(not pre.get("add_prefix_space", False), "ByteLevel pre-tokenizer adds a prefix space")
    require(pre.get("use_regex", True), "ByteLevel pre-tokenizer does not use the GPT-2 regex")
    decoder = config.get("decoder") or {}
    require(decoder.get("type") == "ByteLevel", f"decoder is {decoder.get('type')}, not ByteLevel")
    post = config.get("post_processor")
    require(post is None or post.get("type") == "ByteLevel", "post-processor adds tokens")

    model = config.get("model") or {}
    require(model.get("type") == "BPE", f"model is {model.get('type')}, not BPE")
    require(not model.get("dropout"), "BPE dropout is set")
    require(not model.get("continuing_subword_prefix"), "continuing_subword_prefix is set")
    require(not model.get("end_of_word_suffix"), "end_of_word_suffix is set")
    require(not model.get("byte_fallback", False), "byte_fallback is set")
    require(not model.get("ignore_merges", False), "ignore_merges is set")

    added = config.get("added_tokens") or []
    require(all(token.get("special") for token in added), "it has non-special added tokens")
    special_tokens = {token["content"]: token["id"] for token in added}
    require(EOS_TOKEN in special_tokens, f"{EOS_TOKEN} is not a special token")

    char_to_byte = {char: byte for byte, char in byte_to_unicode().items()}
    vocab: dict[str, int] = model.get("vocab") or {}
    ranks: dict[bytes, int] = {}
    for token, token_id in vocab.items():
        if token in special_tokens:
            require(special_tokens[token] == token_id, f"{token!r} has two ids")
            continue
        require(all(char in char_to_byte for char in token), f"token {token!r} is not byte-level")
        token_bytes = bytes(char_to_byte[char] for char in token)
        require(token_bytes not in ranks, f"two tokens have the bytes {token_bytes!r}")
        ranks[token_bytes] = token_id
    require(all(bytes([byte]) in ranks for byte in range(256)), "not all 256 bytes are tokens")
    all_ids = sorted([*ranks.values(), *special_tokens.values()])
    require(all_ids == list(range(len(all_ids))), "token ids are not contiguous")

    previous_rank = -1
    merged_tokens = set()
    for left, right in _merge_pairs(model.get("merges") or []):
        merged = left + right
        require(merged in vocab and left in vocab and right in vocab, f"merge {left!r} {right!r}")
        require(vocab[merged] > previous_rank, f"merge results out of id order at {merged!r}")
        previous_rank = vocab[merged]
        merged_tokens.add(merged)
    multi_byte = {token for token in vocab if token not in special_tokens and len(token) > 1}
    require(multi_byte <= merged_tokens, "some tokens are not produced by any merge")
    return ranks, special_tokens


def _raise_unless_tiktoken_gave_up(error: BaseException) -> None:
    """tiktoken's backtracking regex gives up on some valid text ("Max stack size exceeded for
    backtracking" on a run of about a million spaces, under RunFab's 1 MiB a record), which HF's
    regex engine encodes in linear time: ``encode_to_numpy`` raises ValueError, ``encode_ordinary``
    panics (PyO3's PanicException, which derives from BaseException). Anything else is raised."""
    if not isinstance(error, ValueError) and type(error).__name__ != "PanicException":
        raise error


class TextEncoder:
    """Encodes documents to token ids with a tokenizer.json (trained here, or GPT-2's: EOS is not always id 0).

    Uses tiktoken when available and the file allows it (`backend ==
    "tiktoken"`), otherwise HF tokenizers (`backend == "tokenizers"`); both
    give the same ids. A literal "<|endoftext|>" in a document is encoded as
    ordinary text, so documents cannot inject EOS; callers append `eos_id`.
    """

    def __init__(self, path: str | Path, prefer_fast: bool = True, num_threads: int = 2):
        self.path = Path(path)
        self.num_threads = num_threads
        self._hf = Tokenizer.from_file(str(self.path))
        self._hf.encode_special_tokens = True
        eos_id = self._hf.token_to_id(EOS_TOKEN)
        if eos_id is None:
            raise ValueError(f"{self.path} has no {EOS_TOKEN} token")
        self.eos_id: int = eos_id
        self.vocab_size: int = self._hf.get_vocab_size(with_added_tokens=True)
        self._tiktoken = self._load_tiktoken() if prefer_fast else None
        self.backend: str = "tiktoken" if self._tiktoken is not None else "tokenizers"
        self._pool: ThreadPoolExecutor | None = None

    def _encode_slice(self, texts: list[str]) -> list[list[int]]:
        return [self._tiktoken.encode_ordinary(text) for text in texts]

    def _encode_slice_arrays(self, texts: list[str]) -> list[np.ndarray]:
        # No special tokens allowed or refused: a literal "<|endoftext|>" is ordinary text, as in encode_ordinary.
        encode = getattr(self._tiktoken, "encode_to_numpy", None)
        if encode is None:  # tiktoken < 0.8
            return [np.asarray(ids, dtype=np.int32) for ids in self._encode_slice(texts)]
        # uint32 ids below 2**31 read as int32 without a copy; the caller copies them into its rows.
        return [encode(text, allowed_special=set(), disallowed_special=()).view(np.int32) for text in texts]

    def _load_tiktoken(self):
        try:
            import tiktoken
        except ImportError:
            return None
        try:
            config = json.loads(self.path.read_text(encoding="utf-8"))
            ranks, special_tokens = tiktoken_tables(config)
        except ValueError as err:
            warnings.warn(f"{err}; using the slower HF tokenizers backend", RuntimeWarning)
            return None
        return tiktoken.Encoding(
            name=self.path.stem,
            pat_str=GPT2_SPLIT_PATTERN,
            mergeable_ranks=ranks,
            special_tokens=special_tokens,
            explicit_n_vocab=self.vocab_size,
        )

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, without EOS."""
        if self._tiktoken is not None:
            try:
                return self._in_slices(self._encode_slice, texts)
            except BaseException as error:
                _raise_unless_tiktoken_gave_up(error)
        return self._hf_encode_batch(texts)

    def encode_batch_arrays(self, texts: list[str]) -> list[np.ndarray]:
        """The same ids as int32 arrays, which is what training packs. tiktoken then writes them
        straight into arrays, without a Python int per token, which is faster than converting lists."""
        if self._tiktoken is not None:
            try:
                return self._in_slices(self._encode_slice_arrays, texts)
            except BaseException as error:
                _raise_unless_tiktoken_gave_up(error)
        return [np.asarray(ids, dtype=np.int32) for ids in self._hf_encode_batch(texts)]

    def _hf_encode_batch(self, texts: list[str]) -> list[list[int]]:
        """HF tokenizers' ids: the backend without tiktoken, and tiktoken's fallback for a batch it
        gives up on (the same ids, so only that batch is slower)."""
        return [encoding.ids for encoding in self._hf.encode_batch_fast(texts, add_special_tokens=False)]

    def _in_slices(self, encode_slice: Callable[[list[str]], list], texts: list[str]) -> list:
        """Each of ``num_threads`` long-lived threads encodes one contiguous slice (tiktoken releases
        the GIL). tiktoken's own ``encode_ordinary_batch`` is slower: it starts a pool per call and a
        future per text."""
        if self.num_threads < 2 or len(texts) < 2 * self.num_threads:
            return encode_slice(texts)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.num_threads, thread_name_prefix="tokenizer")
        size = -(-len(texts) // self.num_threads)
        slices = self._pool.map(encode_slice, (texts[i : i + size] for i in range(0, len(texts), size)))
        return [ids for part in slices for ids in part]

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`; special tokens are kept as their literal text."""
        if self._tiktoken is not None:
            return self._tiktoken.decode(list(ids))
        return self._hf.decode(list(ids), skip_special_tokens=False)
