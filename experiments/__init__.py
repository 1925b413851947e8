"""Experiments: the commands that measure jaxmoe, and the instruments they measure on.

Each module at this level is a command, ``python -m experiments.NAME`` from the
repository root, that writes its figures and the command that made them under
``experiments/results/`` (``experiments/README.md`` lists every file). Reusable
pieces live in two packages:

- ``experiments.emulation``: the emulated cluster, hosts in Linux network namespaces
  joined by shaped links, and the programs that run on them;
- ``experiments.shared``: what several commands use, the summaries of repeated
  timings, the results files' kept sections and command lines, and calls into a fresh
  process with a given number of CPU devices.

Not part of the installed package: run from a checkout.
"""
