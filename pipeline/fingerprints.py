"""Digests that say whether two runs may be compared: the same initial weights, the same training
tokens update by update, the same validation set.

Each digest is defined on what the run computes with, in one canonical form, so that it comes out
the same whatever the precision, the device or the number of ranks:

- initial weights: SHA-256 over the state dict the export writes (its family's Hugging Face key names
  in sorted order, fp32, little-endian), taken before the first update;
- the tokens of an update: the sum of a 40-bit BLAKE2b digest of each of its rows (its tokens and
  the offsets where its documents start, int32). A sum does not depend on the order of the rows or
  on which rank trained which row, and it can be added up over ranks in the all-reduce a run
  already does; the run's training tokens are then a SHA-256 chain over its updates' values, in
  update order;
- a validation set: SHA-256 over its documents' token ids (int32, each after its length), in order;
- a file (the tokenizer, each file of the code that ran): SHA-256 of its bytes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path

import numpy as np

ROW_DIGEST_BITS = 40  # a sum of thousands of these stays below 2**63 (an int64 all-reduce) and below 2**53
_ROW_DIGEST_BYTES = ROW_DIGEST_BITS // 8
DIGEST_MODULUS = 1 << 63  # sums of update digests (merged history rows) are taken modulo this, to stay an int64
TOKENS_CHAIN_START = hashlib.sha256(b"runfab training tokens").hexdigest()


def sha256_file(path: Path) -> str:
    """SHA-256 of the bytes of the file at ``path``, read a MiB at a time."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def row_digest(tokens: np.ndarray, positions: np.ndarray) -> int:
    """A packed row's 40-bit digest: its tokens and where its documents start (positions 0)."""
    digest = hashlib.blake2b(digest_size=_ROW_DIGEST_BYTES)
    digest.update(np.ascontiguousarray(tokens, dtype="<i4").tobytes())
    digest.update(np.flatnonzero(np.asarray(positions) == 0).astype("<i4").tobytes())
    return int.from_bytes(digest.digest(), "little")


def rows_digest(tokens: np.ndarray, positions: np.ndarray) -> int:
    """The sum of the row digests of a [rows, seq_len] batch."""
    return sum(row_digest(t, p) for t, p in zip(tokens, positions))


def chain(previous: str, update_value: int) -> str:
    """The training-tokens chain after one more update whose rows sum to ``update_value``."""
    return hashlib.sha256(bytes.fromhex(previous) + int(update_value).to_bytes(8, "little")).hexdigest()


def tokens_chain(update_values: Iterable[int], start: str = TOKENS_CHAIN_START) -> str:
    for value in update_values:
        start = chain(start, value)
    return start


def weights_digest(state: dict) -> str:
    """SHA-256 of a state dict in canonical form: sorted names, fp32 little-endian values."""
    import torch

    digest = hashlib.sha256()
    for name in sorted(state):
        tensor = state[name].detach().to(device="cpu", dtype=torch.float32).contiguous()
        digest.update(name.encode() + b"\0" + str(list(tensor.shape)).encode() + b"\0")
        digest.update(tensor.numpy().astype("<f4", copy=False).tobytes())
    return digest.hexdigest()


class ValidationDigest:
    """The digest of a validation set, built a document (with its EOS) at a time."""

    def __init__(self) -> None:
        self._sha = hashlib.sha256()
        self.documents = self.tokens = 0

    def update(self, doc: np.ndarray) -> None:
        ids = np.ascontiguousarray(doc, dtype="<i4")
        self._sha.update(len(ids).to_bytes(8, "little"))
        self._sha.update(ids.tobytes())
        self.documents += 1
        self.tokens += len(ids)

    def result(self) -> dict:
        return {"sha256": self._sha.hexdigest(), "documents": self.documents, "tokens": self.tokens}


def validation_digest(documents: Iterable[np.ndarray]) -> dict:
    """Digest, document count and token count of a validation set (documents with their EOS)."""
    digest = ValidationDigest()
    for doc in documents:
        digest.update(doc)
    return digest.result()
