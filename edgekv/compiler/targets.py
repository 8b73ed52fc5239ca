"""``python -m edgekv.compiler.targets finish <artifact dir>``: the finish command that device
artifacts compiled before the compiler moved into stages record in their manifest
(``device.toolchain.finish``) and print when they do not run here. Those artifacts are byte for
byte what today's compiler writes, so they finish the same way: this entry point runs
``backend/finish.py`` (``python -m edgekv.compiler.backend.finish <artifact dir>``), the command
new artifacts name. Nothing imports this module."""

from __future__ import annotations

import sys

from .backend.finish import main

if __name__ == "__main__":
    args = sys.argv[1:]
    raise SystemExit(main(args[1:] if args[:1] == ["finish"] else []))
