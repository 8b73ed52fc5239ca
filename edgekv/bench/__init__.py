"""`edgekv bench`: prefill/decode speed and peak memory of edgekv next to its peers, each
system in its own process (so peak RSS is per run), same prompt tokens, same threads."""
