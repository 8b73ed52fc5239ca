"""Lowers javac's Java 8 class files to Java 7 (version 51) for the dexer, after checking that
they use nothing of Java 8: android/build.sh.

Why: the dexer here is dx 1.11 (the only one reachable: Debian has no dx/d8), which reads class
files up to version 51 (Java 7). javac 20 and later cannot write version 51 (`--release 7` is
gone), while `--release 8` works from JDK 9 to 25. A Java 8 class file differs from a Java 7 one
only by what Java 8 added: lambdas and method references (invokedynamic and its constants),
default and static interface methods, and metadata attributes that dx skips. So each class is checked for those
(refused, naming the class) and then its version is set to 51. Sources stay at the Java 7 subset;
a lambda in the app fails the build here with the reason.

    python3 android/retarget_classes.py CLASSES_DIR
"""

from __future__ import annotations

import struct
import sys
from pathlib import Path

JAVA7 = 51
JAVA8 = 52
# constant pool tags: size in bytes after the tag (Utf8 is variable)
FIXED = {3: 4, 4: 4, 5: 8, 6: 8, 7: 2, 8: 2, 9: 4, 10: 4, 11: 4, 12: 4}
JAVA8_TAGS = {15: "a method handle (lambda or method reference)", 16: "a method type (lambda)",
              17: "a dynamic constant", 18: "invokedynamic (a lambda or method reference)",
              19: "a module", 20: "a package"}
# Attributes that only Java 8 code needs. Not MethodParameters (parameter names, which javac 21 and
# later write for inner classes' constructors) nor type annotations: metadata that dx skips, as the
# JVM spec lets a reader skip any attribute it does not know.
JAVA8_ATTRIBUTES = {"BootstrapMethods"}
ACC_INTERFACE, ACC_ABSTRACT = 0x0200, 0x0400


def retarget(data: bytes, where: str) -> bytes:
    magic, minor, major = struct.unpack_from(">IHH", data, 0)
    if magic != 0xCAFEBABE:
        raise ValueError(f"{where}: not a class file")
    if major == JAVA7:
        return data
    if major != JAVA8:
        raise ValueError(f"{where}: class file version {major}; compile with --release 8")
    count = struct.unpack_from(">H", data, 8)[0]
    pos, i, utf8 = 10, 1, {}
    while i < count:
        tag = data[pos]
        if tag == 1:
            n = struct.unpack_from(">H", data, pos + 1)[0]
            utf8[i] = data[pos + 3:pos + 3 + n].decode("utf-8", errors="replace")
            pos += 3 + n
        elif tag in FIXED:
            pos += 1 + FIXED[tag]
        elif tag in JAVA8_TAGS:
            raise ValueError(f"{where} uses {JAVA8_TAGS[tag]}, which the dexer (dx 1.11, Java 7) cannot read: "
                             "write it without lambdas or method references (an anonymous class)")
        else:
            raise ValueError(f"{where}: unknown constant pool tag {tag}")
        i += 2 if tag in (5, 6) else 1
    access = struct.unpack_from(">H", data, pos)[0]
    pos += 6
    pos += 2 + 2 * struct.unpack_from(">H", data, pos)[0]

    def attributes(p: int, owner: str) -> int:
        n = struct.unpack_from(">H", data, p)[0]
        p += 2
        for _ in range(n):
            name_index, length = struct.unpack_from(">HI", data, p)
            if utf8.get(name_index) in JAVA8_ATTRIBUTES:
                raise ValueError(f"{where}: {owner} has a {utf8[name_index]} attribute (Java 8), which dx 1.11 "
                                 "cannot read")
            p += 6 + length
        return p

    for kind in ("field", "method"):
        n = struct.unpack_from(">H", data, pos)[0]
        pos += 2
        for _ in range(n):
            flags, name_index = struct.unpack_from(">HH", data, pos)
            name = utf8.get(name_index, "?")
            if kind == "method" and access & ACC_INTERFACE and not flags & ACC_ABSTRACT and name != "<clinit>":
                raise ValueError(f"{where}: interface method {name} has a body (a Java 8 default or static interface "
                                 "method), which needs a newer dexer and API 24's desugaring: move it to a class")
            pos = attributes(pos + 6, f"{kind} {name}")
    if attributes(pos, "the class") != len(data):
        raise ValueError(f"{where}: could not be parsed to its end")
    return data[:6] + struct.pack(">H", JAVA7) + data[8:]


def main(argv: list[str]) -> int:
    root = Path(argv[0])
    bad = []
    for f in sorted(root.rglob("*.class")):
        try:
            f.write_bytes(retarget(f.read_bytes(), str(f.relative_to(root))))
        except ValueError as exc:
            bad.append(str(exc))
    for b in bad:
        print(f"android/retarget_classes.py: {b}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
