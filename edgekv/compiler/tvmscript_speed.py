"""TVMScript macro expansion without a source lookup per stack frame.

Each ``T.macro`` call in a kernel body (every edgekv kernel body is one; ``kernels/signature.py``)
finds the parser that is expanding it by walking up the Python stack to the frame whose globals
hold ``__current_script_parser__``. TVM 0.27 walks it with ``inspect.getouterframes``, which reads
every frame's source line and looks up its module by scanning ``sys.modules`` (thousands of
modules once torch and transformers are loaded): about half of a tiny model's compile at new
shapes went there, and more under pytest's deep stacks. ``install`` replaces that lookup with the
same walk over ``frame.f_back`` reading only ``f_globals`` — the same parser found, so the same
PrimFunc (tests/test_tvmscript_speed.py compiles with and without it and compares the bytes).
It patches only the version whose lookup it has read (the method's code names getouterframes)."""

from __future__ import annotations

import sys

from tvm.script.parser.core.parser import ScriptMacro

_ORIGINAL = ScriptMacro._find_parser_def


def _find_parser_def(self):
    frame = sys._getframe(1)  # the caller: the macro call; this frame's globals never hold a parser
    while frame is not None:
        parser = frame.f_globals.get(ScriptMacro.parser_object_name)
        if parser is not None:
            return parser
        frame = frame.f_back
    raise RuntimeError(f"{ScriptMacro.parser_object_name} not available")


def install() -> bool:
    """Use the frame walk (once per process); False where TVM's lookup is not the one read here."""
    if ScriptMacro._find_parser_def is _find_parser_def:
        return True
    if "getouterframes" not in getattr(_ORIGINAL, "__code__", None).co_names:
        return False
    ScriptMacro._find_parser_def = _find_parser_def
    return True


def uninstall() -> None:
    """TVM's own lookup back (the byte-equality test compares the two)."""
    ScriptMacro._find_parser_def = _ORIGINAL
