"""Token corpora: the files ``jaxmoe data`` writes, the document structure of a batch, and
a run's input.

- :mod:`jaxmoe.data.corpus`: ``NAME.bin`` (little-endian token ids) and its sidecar
  ``NAME.json`` (dtype, vocabulary, end-of-document id, tokenizer, counts); no JAX.
- :mod:`jaxmoe.data.sources`: documents read from text, JSON lines and Parquet files.
- :mod:`jaxmoe.data.build`: a Hugging Face ``tokenizers`` tokenizer (given or trained on
  the inputs) and the corpus written with it.
- :mod:`jaxmoe.data.documents`: from a batch of token rows and the end-of-document id,
  the loss mask, segment ids and per-document positions (JAX, pure).
- :mod:`jaxmoe.data.batches`: a corpus, its train/validation split, its sequences (a
  random-access source), global batches and their rows on the mesh.
- :mod:`jaxmoe.data.mixture`: the run's corpora mixed by weight into one global sequence
  of examples, with Grain.
- :mod:`jaxmoe.data.host_batches`: one process's rows of each step's batch, read ahead
  by Grain's threads, and the data position a checkpoint keeps.

Importing this package imports none of them.
"""
