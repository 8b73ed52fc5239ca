"""Repository tools (not shipped in the wheel): results generators, benchmarks and experiments.
Run from the repository root against the installed package; tools/README.md lists them."""
