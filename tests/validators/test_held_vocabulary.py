"""Record content kept as non-tensor state (validators/held_vocabulary.py): a word vocabulary, a category table, a
fitted encoder or a tokenizer built from the training records, holding an item one record has, kept by the model, its
hparams, the datamodule or a checkpoint — refused before any release (or before the checkpoint is written); public
word lists, vocabularies of common words, class names, configuration strings and the datamodule's own texts are
not."""

from __future__ import annotations

import functools
import os
import re
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from conftest import quiet_trainer
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))
from cases import Classifier, parameters, strategy, unchanged  # noqa: E402

from lightning_dp import PrivacyConfigurationError  # noqa: E402
from lightning_dp.validators.held_vocabulary import vocabulary_held, vocabulary_in  # noqa: E402

RARE = "patient_jane_doe_hiv_positive"
COMMON = [f"w{i}" for i in range(30)]
_rng = np.random.default_rng(0)
TEXTS = [" ".join(_rng.choice(COMMON, 6)) for _ in range(64)]
TEXTS[17] += " " + RARE  # one person's rare token
TEXTS[40] += " gelu"  # a word of one record that is also a configuration string
LABELS = [int("w1" in t.split()) for t in TEXTS]


def built_vocabulary(texts: list[str], min_count: int = 1) -> dict[str, int]:
    counts = Counter(w for t in texts for w in set(t.split()))
    return {w: i + 1 for i, w in enumerate(sorted(w for w, n in counts.items() if n >= min_count))}  # 0: <unk>


class Texts(Dataset):
    def __init__(self, texts: list[str], labels: list[int]) -> None:
        self.texts, self.labels = texts, labels

    def __len__(self) -> int:
        return len(self.texts)

    def __getitem__(self, i: int) -> tuple[str, int]:
        return self.texts[i], self.labels[i]


HASHED = {w: i % 31 + 1 for i, w in enumerate(COMMON + [RARE])}  # what the collate encodes with: public, fixed


def collate(batch: list[tuple[str, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.zeros(len(batch), 8, dtype=torch.long)
    for r, (text, _) in enumerate(batch):
        tokens = [HASHED.get(w, 0) for w in text.split()][:8]
        ids[r, : len(tokens)] = torch.tensor(tokens)
    return ids, torch.tensor([label for _, label in batch])


def text_loader(texts: list[str] = TEXTS) -> DataLoader:
    return DataLoader(Texts(texts, LABELS), batch_size=16, collate_fn=collate)


class BagOfWords(pl.LightningModule):
    """A bag-of-words classifier that keeps its vocabulary with its hyperparameters (the usual habit)."""

    def __init__(self, vocab: Any, **config: Any) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.emb = nn.Embedding(32, 8)
        self.fc = nn.Linear(8, 2)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return nn.functional.cross_entropy(self.fc(self.emb(batch[0]).mean(1)), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1.0)


def test_a_vocabulary_built_from_the_training_texts_kept_by_save_hyperparameters_is_refused_before_any_release():
    model = BagOfWords(built_vocabulary(TEXTS))
    before = parameters(model)
    with pytest.raises(PrivacyConfigurationError, match=rf"(?s)non-tensor state.*hparams\['vocab'\].*{RARE}"):
        quiet_trainer(strategy=strategy(), max_steps=2).fit(model, text_loader())
    assert unchanged(before, model)


def test_a_vocabulary_of_a_basic_tokenizer_over_code_like_lines_is_refused():
    """torchtext's ``basic_english`` splits punctuation off (``call(x)`` → ``call``, ``(``, ``x``, ``)``): its
    vocabulary is found in the records split the same way, not only at whitespace."""
    import re

    texts = [f"{a}({b}) = {c}." for a, b, c in zip(_rng.choice(COMMON, 64), _rng.choice(COMMON, 64),
                                                   _rng.choice(COMMON, 64))]
    texts[9] = f"call({RARE})."
    tokens = Counter(w for t in texts for w in set(re.findall(r"\w+|[^\w\s]", t.lower())))
    model = BagOfWords(["<unk>", *sorted(tokens)])
    with pytest.raises(PrivacyConfigurationError, match=rf"(?s)hparams\['vocab'\].*{RARE}"):
        quiet_trainer(strategy=strategy(), max_steps=2).fit(model, text_loader(texts))


class Zips(Dataset):
    """A tabular dataset whose category column holds indices into a zip-code table (the strings are not in the
    records: only their ids)."""

    def __init__(self, codes: torch.Tensor) -> None:
        self.codes, self.age = codes, torch.randn(len(codes), 1, generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.codes)

    def __getitem__(self, i: int) -> Any:
        return (self.codes[i], self.age[i]), int(self.codes[i]) % 2


ZIPS = [f"9{4000 + i % 10}" for i in range(63)] + ["10001"]  # one record from a zip code nobody else has


class ZipNet(pl.LightningModule):
    def __init__(self, table: dict[str, int]) -> None:
        super().__init__()
        self.zip_table = table  # kept to encode at inference; pickled with the module
        torch.manual_seed(0)
        self.emb, self.fc = nn.Embedding(len(table) + 5, 4), nn.Linear(4, 2)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (codes, age), y = batch
        return nn.functional.cross_entropy(self.fc(self.emb(codes) + age), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1.0)


def test_a_category_table_built_from_a_training_column_is_refused_through_the_ids_the_records_hold():
    table = {z: i for i, z in enumerate(sorted(set(ZIPS)))}
    codes = torch.tensor([table[z] for z in ZIPS])
    model = ZipNet(table)
    with pytest.raises(PrivacyConfigurationError, match=r"(?s)zip_table \(11 items.*'10001'"):
        quiet_trainer(strategy=strategy(), max_steps=2).fit(model, DataLoader(Zips(codes), batch_size=16))
    public = {z: i for i, z in enumerate([f"9{4000 + i}" for i in range(10)] + ["10001"])}  # a fixed public list
    public_codes = torch.tensor([public[z] for z in ZIPS])
    quiet_trainer(strategy=strategy(public_state=["zip_table"]), max_steps=2).fit(
        ZipNet(public), DataLoader(Zips(public_codes), batch_size=16))


class Encoder:
    """A fitted encoder of the scikit-learn kind (its learned attributes end with an underscore)."""

    def __init__(self, classes: list[str]) -> None:
        self.classes_ = np.array(sorted(classes), dtype=object)
        self.categories_ = [np.array(sorted(set(classes)))]


class Tokenizer:
    """A tokenizer trained on the texts (``train_new_from_iterator``), its vocabulary behind ``get_vocab()``."""

    def __init__(self, vocab: dict[str, int]) -> None:
        self._vocab = tuple(vocab.items())

    def get_vocab(self) -> dict[str, int]:
        return dict(self._vocab)

    def __call__(self, text: str) -> list[int]:
        return [self.get_vocab().get(w, 0) for w in text.split()]


class WordSplitter:
    """A tokenizer of the user's own: callable, its vocabulary an attribute."""

    def __init__(self, vocab: dict[str, int]) -> None:
        self.vocab = vocab

    def __call__(self, text: str) -> list[int]:
        return [self.vocab.get(w, 0) for w in text.split()]


@pytest.mark.parametrize("where, held", [
    ("splitter.vocab", lambda m: setattr(m, "splitter", WordSplitter(built_vocabulary(TEXTS)))),
    ("encoder.classes_", lambda m: setattr(m, "encoder", Encoder(sorted(set(" ".join(TEXTS).split()))))),
    ("encoder.categories_[0]", lambda m: setattr(m, "encoder", Encoder(sorted(set(" ".join(TEXTS).split()))))),
    ("tokenizer.get_vocab()", lambda m: setattr(m, "tokenizer", Tokenizer(built_vocabulary(TEXTS)))),
    ("itos", lambda m: setattr(m, "itos", ["<unk>", *built_vocabulary(TEXTS)])),
    ("net.0.words", lambda m: setattr(m.net[0], "words", set(built_vocabulary(TEXTS)))),
])
def test_encoders_tokenizers_and_word_lists_built_from_the_records_are_found_where_the_model_keeps_them(where, held):
    model = Classifier()
    held(model)
    found = vocabulary_held([("model", model)], Texts(TEXTS, LABELS))
    assert any(f.startswith(where + " ") and RARE in f for f in found), found


def test_scikit_learn_encoders_fitted_on_the_records_are_found():
    preprocessing = pytest.importorskip("sklearn.preprocessing")
    words = " ".join(TEXTS).split()
    model = Classifier()
    model.labels = preprocessing.LabelEncoder().fit(words)
    model.one_hot = preprocessing.OneHotEncoder().fit(np.array(words)[:, None])
    found = vocabulary_held([("model", model)], Texts(TEXTS, LABELS))
    assert [f.split(" ")[0] for f in found] == ["labels.classes_", "one_hot.categories_[0]"], found
    assert all(RARE in f for f in found)


class TextData(pl.LightningDataModule):
    def __init__(self, vocab: Any = None) -> None:
        super().__init__()
        self.texts, self.vocab = list(TEXTS), vocab  # the datamodule's own copy of the training texts

    def train_dataloader(self) -> DataLoader:
        return text_loader(self.texts)


def test_a_vocabulary_the_datamodule_builds_is_refused_and_the_texts_it_holds_are_not():
    with pytest.raises(PrivacyConfigurationError, match=rf"(?s)datamodule.vocab .*{RARE}"):
        quiet_trainer(strategy=strategy(), max_steps=2).fit(
            BagOfWords(None), datamodule=TextData(built_vocabulary(TEXTS)))
    quiet_trainer(strategy=strategy(), max_steps=2).fit(BagOfWords(None), datamodule=TextData())  # its data


class SavesVocabulary(BagOfWords):
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["vocab"] = built_vocabulary(TEXTS)  # built when saved: not held before training


def test_a_vocabulary_added_to_a_checkpoint_is_refused_and_nothing_is_written(tmp_path):
    callback = pl.callbacks.ModelCheckpoint(dirpath=tmp_path)
    with pytest.raises(PrivacyConfigurationError, match=rf"(?s)in the checkpoint.*checkpoint\['vocab'\].*{RARE}"):
        quiet_trainer(strategy=strategy(), max_steps=2, enable_checkpointing=True, callbacks=[callback]).fit(
            SavesVocabulary(None), text_loader())
    assert not os.listdir(tmp_path)
    assert vocabulary_in({"state_dict": {}, "vocab": built_vocabulary(TEXTS)}, Texts(TEXTS, LABELS))
    assert not vocabulary_in({"vocab": built_vocabulary(TEXTS)}, Texts(TEXTS, LABELS), ["vocab"])


PUBLIC_WORDS = [*COMMON, RARE, *(f"english_word_{i}" for i in range(200))]  # mostly words the data does not have


@pytest.mark.parametrize("vocab", [
    {w: i for i, w in enumerate(PUBLIC_WORDS)},  # a public word list that happens to hold the rare word
    built_vocabulary(TEXTS, min_count=2),  # common words only
    {"optimizer": "adam", "layers": ["relu", "gelu", "tanh", "sigmoid", "w3", "silu", "elu", "mish"], "lr": 0.1},
])
def test_public_word_lists_common_words_and_configuration_strings_train(vocab):
    model = BagOfWords(vocab, mode="sum", act="gelu", acts=("gelu", "w2"))  # configuration strings the data has
    quiet_trainer(strategy=strategy(), max_steps=2).fit(model, text_loader())


def test_class_names_and_a_declared_public_vocabulary_are_not_refused():
    names = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
    x = torch.randn(200, 4, generator=torch.Generator().manual_seed(0))
    y = torch.arange(200) % 10  # each class in many records
    model = Classifier()
    model.classes, model.index = names, {n: i for i, n in enumerate(names)}
    assert vocabulary_held([("model", model)], TensorDataset(x, y)) == []
    one = y.clone()
    one[one == 0] = 9
    one[0] = 0  # class 0 in one record only: a class list encoding it is refused (a label encoder fitted on y)
    assert any("classes" in f and "'airplane'" in f for f in vocabulary_held([("model", model)], TensorDataset(x, one)))
    assert vocabulary_held([("model", model)], TensorDataset(x, one), ["classes", "index"]) == []
    vocab = BagOfWords(built_vocabulary(TEXTS))
    assert vocabulary_held([("model", vocab)], Texts(TEXTS, LABELS), ["vocab"]) == []


def test_a_training_set_too_large_to_read_is_skipped_with_a_warning(monkeypatch):
    import lightning_dp.validators.held_vocabulary as held

    monkeypatch.setattr(held, "MAX_RECORDS", 10)
    with pytest.warns(UserWarning, match="not compared with the training records"):
        assert vocabulary_held([("model", BagOfWords(built_vocabulary(TEXTS)))], Texts(list(TEXTS), LABELS)) == []


def encode(vocab: dict[str, int], batch: list[tuple[str, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Ids of each text's first 8 words in ``vocab`` (folded into the 32 embedding rows), and the labels."""
    ids = torch.zeros(len(batch), 8, dtype=torch.long)
    for r, (text, _) in enumerate(batch):
        tokens = [vocab.get(w, 0) % 32 for w in text.split()][:8]
        ids[r, : len(tokens)] = torch.tensor(tokens)
    return ids, torch.tensor([label for _, label in batch])


class Collator:
    """A collator holding the word table it encodes with (Hugging Face's habit: ``DataCollator(tokenizer)``), and
    the training texts (a lookup of its own: the data, not a vocabulary)."""

    def __init__(self, vocab: dict[str, int]) -> None:
        self.vocab, self.texts = vocab, list(TEXTS)

    def __call__(self, batch: list[tuple[str, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        return encode(self.vocab, batch)


def closure(vocab: dict[str, int]) -> Any:
    def collate_words(batch: list[tuple[str, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        return encode(vocab, batch)
    return collate_words


def in_worker_init(vocab: dict[str, int]) -> dict[str, Any]:
    return {"collate_fn": collate, "worker_init_fn": functools.partial(init_worker, vocab)}


def init_worker(vocab: dict[str, int], worker_id: int) -> None:
    """A worker's start (never called here: no workers)."""


@pytest.mark.parametrize("where, loader_kwargs", [
    ("loader.collate_fn.vocab", lambda v: {"collate_fn": Collator(v)}),
    ("loader.collate_fn.args[0]", lambda v: {"collate_fn": functools.partial(encode, v)}),
    ("loader.collate_fn.<vocab>", lambda v: {"collate_fn": closure(v)}),
    ("loader.collate_fn.__self__.vocab", lambda v: {"collate_fn": Collator(v).__call__}),
    ("loader.worker_init_fn.args[0]", in_worker_init),
])
def test_a_vocabulary_built_from_the_records_held_by_what_the_training_loader_holds_is_refused(where, loader_kwargs):
    model = BagOfWords(None)
    before = parameters(model)
    loader = DataLoader(Texts(TEXTS, LABELS), batch_size=16, **loader_kwargs(built_vocabulary(TEXTS)))
    with pytest.raises(PrivacyConfigurationError,
                       match=rf"(?s)non-tensor state.*{re.escape(where)} .*{RARE}.*held by the training loader"):
        quiet_trainer(strategy=strategy(), max_steps=2).fit(model, loader)
    assert unchanged(before, model)


def test_a_public_vocabulary_and_the_training_texts_held_by_the_collate_function_are_not_refused():
    public = {w: i for i, w in enumerate(PUBLIC_WORDS)}  # holds the rare word, but mostly words the data lacks
    loader = DataLoader(Texts(TEXTS, LABELS), batch_size=16, collate_fn=Collator(public))
    quiet_trainer(strategy=strategy(), max_steps=2).fit(BagOfWords(None), loader)
    loader = DataLoader(Texts(TEXTS, LABELS), batch_size=16, collate_fn=Collator(built_vocabulary(TEXTS)))
    quiet_trainer(strategy=strategy(public_state=["vocab"]), max_steps=2).fit(BagOfWords(None), loader)  # declared
