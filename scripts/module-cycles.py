#!/usr/bin/env python3
"""Import cycles between the modules of a Rust library crate (by default `kernels`).

Usage: scripts/module-cycles.py [ROOT] [--tests] [--edges]
       cargo modules dependencies --package kernels --lib --layout dot --no-fns --no-types \
           --no-traits --no-owns --no-externs --no-sysroot | scripts/module-cycles.py --dot -

ROOT is the crate root (`kernels-rs/src/lib.rs`). Each file module is a node (an inline
module such as `mod x86 { .. }` belongs to its file). Module `a` depends on module `b` when
code in `a` names a path into `b`: `crate::b::..`, `super::..`, `self::..`, or a child
module by its bare name, in a `use` or anywhere else. A child naming its parent counts like
any other dependency, so a parent re-exporting a child that uses the parent is a cycle too.
Code of every cargo feature is read; `#[cfg(test)]` items only with `--tests`.

Prints every elementary cycle and their count; exits with 1 when there is one. Not seen:
paths that macros assemble, and method calls, which name no module (a type's inherent
methods may be defined in another module of the crate than the type).

With `--dot`, the cycles of the module graph cargo-modules derives from the compiler's view
are counted instead. There an inline module is a node of its own and a type depends on what
the signatures of all its impls name, wherever the impls are. (`cargo modules dependencies
--acyclic` itself stops at the first cycle between items, such as a type and its
constructor, so it cannot tell module cycles apart.)
"""

import argparse
import os
import re
import sys
from collections import defaultdict


def blank(text):
    """`text` with comments, string and char literals replaced by spaces (newlines kept), so
    offsets stay valid and no path inside them is read."""
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        prev = text[i - 1] if i else " "
        raw = re.match(r'b?r(#*)"', text[i:i + 300]) if c in "br" else None
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
        elif text.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if text.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif text.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
        elif raw and not (prev.isalnum() or prev == "_"):
            end = '"' + raw.group(1)
            j = text.find(end, i + raw.end())
            j = n if j < 0 else j + len(end)
        elif c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            j += 1
        elif c == "'" and re.match(r"'(\\[^']+|[^\\'])'", text[i:i + 12]):
            j = i + re.match(r"'(\\[^']+|[^\\'])'", text[i:i + 12]).end()
        else:  # code, or a lifetime's quote
            out.append(c)
            i += 1
            continue
        out.append(re.sub(r"[^\n]", " ", text[i:j]))
        i = j
    return "".join(out)


MOD_RE = re.compile(r"\b(?:pub(?:\([^)]*\))?\s+)?mod\s+([A-Za-z_]\w*)\s*([;{])")
ATTRS_RE = re.compile(r"(?:#\[[^\]]*(?:\[[^\]]*\][^\]]*)*\]\s*)+")
PATH_RE = re.compile(r"(?<![\w:])((?:[A-Za-z_]\w*\s*::\s*)+(?:[A-Za-z_]\w*|\*|\{))")
USE_RE = re.compile(r"\buse\s+([^;]+);")


def is_test_cfg(attrs):
    return any(
        re.search(r"\btest\b", a) and not re.search(r"not\s*\(\s*test", a)
        for a in re.findall(r"#\[\s*cfg\s*\((.*?)\)\s*\]", attrs, re.S)
    )


def item_end(text, start):
    """The end of the item starting at `start`: its `;`, or the brace closing its body."""
    depth = 0
    for j in range(start, len(text)):
        ch = text[j]
        if ch == ";" and depth == 0:
            return j + 1
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth == 0 and ch == "}":
                return j + 1
    return len(text)


def test_spans(text):
    """The (start, end) spans of the `#[cfg(test)]` items of a file."""
    spans = []
    for m in re.finditer(r"#\[\s*cfg\s*\(", text):
        attrs = ATTRS_RE.match(text, m.start())
        if not attrs or not is_test_cfg(attrs.group(0)):
            continue
        spans.append((m.start(), item_end(text, attrs.end())))
    return spans


class Crate:
    def __init__(self, root, with_tests):
        self.with_tests = with_tests
        self.files = {}  # file module path -> file name
        self.owner = {}  # any module path (file or inline) -> its file module path
        self.children = defaultdict(set)
        self.code = {}  # file module path -> blanked text
        self.load(root, (), os.path.dirname(root))

    def load(self, file, path, child_dir):
        with open(file, encoding="utf-8") as f:
            text = blank(f.read())
        self.files[path] = file
        self.owner[path] = path
        self.code[path] = text
        skipped = [] if self.with_tests else test_spans(text)
        for m, inner in self.inline_modules(path, text):
            if m.group(2) == "{":
                self.children[inner[:-1]].add(inner[-1])
                self.owner[inner] = path
                continue
            if any(s <= m.start() < e for s, e in skipped):
                continue
            parent, name = inner[:-1], inner[-1]
            self.children[parent].add(name)
            base = os.path.join(child_dir, *parent[len(path):])
            for cand in (os.path.join(base, name + ".rs"), os.path.join(base, name, "mod.rs")):
                if os.path.exists(cand):
                    self.load(cand, inner, os.path.join(base, name))
                    break
            else:
                sys.exit(f"{file}: no file for module `{name}`")

    @staticmethod
    def inline_modules(path, text):
        """Each `mod` declaration of a file with the module path it declares."""
        stack, depth, found = [], 0, []
        for m in re.finditer(r"[{}]|" + MOD_RE.pattern, text):
            tok = m.group(0)
            if tok == "{":
                depth += 1
            elif tok == "}":
                depth -= 1
                while stack and stack[-1][1] > depth:
                    stack.pop()
            else:
                cur = stack[-1][0] if stack else path
                found.append((m, cur + (m.group(1),)))
                if m.group(2) == "{":
                    depth += 1
                    stack.append((cur + (m.group(1),), depth))
        return found

    def inline_spans(self, path, text):
        """The (start, end, module path) of each inline module of a file."""
        return [
            (m.start(), item_end(text, m.start()), inner)
            for m, inner in self.inline_modules(path, text)
            if m.group(2) == "{"
        ]

    @staticmethod
    def module_at(path, spans, offset):
        """The (possibly inline) module the code at `offset` of a file is in."""
        inside = [inner for start, end, inner in spans if start <= offset < end]
        return max(inside, key=len, default=path)

    def resolve(self, module, segs):
        """The module a path written in `module` leads into, or None outside the crate."""
        if segs[0] == "crate":
            target, rest = (), segs[1:]
        elif segs[0] in ("super", "self"):
            target, rest = module, segs
            while rest and rest[0] in ("super", "self"):
                target = target[:-1] if rest[0] == "super" else target
                rest = rest[1:]
        elif segs[0] in self.children.get(module, ()):
            target, rest = module, segs
        else:
            return None
        for s in rest:
            if target + (s,) not in self.owner:
                break
            target += (s,)
        return target

    def edges(self):
        found = defaultdict(set)
        for path, text in self.code.items():
            skipped = [] if self.with_tests else test_spans(text)
            spans = self.inline_spans(path, text)
            refs = [(m.start(), segs) for m in USE_RE.finditer(text) for segs in use_paths(m.group(1))]
            refs += [(m.start(), split_path(m.group(1))) for m in PATH_RE.finditer(text)]
            for offset, segs in refs:
                if not segs or any(s <= offset < e for s, e in skipped):
                    continue
                target = self.resolve(self.module_at(path, spans, offset), segs)
                if target is None or self.owner[target] == path:
                    continue
                found[(path, self.owner[target])].add("::".join(segs))
        return found


def split_path(path):
    return [s.strip() for s in path.split("::") if s.strip() and s.strip() != "{"]


def use_paths(tree, prefix=()):
    """The paths of a use tree: `a::{b, c::{d as e}}` gives `a::b` and `a::c::d`."""
    tree = tree.strip()
    m = re.match(r"^((?:[A-Za-z_]\w*\s*::\s*)*)\{(.*)\}$", tree, re.S)
    if not m:
        name = re.split(r"\s+as\s+", tree)[0]
        return [list(prefix) + split_path(name)] if name else []
    head = tuple(split_path(m.group(1)))
    parts, depth, cur = [], 0, ""
    for ch in m.group(2):
        depth += (ch == "{") - (ch == "}")
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    return [p for part in parts for p in use_paths(part, prefix + head)]


def elementary_cycles(graph):
    """Every elementary cycle of `graph` (Johnson's algorithm), each from its least node."""
    order = sorted(graph)
    cycles = []
    for i, start in enumerate(order):
        allowed = set(order[i:])
        blocked, blocked_by, stack = set(), defaultdict(set), []

        def unblock(node):
            work = [node]
            while work:
                w = work.pop()
                if w in blocked:
                    blocked.discard(w)
                    work.extend(blocked_by.pop(w, ()))

        def circuit(node):
            closed = False
            stack.append(node)
            blocked.add(node)
            for nxt in sorted(graph[node] & allowed):
                if nxt == start:
                    cycles.append(list(stack))
                    closed = True
                elif nxt not in blocked and circuit(nxt):
                    closed = True
            if closed:
                unblock(node)
            else:
                for nxt in graph[node] & allowed:
                    blocked_by[nxt].add(node)
            stack.pop()
            return closed

        circuit(start)
    return cycles


def dot_graph(lines):
    """The "uses" edges of a cargo-modules graph, each as (module, module, "")."""
    edges = {}
    for line in lines:
        m = re.match(r'\s*"([^"]+)"\s*->\s*"([^"]+)"\s*\[label="uses"', line)
        if m:
            edges[(m.group(1), m.group(2))] = ""
    return edges


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("root", nargs="?", default="kernels-rs/src/lib.rs", help="the crate root")
    ap.add_argument("--tests", action="store_true", help="read #[cfg(test)] items too")
    ap.add_argument("--edges", action="store_true", help="print every dependency")
    ap.add_argument(
        "--dot",
        metavar="FILE",
        help="count the cycles of the module graph cargo-modules wrote to FILE ('-': stdin) "
        "instead of reading the sources",
    )
    args = ap.parse_args()
    if args.dot:
        with open(args.dot) if args.dot != "-" else sys.stdin as f:
            found = dot_graph(f)
        graph = defaultdict(set)
        for a, b in found:
            graph[a].add(b)
            graph[b]
        name = str
    else:
        crate = Crate(args.root, args.tests)
        found = {edge: ", ".join(sorted(paths)[:3]) for edge, paths in crate.edges().items()}
        graph = {path: set() for path in crate.files}
        for a, b in found:
            graph[a].add(b)

        def name(path):
            return "::".join(("crate",) + path)

    if args.edges:
        for (a, b), paths in sorted(found.items()):
            print(f"{name(a)} -> {name(b)}" + (f"  ({paths})" if paths else ""))
    cycles = elementary_cycles(graph)
    for c in cycles:
        print("cycle: " + " -> ".join(name(p) for p in c + [c[0]]))
    print(f"{len(cycles)} import cycles among {len(graph)} modules")
    return 1 if cycles else 0


if __name__ == "__main__":
    sys.exit(main())
