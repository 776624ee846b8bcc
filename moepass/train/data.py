"""The training corpus: Python's own documentation text, byte-level, packed, in global batches by rank.

The corpus is `pydoc_data.topics` (the Python Language Reference sections `help()` prints: ~465 KB of
English prose with code examples; part of the standard library of every CPython, so no download). Its
topics are joined in sorted order with blank lines between them and encoded as UTF-8 bytes: token ids are
bytes (vocabulary 256). The byte stream is packed into non-overlapping sequences of `seq + 1` tokens (an
input of `seq` and its next-token targets), the last partial one dropped.

Batches: each epoch visits every sequence once in an order drawn from `seed` and the epoch number; the
global batch of step s (counted from 0) is the next `global_batch` sequences of that order, and rank r of
W takes rows [r·b, (r+1)·b), b = global_batch / W. So the data position is the step alone, and a run with
another world size (same global batch) sees the same global batches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

VOCAB = 256


def corpus_text() -> str:
    """The corpus (see module doc)."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in sorted(topics))


def corpus_tokens() -> torch.Tensor:
    """The corpus as int64 byte ids, [N]."""
    data = bytearray(corpus_text().encode("utf-8"))
    return torch.frombuffer(data, dtype=torch.uint8).to(torch.int64)


@dataclass
class Batches:
    """Global batches of packed sequences (see module doc). `sequences_NS1`: [N, seq + 1] token ids."""

    sequences_NS1: torch.Tensor
    global_batch: int
    seed: int

    @classmethod
    def from_corpus(cls, seq: int, global_batch: int, seed: int) -> Batches:
        tokens = corpus_tokens()
        n = tokens.numel() // (seq + 1)
        if n < global_batch:
            raise ValueError(f"seq={seq}, global_batch={global_batch}: the corpus ({tokens.numel()} bytes) holds "
                             f"only {n} sequences of {seq + 1} tokens; use a smaller seq or global batch")
        return cls(tokens[:n * (seq + 1)].view(n, seq + 1), global_batch, seed)

    @property
    def steps_per_epoch(self) -> int:
        return self.sequences_NS1.shape[0] // self.global_batch

    def rows_at(self, step: int) -> torch.Tensor:
        """[global_batch] indices of the sequences of step `step` (0-based)."""
        epoch, index = divmod(step, self.steps_per_epoch)
        order = torch.randperm(self.sequences_NS1.shape[0], generator=torch.Generator().manual_seed(
            self.seed * 1_000_003 + epoch))
        return order[index * self.global_batch:(index + 1) * self.global_batch]

    def global_batch_at(self, step: int) -> torch.Tensor:
        """[global_batch, seq + 1] token ids of step `step` (0-based), on the CPU."""
        return self.sequences_NS1[self.rows_at(step)]

    def rank_batch(self, step: int, rank: int, world: int) -> torch.Tensor:
        """Rank `rank`'s rows of step `step`'s global batch, [global_batch / world, seq + 1]."""
        if self.global_batch % world:
            raise ValueError(f"global_batch={self.global_batch} must be a multiple of the world size {world}")
        b = self.global_batch // world
        return self.global_batch_at(step)[rank * b:(rank + 1) * b]
