"""Check every framework (android.*, java.*, ...) class, method and field the app's compiled classes
use against the API level each was added in, and the app's minSdk.

The app compiles against hand-written stubs (android/stubs) and the JDK's Java 8 library, so
javac accepts any member either declares: a call added in API 26 compiles just as well as one
from API 1, and on an API 24 phone it is a NoSuchMethodError (or NoClassDefFoundError) when it
runs. This reads the levels from the npm package ``@nativescript/types-android`` (TypeScript
declarations generated from the Android SDK's android.jar of every level from 21 to 37, merged,
with ``/** @since N */`` on each class and member that appeared after API 21; nothing marked:
there at 21), and the uses from the compiled classes (``javap -c -p -s``): every method call,
field access, ``new``/``checkcast``/``instanceof``/class literal, and each app class's
superclass and interfaces. A use of a member or class newer than minSdk must sit inside a guard
that the bytecode shows: ``if (Build.VERSION.SDK_INT >= N) { ... }`` (or ``> N-1``, or the
``SDK_INT < N`` test whose else branch holds the use) with N at least the member's level.
Uses through an app class (``this.startForeground(...)`` in a Service subclass) are looked up
in the framework class it extends.

Constants: javac copies a ``static final`` constant's value into the app, so its use leaves no
trace in the bytecode; the stubs' inlined constants are checked instead, each at most minSdk
(an older framework does not know what a newer constant means), and with the value the
declarations give it.

    npm pack @nativescript/types-android@9.1.1                 # once (4 MB)
    python android/test/check_api_levels.py build/android/classes nativescript-types-android-9.1.1.tgz [MIN_SDK]
                                                   # the classes build.sh compiled; prints problems, exit 1 if any
"""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

OLDEST = 21  # the merged declarations start at API 21: an unmarked class or member is there at 21

TYPES_PACKAGE = "@nativescript/types-android"
TYPES_VERSION = "9.1.1"
TYPES_SHA256 = "16193ea9c70286d5b0d3e2dc559abb483ad61fb599219c59d1a4146fe370b25a"  # of the npm tarball
TYPES_FILE = "package/lib/android/android-platform-21-37-merged.d.ts"
TYPES_TARBALL = f"nativescript-types-android-{TYPES_VERSION}.tgz"
TYPES_FETCH = f"npm pack {TYPES_PACKAGE}@{TYPES_VERSION} (into ~/.cache/edgekv-android)"


def declarations_from(tarball: Path, dest: Path) -> Path:
    """The merged declarations out of the npm tarball, after its SHA-256 matched."""
    import hashlib
    import tarfile

    digest = hashlib.sha256(Path(tarball).read_bytes()).hexdigest()
    if digest != TYPES_SHA256:
        raise ValueError(f"{tarball}: SHA-256 {digest}, not {TYPES_PACKAGE}@{TYPES_VERSION}'s {TYPES_SHA256}: "
                         f"fetch it again ({TYPES_FETCH})")
    out = Path(dest) / Path(TYPES_FILE).name
    with tarfile.open(tarball) as t:
        out.write_bytes(t.extractfile(TYPES_FILE).read())
    return out


@dataclass
class Member:
    kind: str            # "method", "ctor" or "field"
    name: str
    params: list[str]    # TypeScript types, as declared
    type: str            # a field's type or a method's return type
    since: int


@dataclass
class ApiClass:
    name: str
    since: int
    bases: list[str] = field(default_factory=list)
    members: list[Member] = field(default_factory=list)


_SINCE = re.compile(r"@since (\d+)")
_CLASS = re.compile(r"^\s*export (?:abstract )?class (\w+)(?:<[^{]*?>)?\s*(?:extends ([\w.]+)(?:<[^{]*?>)?)?"
                    r"(?:\s*implements (.+?))?\s*\{\s*$")
_MODULE = re.compile(r"^\s*(?:declare|export) module (\w+) \{\s*$")
_METHOD = re.compile(r"^\s*public (?:static )?(?:abstract )?(\w+)(?:<[^(]*>)?\((.*)\): (.+);\s*$")
_CTOR = re.compile(r"^\s*public constructor\((.*)\);\s*$")
_FIELD = re.compile(r"^\s*public (?:static )?(?:readonly )?(\w+): (.+);\s*$")


def _split_top(text: str) -> list[str]:
    """Split at commas outside <>, () and {}."""
    out, depth, cur = [], 0, ""
    for ch in text:
        if ch in "<({[":
            depth += 1
        elif ch in ">)}]":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur.strip())
    return out


def _param_type(param: str) -> str:
    return param.split(":", 1)[1].strip() if ":" in param else "any"


def read_declarations(dts: Path) -> dict[str, ApiClass]:
    """Every class of the merged declarations by qualified name (Outer.Inner for nested ones),
    with its level, bases and members (a class declared in several blocks is merged)."""
    classes: dict[str, ApiClass] = {}
    stack: list[tuple[str, str]] = []  # (kind, name) for each open brace
    comment: list[str] | None = None
    since = OLDEST
    for line in Path(dts).read_text(encoding="utf-8").splitlines():
        text = line.strip()
        if comment is not None:
            comment.append(text)
            if "*/" in text:
                found = _SINCE.search(" ".join(comment))
                since = int(found.group(1)) if found else OLDEST
                comment = None
            continue
        if text.startswith("/**"):
            if "*/" in text:
                found = _SINCE.search(text)
                since = int(found.group(1)) if found else OLDEST
            else:
                comment = [text]
            continue
        in_class = bool(stack) and stack[-1][0] == "class"
        m = _MODULE.match(line)
        if m:
            stack.append(("module", m.group(1)))
            since = OLDEST
            continue
        m = _CLASS.match(line)
        if m:
            qual = ".".join(n for _, n in stack + [("class", m.group(1))])
            bases = [m.group(2)] if m.group(2) else []
            bases += [re.sub(r"<.*>", "", b) for b in _split_top(m.group(3) or "")]
            c = classes.setdefault(qual, ApiClass(qual, since))
            c.since = min(c.since, since) if c.members else since
            c.bases += [b for b in bases if b not in c.bases]
            stack.append(("class", m.group(1)))
            since = OLDEST
            continue
        if in_class and text.startswith("public ") and not text.endswith("{"):
            c = classes[".".join(n for _, n in stack)]
            if (m := _CTOR.match(line)):
                params = [_param_type(p) for p in _split_top(m.group(1))]
                c.members.append(Member("ctor", "<init>", params, "", since))
            elif (m := _METHOD.match(line)):
                params = [_param_type(p) for p in _split_top(m.group(2))]
                c.members.append(Member("method", m.group(1), params, m.group(3), since))
            elif (m := _FIELD.match(line)) and m.group(1) != "class":
                c.members.append(Member("field", m.group(1), [], m.group(2), since))
            since = OLDEST
            continue
        opens, closes = line.count("{"), line.count("}")
        for _ in range(closes - opens if closes > opens else 0):
            if stack:
                stack.pop()
        for _ in range(opens - closes if opens > closes else 0):
            stack.append(("other", ""))
        if text and not text.startswith("*"):
            since = OLDEST
    return classes


# ---- the app's bytecode --------------------------------------------------------------------------

@dataclass
class Use:
    where: str           # class.method, for the message
    pc: int
    what: str            # "method", "field" or "class"
    owner: str           # dotted, nested classes as Outer.Inner
    name: str = ""
    desc: str = ""       # JVM descriptor of a method or field
    method: str = ""     # the app method holding the use (name + descriptor), whose guards apply


@dataclass
class AppClass:
    name: str
    super: str | None
    interfaces: list[str]
    members: set[tuple[str, str]]   # (name, descriptor); constructors as <init>
    uses: list[Use]
    guards: dict[str, list[tuple[int, int, int]]]  # method -> [(from pc, to pc, level)]


def _dotted(internal: str) -> str:
    return internal.replace("/", ".").replace("$", ".")


_HEADER = re.compile(r"^(?:[\w ]+ )?(?:class|interface) ([\w.$]+)(?:<.*?>)?(?: extends ([\w.$<>, ?]+?))?"
                     r"(?: implements ([\w.$<>, ?]+))? \{$")
_INSN = re.compile(r"^\s*(\d+): (\w+)\s*(.*?)$")
_REF = re.compile(r"// (Method|InterfaceMethod|Field|class) (.+)$")


def read_classes(classes_dir: Path) -> dict[str, AppClass]:
    """The app's classes as javap shows them: supertypes, declared members, framework uses and
    the SDK_INT guards around them."""
    files = sorted(str(p) for p in Path(classes_dir).rglob("*.class"))
    r = subprocess.run(["javap", "-c", "-p", "-s", *files], capture_output=True, text=True, check=True)
    out: dict[str, AppClass] = {}
    cur: AppClass | None = None
    method = ""
    decl_name = ""
    code: list[tuple[int, str, str]] = []

    def flush():
        if cur is not None and method:
            cur.guards[method] = _guards(code)
        code.clear()

    for line in r.stdout.splitlines():
        m = _HEADER.match(line.strip()) if not line.startswith(" ") else None
        if m:
            flush()
            name = m.group(1).replace("$", ".")
            sup = m.group(2) if "class " in line.split("{")[0] else None
            ifaces = _split_top(m.group(3) or "")
            if "class " not in line.split("{")[0]:  # an interface "extends" its interfaces
                ifaces += _split_top(m.group(2) or "")
            cur = AppClass(name, re.sub(r"<.*>", "", sup).replace("$", ".") if sup else "java.lang.Object",
                           [re.sub(r"<.*>", "", i).replace("$", ".") for i in ifaces], set(), [], {})
            out[name] = cur
            method = ""
            continue
        if cur is None:
            continue
        if line.startswith("  ") and not line.startswith("   ") and line.rstrip().endswith(";"):
            flush()
            head = line.strip()[:-1]
            head = re.sub(r" throws .*$", "", head)
            if "(" in head:
                decl_name = head.split("(")[0].split()[-1]
                decl_name = "<init>" if decl_name.replace("$", ".") == cur.name else decl_name
            else:
                decl_name = head.split()[-1]
                decl_name = "<clinit>" if decl_name == "{}" else decl_name
            method = ""
            continue
        if line.startswith("    descriptor: "):
            cur.members.add((decl_name, line.split(": ", 1)[1].strip()))
            method = f"{decl_name}{line.split(': ', 1)[1].strip()}"
            continue
        if line.strip() == "static {};":
            flush()
            decl_name = "<clinit>"
            continue
        m = _INSN.match(line)
        if m and method:
            pc, op, rest = int(m.group(1)), m.group(2), m.group(3)
            code.append((pc, op, rest))
            ref = _REF.search(rest)
            if not ref:
                continue
            kind, target = ref.groups()
            target = target.strip('"')
            where = f"{cur.name}.{method.split('(')[0]}"
            if kind == "class":
                if target.startswith("["):
                    target = target.lstrip("[")
                    if not target.startswith("L"):
                        continue
                    target = target[1:].rstrip(";")
                cur.uses.append(Use(where, pc, "class", _dotted(target), method=method))
                continue
            owner_name, desc = target.rsplit(":", 1)
            if "." in owner_name.replace('"<init>"', "<init>").replace('"<clinit>"', "<clinit>"):
                owner, name = owner_name.rsplit(".", 1)
                owner = _dotted(owner)
            else:
                owner, name = cur.name, owner_name
            name = name.strip('"')
            if owner.startswith("["):
                continue  # an array's clone(): not a class of the API
            cur.uses.append(Use(where, pc, "field" if kind == "Field" else "method", owner, name, desc, method))
    flush()
    return out


_COMPARE = {"if_icmplt": ("then", 0), "if_icmple": ("then", 1), "if_icmpge": ("else", 0), "if_icmpgt": ("else", 1)}


def _guards(code: list[tuple[int, str, str]]) -> list[tuple[int, int, int]]:
    """(from, to, level) for each stretch of a method that runs only when SDK_INT >= level:
    ``getstatic SDK_INT; bipush N; if_icmplt L`` guards the code up to L (javac's form of
    ``if (SDK_INT >= N) {...}``); ``if_icmpge L`` (``if (SDK_INT < N) {...} else {...}``) guards
    from L to where the then-branch's goto jumps, or to the end when it returns."""
    out = []
    end = code[-1][0] + 1 if code else 0
    for i in range(len(code) - 2):
        if "android/os/Build$VERSION.SDK_INT:I" not in code[i][2]:
            continue
        op, arg = code[i + 1][1], code[i + 1][2]
        if op in ("bipush", "sipush"):
            n = int(arg.split()[0])
        elif op.startswith("iconst_"):
            n = int(op[7:].replace("m1", "-1"))
        else:
            continue
        branch = code[i + 2]
        if branch[1] not in _COMPARE:
            continue
        side, bump = _COMPARE[branch[1]]
        target = int(branch[2].split()[0])
        if side == "then":
            out.append((code[i + 2][0] + 1, target, n + bump))
        else:
            before = [c for c in code if c[0] < target][-1]
            if before[1] in ("goto", "goto_w") and int(before[2].split()[0]) > target:
                out.append((target, int(before[2].split()[0]), n + bump))
            elif before[1] in ("return", "areturn", "ireturn", "lreturn", "freturn", "dreturn", "athrow"):
                out.append((target, end, n + bump))
    return out


# ---- matching a use to a declaration -------------------------------------------------------------

_NUMERIC = {"I", "J", "S", "B", "F", "D"}


def _jvm_params(desc: str) -> list[str]:
    params = desc[1:desc.index(")")]
    out, i = [], 0
    while i < len(params):
        j = i
        while params[j] == "[":
            j += 1
        if params[j] == "L":
            j = params.index(";", j)
        out.append(params[i:j + 1])
        i = j + 1
    return out


def _type_ok(jvm: str, ts: str) -> bool:
    ts = re.sub(r"<.*>", "", ts.replace(" | null", "")).strip()
    if jvm.startswith("["):
        return ts.startswith("androidNative.Array") or ts == "any"
    if jvm in _NUMERIC:
        return ts == "number"
    if jvm == "Z":
        return ts == "boolean"
    if jvm == "C":
        return ts == "string"
    name = _dotted(jvm[1:-1])
    if re.fullmatch(r"[A-Z]\w{0,2}", ts):  # a type variable (T, K, V, E)
        return True
    if name in ("java.lang.String", "java.lang.CharSequence"):
        return ts in ("string", name)
    if name == "java.lang.Object":
        return ts in ("any", name)
    return ts == name


class Levels:
    def __init__(self, classes: dict[str, ApiClass]):
        self.classes = classes

    def ancestors(self, name: str) -> list[str]:
        out, todo = [], [name]
        while todo:
            q = todo.pop(0)
            if q in out or q not in self.classes:
                continue
            out.append(q)
            todo.extend(self.classes[q].bases)
        if "java.lang.Object" not in out and "java.lang.Object" in self.classes:
            out.append("java.lang.Object")  # an interface's methods of Object
        return out

    def level(self, use: Use) -> tuple[int | None, str]:
        """The API level the use needs (None: not in the API) and what it names."""
        cls = self.classes.get(use.owner)
        if cls is None:
            return None, use.owner
        if use.what == "class":
            return cls.since, use.owner
        label = f"{use.owner}.{use.name}"
        where = [use.owner] if use.name == "<init>" else self.ancestors(use.owner)
        for anc in where:
            members = [m for m in self.classes[anc].members if m.name == use.name]
            if use.what == "field":
                hits = [m for m in members if m.kind == "field"]
            else:
                params = _jvm_params(use.desc)
                same = [m for m in members if m.kind in ("method", "ctor") and len(m.params) == len(params)]
                hits = [m for m in same if all(_type_ok(j, t) for j, t in zip(params, m.params))]
            if hits:
                # several overloads the declarations cannot tell apart (int and long are both
                # "number"): the newest, so that a newer one is never passed as an older one
                return max(cls.since, max(h.since for h in hits)), f"{label}{use.desc if use.what == 'method' else ''}"
        return None, f"{label}{use.desc if use.what == 'method' else ''}"


def _resolve(use: Use, app: dict[str, AppClass], levels: Levels) -> Use | None:
    """A use through an app class, moved to the framework class that declares it: the
    superclasses first, then the interfaces (None: the app's own member or class)."""
    if use.owner not in app:
        return use
    if use.what == "class" or use.name == "<init>":
        return None
    order, todo = [], [use.owner]
    while todo:
        owner = todo.pop(0)
        if owner in order:
            continue
        order.append(owner)
        c = app.get(owner)
        if c is None:
            continue
        if (use.what == "field" and any(n == use.name for n, _ in c.members)) or \
                (use.what == "method" and (use.name, use.desc) in c.members):
            return None
        todo = [c.super] + todo + c.interfaces  # depth-first along the superclasses
    framework = [o for o in order if o not in app]
    for owner in framework:
        moved = Use(use.where, use.pc, use.what, owner, use.name, use.desc, use.method)
        if levels.level(moved)[0] is not None:
            return moved
    return Use(use.where, use.pc, use.what, framework[0] if framework else use.owner, use.name, use.desc, use.method)


def above_min_sdk(app: dict[str, AppClass], levels: Levels, min_sdk: int):
    """(use, what it names, its level or None when the API lacks it, the SDK_INT guard around it or
    None) for each use of the API whose level is above min_sdk or unknown."""
    for c in app.values():
        for sup in [c.super, *c.interfaces]:
            if sup not in app:
                use = Use(f"{c.name} (its supertype)", -1, "class", sup)
                lvl, what = levels.level(use)
                if lvl is None or lvl > min_sdk:
                    yield use, what, lvl, None
        for use in c.uses:
            moved = _resolve(use, app, levels)
            if moved is None:
                continue
            lvl, what = levels.level(moved)
            if lvl is not None and lvl <= min_sdk:
                continue
            guard = max((n for a, b, n in c.guards.get(use.method, []) if a <= use.pc < b), default=None)
            yield use, what, lvl, guard


def level_problems(classes_dir: Path, dts: Path | None, min_sdk: int, stubs: Path | None = None,
                   declarations: dict[str, ApiClass] | None = None) -> list[str]:
    """Each framework use above min_sdk that no SDK_INT guard for its level covers, each use of
    something the API lacks, and (with ``stubs``) each inlined stub constant above min_sdk or with
    another value than the API's."""
    levels = Levels(declarations if declarations is not None else read_declarations(dts))
    problems = []
    for use, what, lvl, guard in above_min_sdk(read_classes(classes_dir), levels, min_sdk):
        if lvl is None:
            problems.append(f"{use.where} uses {what}, which is not in the Android API (API {OLDEST} to 37): "
                            "it would fail on every phone")
        elif use.pc < 0:
            problems.append(f"{use.where}: {what} was added in API {lvl}, above minSdk {min_sdk}: the class "
                            "cannot load on older phones; raise minSdk or move the code out")
        elif guard is None or guard < lvl:
            problems.append(f"{use.where} (bytecode {use.pc}) uses {what}, added in API {lvl}, above minSdk "
                            f"{min_sdk}" + (f", under a guard for API {guard} only" if guard else ", unguarded")
                            + f": wrap it in `if (Build.VERSION.SDK_INT >= {lvl}) {{ ... }}` with a fallback, "
                              "or raise minSdk")
    if stubs is not None:
        problems += constant_level_problems(stubs, levels, min_sdk)
    return problems


def _check_stubs():
    """check_stubs.py, beside this file (imported by path: this module is loaded from
    android/test by the tests and as a script)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    try:
        import check_stubs
    finally:
        sys.path.pop(0)
    return check_stubs


def constant_level_problems(stubs: Path, levels: Levels, min_sdk: int) -> list[str]:
    check_stubs = _check_stubs()
    problems = []
    for qual, _, value in check_stubs.inlined_constants(stubs):
        if qual.startswith("android.R."):
            continue  # resource ids: checked against framework-res.apk
        owner, name = qual.rsplit(".", 1)
        cls = levels.classes.get(owner)
        hit = None
        for anc in levels.ancestors(owner) if cls else []:
            hit = next((m for m in levels.classes[anc].members if m.kind == "field" and m.name == name), None)
            if hit:
                break
        if hit is None:
            problems.append(f"{qual}: an inlined stub constant that is not in the Android API")
            continue
        lvl = max(cls.since, hit.since)
        if lvl > min_sdk:
            problems.append(f"{qual}: javac inlines it, but it was added in API {lvl}, above minSdk {min_sdk}: "
                            "an older framework does not understand the value; use it only where SDK_INT says so "
                            "and keep it out of the stubs' constants, or raise minSdk")
        if _literal(hit.type) is not None and _literal(hit.type) != _literal_java(value):
            problems.append(f"{qual}: the stub inlines {value}, the API declares {hit.type}")
    return problems


def _literal(ts: str):
    ts = ts.strip()
    if re.fullmatch(r"-?\d+(\.\d+)?", ts):
        return float(ts)
    if ts.startswith('"') and ts.endswith('"'):
        return ts[1:-1]
    return None


def _literal_java(value: str):
    value = value.strip()
    if value.startswith('"'):
        return value[1:-1]
    value = value.rstrip("LlFfDd") if not value.lower().startswith("0x") else value.rstrip("Ll")
    if re.fullmatch(r"-?(0x[0-9a-fA-F]+|\d+)", value):
        return float(int(value, 0))
    if re.fullmatch(r"-?\d*\.\d+", value):
        return float(value)
    return None  # an expression (1 << 4): not compared


def main(argv: list[str]) -> int:
    import tempfile

    classes_dir, dts = Path(argv[0]), Path(argv[1])
    if dts.suffix == ".tgz":
        dts = declarations_from(dts, Path(tempfile.mkdtemp()))
    min_sdk = int(argv[2]) if len(argv) > 2 else 24
    check_stubs = _check_stubs()
    return check_stubs.report(level_problems(classes_dir, dts, min_sdk, check_stubs.STUBS))


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
