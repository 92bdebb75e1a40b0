"""Next-token windows over English text that ships with Python: ``pydoc_data.topics``.

The topics are the help pages ``help("if")``, ``help("with")``, ... (about 0.47 M
characters of technical English, the exact text depends on the Python version). Nothing
is downloaded. Used by the transformer experiment of issue 9 (design-principles §5.2 on
data we can ship; see ``examples/transformer_variants.py``).
"""

from __future__ import annotations

from typing import Literal, Optional

import pytorch_lightning as pl
import torch
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset

Level = Literal["byte", "char"]


def pydoc_text() -> str:
    """All of ``pydoc_data.topics.topics``, pages joined in sorted-key order (deterministic)."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


def encode(text: str, level: Level, alphabet: Optional[str] = None) -> Tensor:
    """Token ids of ``text``: UTF-8 bytes (vocabulary 256) or indices into ``alphabet`` (chars)."""
    if level == "byte":
        return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)
    if level == "char":
        if alphabet is None:
            raise ValueError("level='char' needs the alphabet (e.g. ''.join(sorted(set(text)))).")
        index = {c: i for i, c in enumerate(alphabet)}
        missing = sorted(set(text) - set(index))
        if missing:
            raise ValueError(f"characters {missing[:10]} are not in the alphabet; build it from the whole text.")
        return torch.tensor([index[c] for c in text], dtype=torch.long)
    raise ValueError(f"level must be 'byte' or 'char', got {level!r}.")


def windows(tokens: Tensor, seq_len: int) -> TensorDataset:
    """Non-overlapping next-token windows: inputs ``tokens[k:k+T]``, targets ``tokens[k+1:k+T+1]``.

    Each window is one example (one unit of privacy); windows do not share tokens as
    inputs, so an example is a disjoint chunk of the text.
    """
    count = (tokens.numel() - 1) // seq_len
    if count < 1:
        raise ValueError(f"the text ({tokens.numel()} tokens) is shorter than one window of {seq_len} + 1 tokens.")
    x = tokens[: count * seq_len].view(count, seq_len)
    y = tokens[1 : count * seq_len + 1].view(count, seq_len)
    return TensorDataset(x.contiguous(), y.contiguous())


class PydocTextDataModule(pl.LightningDataModule):
    """Next-token prediction on the ``pydoc_data`` topics, split into train / validation text.

    The text (see :func:`pydoc_text`) is tokenised at byte or character level and cut at
    ``1 − val_fraction`` of its length: the head gives the training windows, the tail the
    validation windows (a contiguous split, so no window straddles both).

    Args:
        seq_len: tokens per window (the model's context T).
        batch_size: expected (Poisson) batch size per process under DPStrategy.
        level: ``"byte"`` (vocabulary 256) or ``"char"`` (the text's own alphabet, ~100 symbols).
        val_fraction: share of the text held out for validation, in (0, 1).
        max_train_windows: keep only the first this many training windows (``None``: all).
        num_workers: DataLoader workers.
    """

    def __init__(
        self,
        seq_len: int = 64,
        batch_size: int = 64,
        level: Level = "byte",
        val_fraction: float = 0.1,
        max_train_windows: Optional[int] = None,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        if seq_len < 1 or batch_size < 1:
            raise ValueError(f"seq_len and batch_size must be >= 1, got {seq_len} and {batch_size}.")
        if level not in ("byte", "char"):
            raise ValueError(f"level must be 'byte' or 'char', got {level!r}.")
        if not 0 < val_fraction < 1:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}.")
        if max_train_windows is not None and max_train_windows < 1:
            raise ValueError(f"max_train_windows must be >= 1 or None, got {max_train_windows}.")
        self.save_hyperparameters()
        self.seq_len, self.batch_size, self.level = seq_len, batch_size, level
        self.alphabet: Optional[str] = None
        self.train_set: Optional[TensorDataset] = None
        self.val_set: Optional[TensorDataset] = None

    @property
    def vocab_size(self) -> int:
        """256 for bytes; the alphabet's size for characters (known after :meth:`setup`)."""
        if self.level == "byte":
            return 256
        if self.alphabet is None:
            self.setup()
        assert self.alphabet is not None
        return len(self.alphabet)

    def setup(self, stage: Optional[str] = None) -> None:
        """Tokenise and split (idempotent)."""
        if self.train_set is not None:
            return
        text = pydoc_text()
        self.alphabet = "".join(sorted(set(text))) if self.level == "char" else None
        tokens = encode(text, self.level, self.alphabet)
        cut = int(tokens.numel() * (1.0 - self.hparams.val_fraction))
        train = windows(tokens[:cut], self.seq_len)
        if self.hparams.max_train_windows is not None:
            train = TensorDataset(*(t[: self.hparams.max_train_windows] for t in train.tensors))
        self.train_set = train
        self.val_set = windows(tokens[cut:], self.seq_len)

    def decode(self, ids: Tensor) -> str:
        """Text of a 1-D tensor of token ids (bytes decoded with replacement)."""
        values = [int(i) for i in ids.reshape(-1)]
        if self.level == "byte":
            return bytes(values).decode("utf-8", errors="replace")
        if self.alphabet is None:
            self.setup()
        assert self.alphabet is not None
        return "".join(self.alphabet[i] for i in values)

    def train_dataloader(self) -> DataLoader:
        """Training loader (DPStrategy rebuilds it around Poisson sampling)."""
        assert self.train_set is not None, "call setup() first"
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True,
                          num_workers=self.hparams.num_workers)

    def val_dataloader(self) -> DataLoader:
        """Validation windows in order."""
        assert self.val_set is not None, "call setup() first"
        return DataLoader(self.val_set, batch_size=256, num_workers=self.hparams.num_workers)
