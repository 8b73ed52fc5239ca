"""Experiments: per-issue checks on the real model whose findings are docs/results sections."""
