"""A pipelines file as bytes -> plain Python data, bounded and located.

A nightly job reads this file with nobody watching, so reading it must never hang, exhaust memory
or crash: its size, nesting depth and alias expansion are bounded, keys must be text written once,
and every problem carries the line and the key path where it was found.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tasks.config.bounded_read import read_bounded

MAX_FILE_BYTES = 256 << 10
MAX_VALUES = 20_000
MAX_DEPTH = 64
MAX_SHOWN = 200
_MERGE_TAG = "tag:yaml.org,2002:merge"
_UTF8_BOM = b"\xef\xbb\xbf"
# YAML 1.1 reads 1e-4 as a string; YAML 1.2 (and every user) reads it as a number.
_EXPONENT_FLOAT = re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$")
_BLOCK_KEY = re.compile(r"^(?P<indent>[ -]*)(?P<key>[A-Za-z0-9_][A-Za-z0-9_.-]*)\s*:(?:\s|$)")


def clip(text: str, limit: int = MAX_SHOWN) -> str:
    """`text` cut to `limit` characters: a hostile value must not flood a terminal or a log."""
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text)} characters)"


def printable(text: str) -> str:
    """`text` with control characters escaped: a key or path from the file must not drive the terminal."""
    return text if text.isprintable() else "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def shown(value: Any) -> str:
    """A value as it appears in a message: repr, cut to MAX_SHOWN characters."""
    return clip(repr(value))


class YamlProblem(Exception):
    """Why the file cannot be read as YAML, where: line (1-based, None when unknown) and key path."""

    def __init__(self, line: int | None, key: str, message: str):
        self.line, self.key, self.message = line, key, message
        super().__init__(f"{line}: {key}: {message}")


@dataclass(frozen=True)
class YamlDocument:
    """The file's data, and its node tree to find the line a key path was written on."""

    data: Any
    root: yaml.Node | None

    def line(self, loc: tuple[Any, ...]) -> tuple[int | None, bool]:
        """The line of the deepest node on the path, and whether the whole path was found."""
        node = self.root
        best = node.start_mark.line + 1 if node is not None else None
        for part in loc:
            if isinstance(node, yaml.MappingNode):
                pair = next(((k, v) for k, v in node.value if k.value == str(part)), None)
                if pair is None:
                    return best or node.start_mark.line + 1, False
                best, node = pair[0].start_mark.line + 1, pair[1]
            elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and 0 <= part < len(node.value):
                node = node.value[part]
                best = node.start_mark.line + 1
            else:
                return best, False
        return best, True


def key_path(parts: list[Any]) -> str:
    return clip(".".join(clip(printable(str(p)), 64) for p in parts)) or "(top level)"


def _kind(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    return "null" if value is None else f"a {type(value).__name__}"


def read(path: Path) -> YamlDocument:
    """Read and parse `path`; raise YamlProblem (or OSError for a file that cannot be opened)."""
    text = _decode(_read_bytes(path))
    loader = _BoundedLoader()
    try:
        loader.start(text)
        root = loader.get_single_node()
        data = loader.construct_document(root) if root is not None else None
    except yaml.YAMLError as e:
        raise _located(e, text, loader) from e
    return YamlDocument(data, root)


def _read_bytes(path: Path) -> bytes:
    data = read_bounded(path, MAX_FILE_BYTES)
    if len(data) > MAX_FILE_BYTES:
        raise YamlProblem(None, "(top level)", f"is larger than {MAX_FILE_BYTES} bytes; a pipelines file is "
                                               "a few kilobytes")
    return data


def _decode(data: bytes) -> str:
    try:
        return data.removeprefix(_UTF8_BOM).decode("utf-8")
    except UnicodeDecodeError as e:
        start = e.start + (len(_UTF8_BOM) if data.startswith(_UTF8_BOM) else 0)
        line = data.count(b"\n", 0, start) + 1
        column = start - data.rfind(b"\n", 0, start)
        text = data.decode("utf-8", errors="replace")
        raise YamlProblem(line, _key_at(text, line), f"not UTF-8: byte 0x{data[start]:02x} at column {column}; "
                                                     "save the file as UTF-8") from e


def _key_at(text: str, line: int) -> str:
    """Best guess of the key path written at `line` of a file that does not parse: block-style keys
    above it with ever smaller indentation."""
    parts: list[str] = []
    indent = None
    for row in reversed(text.splitlines()[:line]):
        match = _BLOCK_KEY.match(row)
        if match and (indent is None or len(match["indent"]) < indent):
            parts.append(match["key"])
            indent = len(match["indent"])
            if indent == 0:
                break
    return key_path(list(reversed(parts)))


def _located(error: yaml.YAMLError, text: str, loader: _BoundedLoader) -> YamlProblem:
    if isinstance(error, yaml.reader.ReaderError):
        line = text.count("\n", 0, error.position) + 1
        return YamlProblem(line, _key_at(text, line),
                           f"character {shown(chr(error.character))} is not allowed in YAML ({error.reason})")
    problem = getattr(error, "problem", None) or str(error)
    context = getattr(error, "context", None)
    mark = getattr(error, "problem_mark", None)
    if "end of stream" in problem and getattr(error, "context_mark", None):
        mark = error.context_mark  # an unclosed quote or bracket: where it was opened, not the file's end
    line = mark.line + 1 if mark else 1
    message = clip(f"{problem} ({context})" if context else problem)
    if mark and "cannot start any token" in problem and text[mark.index:mark.index + 1] == "\t":
        message += "; it is a tab: YAML indents with spaces"
    if isinstance(error, yaml.scanner.ScannerError | yaml.parser.ParserError):
        return YamlProblem(line, loader.error_path or _key_at(text, line), f"YAML syntax error: {message}")
    key = loader.error_path or (loader.path_at(mark) if mark else "") or "(top level)"
    return YamlProblem(line, key, f"YAML error: {message}")


if yaml.__with_libyaml__:
    from yaml._yaml import CParser

    class _Events(CParser):
        """YAML events from libyaml: scanning in C keeps even a file at the size limit quick to refuse."""

        def __init__(self, text: str):
            CParser.__init__(self, text)
else:
    class _Events(yaml.reader.Reader, yaml.scanner.Scanner, yaml.parser.Parser):  # type: ignore[no-redef]
        """YAML events from PyYAML's own (slower) scanner where libyaml is not installed."""

        def __init__(self, text: str):
            yaml.reader.Reader.__init__(self, text)
            yaml.scanner.Scanner.__init__(self)
            yaml.parser.Parser.__init__(self)


class _BoundedLoader(yaml.composer.Composer, yaml.constructor.SafeConstructor, yaml.resolver.Resolver, _Events):
    """A safe loader that bounds depth and alias expansion while composing, and wants text keys written once."""

    def __init__(self) -> None:
        self.error_path = ""
        self._path: list[Any] = []
        self._open: list[yaml.Node | None] = []
        self._values = 0
        self._sizes: dict[int, tuple[int, int]] = {}
        self._root: yaml.Node | None = None

    def start(self, text: str) -> None:
        """Begin reading `text` (apart from __init__ so a ReaderError is raised inside read()'s handler)."""
        _Events.__init__(self, text)
        yaml.composer.Composer.__init__(self)
        yaml.constructor.SafeConstructor.__init__(self)
        yaml.resolver.Resolver.__init__(self)

    def compose_document(self) -> yaml.Node:
        self._root = super().compose_document()
        return self._root

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node:
        self._path.append(index.value if isinstance(index, yaml.ScalarNode) else index)
        self._open.append(parent)
        try:
            if self.check_event(yaml.AliasEvent):
                self._expand(self.peek_event())
            else:
                self._grow(1, 1, self.peek_event().start_mark)
            return super().compose_node(parent, index)
        except yaml.YAMLError:
            self.error_path = self.error_path or self._key_path()
            raise
        finally:
            self._path.pop()
            self._open.pop()

    def _key_path(self) -> str:
        return key_path([p for p in self._path if p is not None])

    def _expand(self, event: yaml.AliasEvent) -> None:
        target = self.anchors.get(event.anchor)
        if target is None:
            return  # the composer reports the undefined alias
        if any(target is node for node in self._open):
            raise self._problem(event.start_mark, f"alias *{clip(event.anchor, 64)} refers to a node that "
                                                  "contains it (a recursive alias)")
        values, depth = self._measure(target)
        self._grow(values, depth, event.start_mark, alias=event.anchor)

    def _measure(self, node: yaml.Node) -> tuple[int, int]:
        """(values, depth) under `node` once aliases are expanded; memoized, so a bomb is measured
        without being expanded."""
        if id(node) not in self._sizes:
            if isinstance(node, yaml.MappingNode):
                children = [n for pair in node.value for n in pair]
            elif isinstance(node, yaml.SequenceNode):
                children = node.value
            else:
                children = []
            measured = [self._measure(child) for child in children]
            self._sizes[id(node)] = (1 + sum(v for v, _ in measured), 1 + max((d for _, d in measured), default=0))
        return self._sizes[id(node)]

    def _grow(self, values: int, depth: int, mark: yaml.Mark, alias: str | None = None) -> None:
        if len(self._open) - 1 + depth > MAX_DEPTH:
            raise self._problem(mark, f"nested deeper than {MAX_DEPTH} levels")
        self._values += values
        if self._values > MAX_VALUES:
            why = f"alias *{clip(alias, 64)} expands to {values} values (an alias bomb?): " if alias else ""
            raise self._problem(mark, f"{why}more than {MAX_VALUES} values in the file; a pipelines file holds "
                                      "a few hundred")

    def _problem(self, mark: yaml.Mark, message: str) -> YamlProblem:
        return YamlProblem(mark.line + 1, self._key_path(), message)

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[str, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == _MERGE_TAG:
                continue
            line = key_node.start_mark.line + 1
            if not isinstance(key_node, yaml.ScalarNode):
                raise YamlProblem(line, self._path_of(node), "a key must be a plain name, not a list or mapping")
            key = self.construct_object(key_node)
            if not isinstance(key, str):
                raise YamlProblem(line, self._path_of(node), f"key {shown(key)} is read as {_kind(key)}; "
                                                             "keys are names: quote it")
            if key in seen:
                raise YamlProblem(line, self._path_of(node),
                                  f"duplicate key {shown(key)} (first written on line {seen[key]})")
            seen[key] = line
        return super().construct_mapping(node, deep=deep)

    def _paths(self) -> Iterator[tuple[yaml.Node, list[Any]]]:
        """Every node of the composed document with its key path, each shared (aliased) node once."""
        stack: list[tuple[yaml.Node, list[Any]]] = [(self._root, [])] if self._root is not None else []
        visited: set[int] = set()
        while stack:
            node, parts = stack.pop()
            if id(node) in visited:
                continue
            visited.add(id(node))
            yield node, parts
            if isinstance(node, yaml.MappingNode):
                stack += [(v, [*parts, k.value if isinstance(k, yaml.ScalarNode) else "?"]) for k, v in node.value]
            elif isinstance(node, yaml.SequenceNode):
                stack += [(v, [*parts, i]) for i, v in enumerate(node.value)]

    def _path_of(self, target: yaml.Node) -> str:
        return next((key_path(parts) for node, parts in self._paths() if node is target), "(top level)")

    def path_at(self, mark: yaml.Mark) -> str:
        """The key path of the node starting at `mark`, else of the deepest node around it, or ''."""
        at = (mark.line, mark.column)
        starting, around = [], []
        for node, parts in self._paths():
            start, end = (node.start_mark.line, node.start_mark.column), (node.end_mark.line, node.end_mark.column)
            if start == at:
                starting.append(parts)
            elif start <= at < end:
                around.append(parts)
        found = starting or around
        return key_path(max(found, key=len)) if found else ""


_BoundedLoader.add_implicit_resolver("tag:yaml.org,2002:float", _EXPONENT_FLOAT, list("-+0123456789"))
