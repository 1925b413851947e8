"""Choices made before a run: the parallel mapping planner and automatic configuration."""
