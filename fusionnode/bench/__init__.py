"""Benchmarks a user can run: `fusionnode bench <name>`."""
