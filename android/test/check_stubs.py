"""Check the hand-written framework stubs (android/stubs) against the real Android API.

The app compiles against android/stubs; on the phone its calls bind to the framework by class,
name and full signature (return type included), so a stub that declares a member the framework
lacks, or with other parameter or return types, is a NoSuchMethodError at run time that nothing
here would show. This reads the API's signatures from the type stubs in the PyPI wheel
``chaquopy-stubs-android`` (generated from the Android SDK's android.jar, API 36) and checks, for
every stub class: that the class exists with the stub's superclass among its real ancestors, and
for every public member, that the class or one of its real ancestors declares it with the same
parameter types and a matching return type (constructors on the class itself; constants as
fields). The .pyi files name Java's int and long return types both ``int`` and give no API levels:
what exists at API 36 may be newer than the app's minSdk; check_api_levels.py holds every use in
the compiled app to its level (from @nativescript/types-android) and to the app's SDK_INT guards.

Constants: ``javac`` copies the value of a ``static final`` primitive or String field with a
constant initialiser into the app (the dex then holds ``const``, not a read of the field). That
is right only where the real field is a compile-time constant with that value: ``Build.VERSION.SDK_INT
= 0`` in a stub made every phone report API 0. The .pyi files do not say which fields are
constants, so every stub constant that javac would inline must be listed in DOCUMENTED_CONSTANTS
below with the value the API reference gives ("Constant Value"), and a field the framework sets
at run time (RUNTIME_FIELDS) must never be one: declare it as a blank final (assigned in a static
block), so that the app reads the real field. android.R's ids are checked against framework-res.apk
instead (tests/test_android_app.py).

    python android/test/check_stubs.py PATH_TO_android-stubs      # prints problems; exit 1 if any
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

PRIMITIVE_PARAM = {"int": "java.jint", "long": "java.jlong", "float": "java.jfloat", "double": "java.jdouble",
                   "boolean": "java.jboolean", "short": "java.jshort", "byte": "java.jbyte", "char": "java.jchar"}
PRIMITIVE_RETURN = {"void": "None", "int": "int", "long": "int", "short": "int", "byte": "int", "char": "str",
                    "float": "float", "double": "float", "boolean": "bool"}
JAVA_LANG = {"String", "CharSequence", "Object", "Runnable", "Throwable", "Exception", "Integer", "Long"}


class Api:
    """Classes of the .pyi tree: qualified name -> {"bases": [...], "body": text}."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.classes: dict[str, dict] = {}
        self._loaded: set[str] = set()

    def _load(self, package: str) -> None:
        if package in self._loaded:
            return
        self._loaded.add(package)
        rel = package.split(".")[1:]  # android.widget -> widget
        path = self.root.joinpath(*rel, "__init__.pyi")
        if not path.is_file():
            return
        lines = path.read_text().splitlines()
        stack: list[tuple[int, str]] = []  # (indent, qualified name)
        for i, line in enumerate(lines):
            m = re.match(r"^(\s*)class (\w+)(?:\((.*)\))?:", line)
            if not m:
                continue
            indent = len(m.group(1))
            while stack and stack[-1][0] >= indent:
                stack.pop()
            qual = (stack[-1][1] if stack else package) + "." + m.group(2)
            body = []
            for nxt in lines[i + 1:]:
                if nxt.strip() and len(nxt) - len(nxt.lstrip()) <= indent:
                    break
                if len(nxt) - len(nxt.lstrip()) == indent + 4 or not nxt.strip():
                    body.append(nxt)
            bases = [b.strip() for b in re.split(r",\s*(?![^\[]*\])", m.group(3) or "") if b.strip()]
            self.classes[qual] = {"bases": [self._qualify(b, package, qual) for b in bases],
                                  "body": "\n".join(body), "package": package}
            stack.append((indent, qual))

    @staticmethod
    def _qualify(name: str, package: str, qual: str) -> str:
        name = re.sub(r"\[.*\]$", "", name).strip()
        if name.startswith(("android.", "java.")):
            return name
        if name.startswith("typing."):
            return name
        return package + "." + name

    def get(self, qual: str) -> dict | None:
        parts = qual.split(".")
        for k in range(len(parts) - 1, 0, -1):  # android.app.ActivityManager.MemoryInfo -> package android.app
            self._load(".".join(parts[:k]))
        return self.classes.get(qual)

    def ancestors(self, qual: str) -> list[str]:
        out, todo = [], [qual]
        while todo:
            q = todo.pop(0)
            if q in out:
                continue
            out.append(q)
            c = self.get(q)
            if c is not None:
                todo.extend(c["bases"])
        return out


def _param_ok(java: str, pyi: str, ctx: dict) -> bool:
    java = re.sub(r"<.*>", "", java).strip()
    pyi = pyi.strip()
    if java in PRIMITIVE_PARAM:
        return PRIMITIVE_PARAM[java] in pyi.split(" | ")
    if java.endswith("[]"):
        return pyi.startswith("java.chaquopy.JavaArray[")
    first = pyi.split(" | ")
    want = _qualified(java, ctx)
    return any(_same_class(want, f, ctx) for f in first) or (java == "String" and "str" in first)


def _return_ok(java: str, pyi: str, ctx: dict) -> bool:
    java = re.sub(r"<.*>", "", java).strip()
    alts = [a.strip() for a in pyi.split(" | ") if a.strip() != "None"] or ["None"]
    if java in PRIMITIVE_RETURN:
        return PRIMITIVE_RETURN[java] in [a.strip() for a in pyi.split(" | ")]
    if java.endswith("[]"):
        return any(a.startswith("java.chaquopy.JavaArray[") for a in alts)
    if java == "String":
        return "str" in alts
    if java == "Object":
        return any(a in ("java.lang.Object", "typing.Any") or re.fullmatch(r"_\w+__\w+", a) for a in alts)
    return any(_same_class(_qualified(java, ctx), a, ctx) for a in alts)


def _qualified(java: str, ctx: dict) -> str:
    if java in JAVA_LANG:
        return "java.lang." + java
    if "." in java and java.split(".")[0] in ctx["imports"]:
        head, rest = java.split(".", 1)
        return ctx["imports"][head] + "." + rest
    if java in ctx["imports"]:
        return ctx["imports"][java]
    if "." in java and not java.startswith(("android.", "java.")):
        return ctx["package"] + "." + java  # Outer.Inner in the same package
    if java.startswith(("android.", "java.")):
        return java
    if java in ctx["nested"]:
        return ctx["nested"][java]
    return ctx["package"] + "." + java


def _same_class(want: str, pyi_name: str, ctx: dict) -> bool:
    pyi_name = re.sub(r"\[.*\]$", "", pyi_name.strip())
    if pyi_name == want:
        return True
    # relative names in the .pyi: the class's own package, or an enclosing class
    return want.endswith("." + pyi_name) and want.startswith(ctx["api_package"] + ".")


MEMBER = re.compile(r"^\s*(?:(?:public|protected|static|final|abstract)\s+)*(?:(?P<ret>[\w.<>\[\]]+)\s+)?"
                    r"(?P<name>\w+)\((?P<params>[^)]*)\)\s*(?:throws [\w., ]+)?\s*(?:\{|;)")
FIELD = re.compile(r"^\s*public\s+(?:static\s+)?(?:final\s+)?(?P<type>[\w.\[\]]+)\s+(?P<names>\w+(?:,\s*\w+)*)\s*(?:=|;)")


def _java_members(source: str):
    """(enclosing Outer.Inner, kind, return type, name, [param types]) for each member the stub
    declares (one per line, as the stubs are written); private members are skipped."""
    members, pos = [], 0
    for line in source.splitlines(keepends=True):
        here, pos = pos, pos + len(line)
        text = line.strip()
        if not text or text.startswith(("package", "import", "/*", "*", "//")) or "private" in text.split("(")[0]:
            continue
        if re.match(r"(public\s+)?(abstract\s+|final\s+|static\s+)*(class|interface)\b", text):
            continue
        encl = _enclosing(source, here)
        if encl is None:
            continue
        m = MEMBER.match(line)
        if m:
            params = [p.strip().rsplit(" ", 1)[0] for p in m.group("params").split(",") if p.strip()]
            if m.group("ret") is None or m.group("ret") in ("public", "protected"):
                if m.group("name") == encl.split(".")[-1] and text.startswith(("public", "protected")):
                    members.append((encl, "ctor", None, m.group("name"), params))  # package-private: not API
                continue
            members.append((encl, "method", m.group("ret"), m.group("name"), params))
            continue
        f = FIELD.match(line)
        if f:
            for name in f.group("names").split(","):
                members.append((encl, "field", f.group("type"), name.strip(), []))
    return members


def _enclosing(source: str, pos: int) -> str | None:
    """Outer.Inner name of the class whose body holds `pos` (by brace depth)."""
    stack, depth = [], 0
    for m in re.finditer(r"(?:class|interface) (\w+)[^{;]*\{|\{|\}", source[:pos]):
        tok = m.group(0)
        if tok.startswith(("class", "interface")):
            stack.append((m.group(1), depth))
            depth += 1
        elif tok == "{":
            depth += 1
        else:
            depth -= 1
            while stack and stack[-1][1] >= depth:
                stack.pop()
    return ".".join(n for n, _ in stack) or None


# "Constant Value" in the Android API reference, for each stub constant that javac inlines.
DOCUMENTED_CONSTANTS = {
    "android.app.Activity.RESULT_OK": "-1",
    "android.content.Intent.ACTION_OPEN_DOCUMENT": '"android.intent.action.OPEN_DOCUMENT"',
    "android.content.Intent.CATEGORY_OPENABLE": '"android.intent.category.OPENABLE"',
    "android.content.Context.ACTIVITY_SERVICE": '"activity"',
    "android.view.View.VISIBLE": "0",
    "android.view.View.GONE": "8",
    "android.view.View.FOCUS_DOWN": "130",
    "android.view.ViewGroup.LayoutParams.MATCH_PARENT": "-1",
    "android.view.ViewGroup.LayoutParams.WRAP_CONTENT": "-2",
    "android.widget.LinearLayout.HORIZONTAL": "0",
    "android.widget.LinearLayout.VERTICAL": "1",
    # the lifecycle's classes (issue 33's state holder, service, notification, theme, clipboard)
    "android.app.NotificationManager.IMPORTANCE_LOW": "2",
    "android.app.PendingIntent.FLAG_IMMUTABLE": "67108864",        # 0x04000000
    "android.app.PendingIntent.FLAG_UPDATE_CURRENT": "134217728",  # 0x08000000
    "android.app.Service.START_NOT_STICKY": "2",
    "android.content.Context.NOTIFICATION_SERVICE": '"notification"',
    "android.content.Context.CLIPBOARD_SERVICE": '"clipboard"',
    "android.content.pm.ApplicationInfo.FLAG_DEBUGGABLE": "2",     # 1 << 1
    "android.content.res.Configuration.UI_MODE_NIGHT_MASK": "48",  # 0x30
    "android.content.res.Configuration.UI_MODE_NIGHT_YES": "32",   # 0x20
}
# Set by the framework when the class loads (system properties, the running process): never constants.
RUNTIME_FIELDS = {"android.os.Build.VERSION.SDK_INT", "android.os.Build.VERSION.RELEASE",
                  "android.os.Build.VERSION.SDK", "android.os.Build.VERSION.CODENAME",
                  "android.os.Build.VERSION.INCREMENTAL", "android.os.Build.VERSION.PREVIEW_SDK_INT",
                  "android.os.Build.VERSION.SECURITY_PATCH", "android.os.Build.MODEL", "android.os.Build.MANUFACTURER",
                  "android.os.Build.BRAND", "android.os.Build.DEVICE", "android.os.Build.PRODUCT",
                  "android.os.Build.HARDWARE", "android.os.Build.SUPPORTED_ABIS", "android.os.Build.FINGERPRINT",
                  "android.os.Build.ID", "android.os.Build.TIME"}
INLINABLE_TYPES = {"int", "long", "short", "byte", "char", "boolean", "float", "double", "String"}
CONSTANT_FIELD = re.compile(r"^\s*(?:(?:public|protected)\s+)?(?=[^=]*\bstatic\b)(?=[^=]*\bfinal\b)"
                            r"(?:(?:public|protected|static|final)\s+)*(?P<type>\w+)\s+(?P<name>\w+)\s*=\s*(?P<value>[^;]+);")


def inlined_constants(stubs: Path) -> list[tuple[str, str, str]]:
    """(qualified field, type, initialiser) for each stub field that javac would inline into the
    app: static final, of a primitive type or String, initialised with a constant expression
    (no null, no call, no new)."""
    found = []
    for path in sorted(Path(stubs).rglob("*.java")):
        source = path.read_text()
        package = re.search(r"package ([\w.]+);", source).group(1)
        pos = 0
        for line in source.splitlines(keepends=True):
            here, pos = pos, pos + len(line)
            m = CONSTANT_FIELD.match(line)
            if not m or m.group("type") not in INLINABLE_TYPES:
                continue
            value = m.group("value").strip()
            if value == "null" or "(" in value or re.search(r"\bnew\b", value):
                continue
            encl = _enclosing(source, here)
            found.append((f"{package}.{encl}.{m.group('name')}", m.group("type"), value))
    return found


def constant_problems(stubs: Path) -> list[str]:
    """Stub constants that javac would inline where the real field is not a documented constant
    with that value (android.R: checked against framework-res.apk elsewhere)."""
    problems = []
    for field, _, value in inlined_constants(stubs):
        if field.startswith("android.R."):
            continue
        if field in RUNTIME_FIELDS:
            problems.append(f"{field}: javac inlines the stub's value {value} into the app, but the framework sets "
                            f"this field at run time (it is not a constant): every phone would see {value}. Declare it "
                            "as a blank final assigned in a static block, so that the app reads the real field")
        elif DOCUMENTED_CONSTANTS.get(field) != value:
            problems.append(f"{field}: javac inlines the stub's value {value} into the app, and it is not a "
                            "documented constant with that value (check_stubs.DOCUMENTED_CONSTANTS"
                            + (f" has {DOCUMENTED_CONSTANTS[field]}" if field in DOCUMENTED_CONSTANTS else "")
                            + "): add it there from the API reference's 'Constant Value', or declare it as a blank "
                              "final so that the app reads the real field")
    return problems


def check(stubs: Path, api_root: Path) -> list[str]:
    api = Api(api_root)
    problems: list[str] = constant_problems(stubs)
    for path in sorted(Path(stubs).rglob("*.java")):
        source = path.read_text()
        package = re.search(r"package ([\w.]+);", source).group(1)
        if path.stem == "R" and package == "android":
            continue  # resource ids: checked against framework-res.apk instead
        imports = {i.rsplit(".", 1)[1]: i for i in re.findall(r"import ([\w.]+);", source)}
        nested = {}
        for m in re.finditer(r"(?:class|interface) (\w+)(?:<[^>]*>)?(?: extends ([\w.<>]+))?(?: implements ([\w.<>, ]+))?\s*\{",
                             source):
            encl = _enclosing(source, m.end())
            nested[m.group(1)] = package + "." + encl
        for m in re.finditer(r"(?:class|interface) (\w+)(?:<[^>]*>)?(?: extends ([\w.<>]+))?(?: implements ([\w.<>, ]+))?\s*\{",
                             source):
            qual = package + "." + _enclosing(source, m.end())
            ctx = {"package": package, "imports": imports, "nested": nested, "api_package": package}
            if api.get(qual) is None:
                problems.append(f"{qual}: no such class in the API")
                continue
            for sup in [m.group(2)] + [s.strip() for s in (m.group(3) or "").split(",")]:
                if not sup:
                    continue
                sup_q = _qualified(re.sub(r"<.*>", "", sup), ctx)
                if sup_q not in api.ancestors(qual) and not sup_q.startswith("java."):
                    problems.append(f"{qual}: the stub extends {sup_q}, which is not among its real ancestors")
        for encl, kind, ret, name, params in _java_members(source):
            qual = package + "." + encl
            ctx = {"package": package, "imports": imports, "nested": nested, "api_package": package}
            cls = api.get(qual)
            if cls is None:
                continue
            if kind == "field":
                if not any(re.search(rf"^\s*{name}: ", (api.get(a) or {}).get("body", ""), re.M)
                           for a in api.ancestors(qual)):
                    problems.append(f"{qual}.{name}: no such field")
                continue
            where = [qual] if kind == "ctor" else api.ancestors(qual)
            pyname = "__init__" if kind == "ctor" else name
            found = False
            candidates = []
            for anc in where:
                c = api.get(anc)
                if c is None:
                    continue
                actx = dict(ctx, api_package=c["package"])
                for d in re.finditer(rf"def {pyname}\((.*?)\) -> (.*?): \.\.\.", c["body"]):
                    args = [a for a in d.group(1).split(", ") if a and a not in ("self", "/", "*")]  # "" : a static method without parameters
                    types = [a.split(": ", 1)[1] if ": " in a else "" for a in args]
                    candidates.append(f"{anc}: ({', '.join(types)}) -> {d.group(2)}")
                    if len(types) == len(params) and all(_param_ok(j, p, actx) for j, p in zip(params, types)) \
                            and (kind == "ctor" or _return_ok(ret, d.group(2), actx)):
                        found = True
                        break
                if found:
                    break
            if not found:
                sig = f"{ret + ' ' if ret else ''}{name}({', '.join(params)})"
                problems.append(f"{qual}: {sig} matches no declaration in the API"
                                + (f"; there: {'; '.join(candidates[:4])}" if candidates else ""))
    return problems


STUBS = Path(__file__).resolve().parents[1] / "stubs"  # android/stubs


def report(problems: list[str]) -> int:
    """Print each problem and their count: the command-line face of this check and of
    check_api_levels.py. The exit status: 1 if there is any."""
    for p in problems:
        print(p)
    print(f"{len(problems)} problem(s)")
    return 1 if problems else 0


def main(argv: list[str]) -> int:
    return report(check(STUBS, Path(argv[0])))


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
