"""The run's corpora mixed by weight into one global sequence of examples, with Grain.

Each corpus of ``data.sources`` (or the default corpus) is split into a training head
and a validation tail (:class:`~jaxmoe.data.batches.TokenSplits`). A split's examples
are its windows (:class:`~jaxmoe.data.batches.TokenWindows`) as a Grain ``MapDataset``,
shuffled (a new order each pass, from the seed, the split and the corpus's place) and
repeated without end; ``MapDataset.mix`` interleaves the corpora by their weights. Grain
realises the weights as integers, the smallest scaled to 100, and its interleave is
deterministic: of every ``sum`` consecutive examples, each corpus gives exactly its
integer share (weights 3 and 1: 300 and 100, corpus 0, 0, 0, 1, 0, 0, 0, 1, ...; 0.7 and
0.3: 233 and 100, 69.97%). Example ``i`` of the sequence is therefore a pure function of
``i`` and the seed, read at random access: what lets each process read only its own rows
(:mod:`jaxmoe.data.host_batches`) and a run resume at any example in any layout.

The validation examples are the validation splits mixed by the same weights, and the
validation loss is the mean over the first ``train.eval_batches`` batches of them: the
same rows at every evaluation, in the mixture's proportions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grain
import numpy as np

from jaxmoe.config import Config, ConfigError
from jaxmoe.config.data import DataSource
from jaxmoe.data.batches import BatchSampler, TokenSplits, TokenWindows, load_corpus

# A split's place in the seeds of its shuffles.
SPLITS = ("train", "val")


def _shuffle_seed(seed: int, split: str, corpus: int) -> int:
    """The shuffle's seed of a corpus's split: 32 bits, as Grain takes them (it adds the
    pass to it)."""
    entropy = (seed, SPLITS.index(split), corpus)
    return int(np.random.SeedSequence(entropy).generate_state(1)[0])


@dataclass(frozen=True)
class Mixture:
    """The corpora of a run, each split, and their weights."""

    corpora: tuple[TokenSplits, ...]
    weights: tuple[float, ...]

    @property
    def eod_id(self) -> int | None:
        """The corpora's end-of-document id (they share one), None when they have none."""
        return self.corpora[0].eod_id

    def examples(self, split: str, seq_len: int, seed: int) -> grain.MapDataset:
        """The global sequence of examples of ``split`` (``"train"`` or ``"val"``)."""
        parts = [getattr(corpus, split) for corpus in self.corpora]
        return mixed_examples(parts, self.weights, seq_len, seed, split)


def mixed_examples(
    parts: Sequence[np.ndarray],
    weights: Sequence[float],
    seq_len: int,
    seed: int,
    split: str = "train",
) -> grain.MapDataset:
    """The examples of the token arrays ``parts`` mixed by ``weights``: index -> int32
    ``[seq_len + 1]``, without end (see the module docstring)."""
    shuffled = [
        grain.MapDataset.source(TokenWindows(tokens, seq_len))
        .shuffle(seed=_shuffle_seed(seed, split, index))
        .repeat()
        for index, tokens in enumerate(parts)
    ]
    return grain.MapDataset.mix(shuffled, weights)


def _tokenization(source: DataSource | None, corpus: TokenSplits) -> str:
    """What a corpus's ids are, as far as its files say: a mixture's corpora agree."""
    if corpus.info is not None:
        eod = "none" if corpus.eod_id is None else corpus.eod_id
        return f"the ids of a tokenizer of {corpus.info.vocab_size} (end of document {eod})"
    if source is None or not source.path.lower().endswith(".bin"):
        return "bytes"
    return "ids without a sidecar"


def load_mixture(config: Config) -> Mixture:
    """The corpora of ``config``, each split, checked against the model.

    Raises ConfigError for a file that cannot be read, a malformed ``.bin`` or sidecar,
    too little data for one sequence in either split of a corpus, a token id (or, with a
    sidecar, a tokenizer's vocabulary) the model cannot embed, corpora tokenized
    differently, the same file given twice, or ``data.mask_across_documents`` without an
    end-of-document id.
    """
    data, vocab, seq_len = config.data, config.model.vocab_size, config.model.seq_len
    sources: tuple[DataSource | None, ...] = data.sources or (None,)
    corpora, files = [], {}
    for source in sources:
        path = None if source is None else source.path
        corpus = load_corpus(path, data.max_bytes)
        if path is not None:
            same = files.setdefault(_file_identity(path), path)
            if same != path:
                raise ConfigError(
                    f"data.sources: {path!r} and {same!r} are the same file: give each corpus "
                    "once, with the sum of its weights"
                )
        splits = TokenSplits(corpus.tokens, data.val_fraction, seq_len, corpus.info, path)
        _check_vocabulary(splits, path, vocab)
        corpora.append(splits)
    kinds = [_tokenization(source, corpus) for source, corpus in zip(sources, corpora, strict=True)]
    for source, kind in zip(sources[1:], kinds[1:], strict=True):
        if kind != kinds[0]:
            raise ConfigError(
                f"data.sources: {sources[0].path!r} holds {kinds[0]}, but {source.path!r} "
                f"holds {kind}: a mixture's corpora share one tokenizer (make them with the "
                "same jaxmoe data --tokenizer)"
            )
    mixture = Mixture(tuple(corpora), tuple(s.weight if s else 1.0 for s in sources))
    if data.mask_across_documents and mixture.eod_id is None:
        raise ConfigError(
            f"data.mask_across_documents=True, but {data.first_path!r} has no "
            "end-of-document id (only a .bin with the sidecar that `jaxmoe data` writes has "
            "one): make the corpus with jaxmoe data, or leave the flag out"
        )
    return mixture


def _file_identity(path: str) -> tuple[int, int]:
    """What tells two names of one file from two files."""
    stat = Path(path).stat()
    return (stat.st_dev, stat.st_ino)


def _check_vocabulary(splits: TokenSplits, path: str | None, vocab: int) -> None:
    """Every id of the corpus inside ``model.vocab_size``: the sidecar's vocabulary bounds
    them without a scan."""
    if splits.info is not None:
        if splits.info.vocab_size > vocab:
            raise ConfigError(
                f"model.vocab_size={vocab}, but the tokenizer of {path!r} has "
                f"{splits.info.vocab_size} tokens: use --model.vocab_size "
                f"{splits.info.vocab_size} or more"
            )
    elif splits.max_token_id >= vocab:
        held = "the data holds" if path is None else f"{path!r} holds"
        raise ConfigError(
            f"model.vocab_size={vocab}, but {held} token id "
            f"{splits.max_token_id}: use a vocabulary of at least {splits.max_token_id + 1}"
        )


def run_batches(config: Config, mixture: Mixture) -> tuple[BatchSampler, BatchSampler]:
    """The run's training and validation batches."""
    seq_len, batch, seed = config.model.seq_len, config.train.batch_size, config.train.seed
    return (
        BatchSampler(mixture.examples("train", seq_len, seed), seq_len, batch),
        BatchSampler(mixture.examples("val", seq_len, seed), seq_len, batch),
    )


def corpus_batches(
    tokens: np.ndarray, seq_len: int, global_batch: int, seed: int = 0
) -> BatchSampler:
    """The batches of one array of token ids (a mixture of one corpus)."""
    return BatchSampler(mixed_examples([tokens], [1.0], seq_len, seed), seq_len, global_batch)
