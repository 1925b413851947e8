"""Parallelism: the folded layout, the device mesh, sharding rules, the collectives the
layers use, expert placement, gradient synchronisation and multi-host start-up."""
