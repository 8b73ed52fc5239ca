"""The compiler's own Relax passes, one per file, named by what they do; ``compiler/pipeline.py``
runs them in order. ``attention_sites.py`` (the block-cache pass's matcher), ``int8_cache.py`` and
``pseudo_rows.py`` are parts of ``rewrite_block_cache.py``."""
