"""Benchmarks (`make bench`): each prints a table with its target and the ratio to it."""
