"""The native runtime's tokenizer (``runtime/src/tokenizer.c``) from Python, through its public C
API: what an app on a phone calls, here for tests and tools.

    tok = NativeTokenizer("artifact/tokenizer.ekt")
    ids = tok.encode("Hello")             # == HF tokenizer("Hello")["input_ids"]
    ids = tok.encode_chat("Hello")        # == apply_chat_template(one user turn, generation prompt)
    text = tok.decode(ids)                # special tokens skipped
    stream = Utf8Stream(); stream.push(tok.token_bytes(i))  # whole characters only

Failures raise ``NativeTokenizerError`` with the C library's message.
"""

from __future__ import annotations

import ctypes
import os

from .native import load_library

_c_size_p = ctypes.POINTER(ctypes.c_size_t)
_c_int32_p = ctypes.POINTER(ctypes.c_int32)


class NativeTokenizerError(RuntimeError):
    """A tokenizer call failed; ``status`` is the ekv_status code, the message is the C one."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


class _Utf8StreamState(ctypes.Structure):
    _fields_ = [("pending", ctypes.c_ubyte * 4), ("n_pending", ctypes.c_int)]


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Declare the tokenizer functions' types (once per library)."""
    if getattr(lib, "_ekv_tokenizer_bound", False):
        return lib
    handle = ctypes.c_void_p
    sigs = {
        "ekv_tokenizer_open": (ctypes.c_int, [ctypes.c_char_p, ctypes.POINTER(handle)]),
        "ekv_tokenizer_open_memory": (ctypes.c_int, [ctypes.c_char_p, ctypes.c_size_t, ctypes.POINTER(handle)]),
        "ekv_tokenizer_free": (None, [handle]),
        "ekv_tokenizer_last_error": (ctypes.c_char_p, [handle]),
        "ekv_tokenizer_encode": (ctypes.c_int, [handle, ctypes.c_char_p, ctypes.c_size_t, _c_int32_p,
                                                ctypes.c_size_t, _c_size_p]),
        "ekv_tokenizer_encode_chat": (ctypes.c_int, [handle, ctypes.c_char_p, ctypes.c_size_t, _c_int32_p,
                                                     ctypes.c_size_t, _c_size_p]),
        "ekv_tokenizer_encode_part": (ctypes.c_int, [handle, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int,
                                                     ctypes.c_int, _c_int32_p, ctypes.c_size_t, _c_size_p]),
        "ekv_tokenizer_has_chat_template": (ctypes.c_int, [handle]),
        "ekv_tokenizer_token_bytes": (ctypes.c_void_p, [handle, ctypes.c_int32, _c_size_p]),
        "ekv_tokenizer_is_special": (ctypes.c_int, [handle, ctypes.c_int32]),
        "ekv_tokenizer_vocab_size": (ctypes.c_int32, [handle]),
        "ekv_tokenizer_stop_ids": (ctypes.c_size_t, [handle, _c_int32_p, ctypes.c_size_t]),
        "ekv_utf8_stream_init": (None, [ctypes.POINTER(_Utf8StreamState)]),
        "ekv_utf8_stream_push": (ctypes.c_size_t, [ctypes.POINTER(_Utf8StreamState), ctypes.c_char_p,
                                                   ctypes.c_size_t, ctypes.c_char_p, ctypes.c_size_t]),
        "ekv_utf8_stream_flush": (ctypes.c_size_t, [ctypes.POINTER(_Utf8StreamState), ctypes.c_char_p,
                                                    ctypes.c_size_t]),
        "ekv_status_string": (ctypes.c_char_p, [ctypes.c_int]),
    }
    for name, (restype, argtypes) in sigs.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    lib._ekv_tokenizer_bound = True
    return lib


class NativeTokenizer:
    """A tokenizer.ekt opened by the native runtime (``path``), or its bytes (``data=``)."""

    def __init__(self, path: str | os.PathLike | None = None, *, data: bytes | None = None,
                 library: str | None = None):
        if (path is None) == (data is None):
            raise ValueError("give a path or data")
        self._lib = _bind(load_library(library))
        self._h = ctypes.c_void_p()
        if path is not None:
            status = self._lib.ekv_tokenizer_open(os.fsencode(path), ctypes.byref(self._h))
        else:
            status = self._lib.ekv_tokenizer_open_memory(data, len(data), ctypes.byref(self._h))
        if status != 0:
            message = self._message(status)
            self.close()
            raise NativeTokenizerError(message, status)
        self.vocab_size = int(self._lib.ekv_tokenizer_vocab_size(self._h))
        self.has_chat_template = bool(self._lib.ekv_tokenizer_has_chat_template(self._h))

    def _message(self, status: int) -> str:
        text = self._lib.ekv_tokenizer_last_error(self._h) if self._h else None
        if text:
            return text.decode("utf-8", "replace")
        return self._lib.ekv_status_string(status).decode()

    def close(self) -> None:
        if getattr(self, "_h", None):
            self._lib.ekv_tokenizer_free(self._h)
            self._h = ctypes.c_void_p()

    def __del__(self):
        self.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _encode(self, fn, text: str | bytes) -> list[int]:
        raw = text if isinstance(text, bytes) else text.encode("utf-8")
        # every id covers at least one byte, so len(raw) ids suffice for plain text; the chat
        # template adds its own, hence the size query when the first buffer is short
        cap = len(raw) + 1024
        for _ in range(2):
            buf = (ctypes.c_int32 * cap)()
            n = ctypes.c_size_t()
            status = fn(self._h, raw, len(raw), buf, cap, ctypes.byref(n))
            if status != 0:
                raise NativeTokenizerError(self._message(status), status)
            if n.value <= cap:
                return buf[:n.value]
            cap = n.value
        raise NativeTokenizerError("encode gave a different length on the second call", 0)

    def encode(self, text: str) -> list[int]:
        """Ids as HF ``tokenizer(text)["input_ids"]`` (added tokens matched, nothing added)."""
        return self._encode(self._lib.ekv_tokenizer_encode, text)

    def encode_bytes(self, raw: bytes) -> list[int]:
        """Ids of raw bytes, which need not be valid UTF-8 (each stray byte is tokenized as
        itself, splitting like U+FFFD)."""
        return self._encode(self._lib.ekv_tokenizer_encode, bytes(raw))

    def encode_chat(self, text: str) -> list[int]:
        """Ids of one user turn with the generation prompt, as ``apply_chat_template``."""
        return self._encode(self._lib.ekv_tokenizer_encode_chat, text)

    def encode_part(self, text: str, *, chat: bool, part: str) -> list[int]:
        """A document ("document") or a question about it ("question") as its own part
        (``edgekv.models.chat``); "whole" is the plain or chat encoding of the text."""
        code = {"whole": 0, "document": 1, "question": 2}[part]
        fn = self._lib.ekv_tokenizer_encode_part
        return self._encode(lambda h, raw, n, buf, cap, out: fn(h, raw, n, int(chat), code, buf, cap, out), text)

    def token_bytes(self, token_id: int) -> bytes:
        n = ctypes.c_size_t()
        ptr = self._lib.ekv_tokenizer_token_bytes(self._h, int(token_id), ctypes.byref(n))
        if not ptr:
            raise KeyError(f"id {token_id} is not in the vocabulary (0..{self.vocab_size - 1})")
        return ctypes.string_at(ptr, n.value)

    def is_special(self, token_id: int) -> bool:
        return bool(self._lib.ekv_tokenizer_is_special(self._h, int(token_id)))

    def decode(self, ids, skip_special: bool = True) -> str:
        """The ids' bytes as text (invalid UTF-8 as U+FFFD), as HF ``decode``."""
        parts = [self.token_bytes(i) for i in ids if not (skip_special and self.is_special(i))]
        return b"".join(parts).decode("utf-8", "replace")

    def stop_ids(self) -> list[int]:
        n = self._lib.ekv_tokenizer_stop_ids(self._h, None, 0)
        buf = (ctypes.c_int32 * max(n, 1))()
        self._lib.ekv_tokenizer_stop_ids(self._h, buf, n)
        return buf[:n]


class Utf8Stream:
    """Bytes in, whole characters out (``ekv_utf8_stream_*``): a character split across tokens
    comes out once complete; invalid bytes come out as U+FFFD, as errors="replace"."""

    def __init__(self, library: str | None = None):
        self._lib = _bind(load_library(library))
        self._state = _Utf8StreamState()
        self._lib.ekv_utf8_stream_init(ctypes.byref(self._state))

    def push(self, data: bytes) -> str:
        cap = 4 * (len(data) + 4)
        out = ctypes.create_string_buffer(cap)
        n = self._lib.ekv_utf8_stream_push(ctypes.byref(self._state), data, len(data), out, cap)
        return out.raw[:n].decode("utf-8")

    def flush(self) -> str:
        out = ctypes.create_string_buffer(16)
        n = self._lib.ekv_utf8_stream_flush(ctypes.byref(self._state), out, 16)
        return out.raw[:n].decode("utf-8")
