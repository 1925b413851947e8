"""Benchmark scripts; each writes its figures, with the command, to experiments/results/."""
