"""A step that compiles in seconds, as ``jaxmoe train`` flags: the one-layer model of
tests/train/runs.py (one MoE layer, short sequences, few tokens, 200 kB of text)."""

from tests.train.runs import ONE_LAYER

SMALL = list(ONE_LAYER)
