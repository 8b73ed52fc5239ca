"""Results generators: rebuild docs sections (RESULTS.md, policies.md, accuracy.md, ...) and the README example."""
