"""Typed JSON values for the job schema (:mod:`fedpartial.flare.job_schema`): each type says why
a value does not fit (``""`` when it does), so a refusal can name the argument, the value and the
rule. Plain Python; strings never hold braces unless a type says so (FLARE would fill them in)."""
from __future__ import annotations

import re
from typing import Dict, Optional, Sequence


def show(value) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


def has_braces(value) -> bool:
    return isinstance(value, str) and ("{" in value or "}" in value)


class Spec:
    settable = True

    def why(self, value) -> str:  # pragma: no cover - every spec overrides it
        raise NotImplementedError

    def describe(self) -> str:  # pragma: no cover
        raise NotImplementedError


class Int(Spec):
    def __init__(self, lo: int, hi: int):
        self.lo, self.hi = lo, hi

    def why(self, value):
        if isinstance(value, bool) or not isinstance(value, int):
            return "must be an integer"
        return "" if self.lo <= value <= self.hi else f"must be in [{self.lo}, {self.hi}]"

    def describe(self):
        return f"integer in [{self.lo}, {self.hi}]"


class Num(Spec):
    """A finite number in [lo, hi]; ``open_lo`` / ``open_hi`` exclude the bound."""

    def __init__(self, lo: float, hi: float, open_lo: bool = False, open_hi: bool = False):
        self.lo, self.hi, self.open_lo, self.open_hi = lo, hi, open_lo, open_hi

    def why(self, value):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
            return "must be a number"
        low = value > self.lo if self.open_lo else value >= self.lo
        high = value < self.hi if self.open_hi else value <= self.hi
        return "" if low and high else f"must be in {self.describe()[7:]}"

    def describe(self):
        return f"number {'(' if self.open_lo else '['}{self.lo}, {self.hi}{')' if self.open_hi else ']'}"


class Bool(Spec):
    def why(self, value):
        return "" if isinstance(value, bool) else "must be true or false"

    def describe(self):
        return "true / false"


class Choice(Spec):
    def __init__(self, *values):
        self.values = tuple(values)

    def why(self, value):
        ok = any(value == v and type(value) is type(v) for v in self.values)
        return "" if ok else f"must be one of {list(self.values)}"

    def describe(self):
        return f"one of {list(self.values)}"


class Text(Spec):
    """A plain string matching ``pattern`` (no braces: nothing for FLARE to fill in)."""

    def __init__(self, pattern: str = r"[^{}\x00-\x1f]*", what: str = "plain text", max_len: int = 200,
                 site_placeholder: bool = False):
        self.pattern, self.what, self.max_len = re.compile(pattern), what, max_len
        self.site_placeholder = site_placeholder  # the pattern admits fedpartial's own {site}

    def why(self, value):
        if not isinstance(value, str):
            return "must be a string"
        if len(value) > self.max_len:
            return f"must be at most {self.max_len} characters"
        plain = self.site_placeholder or not has_braces(value)
        return "" if self.pattern.fullmatch(value) and plain else f"must be {self.what}"

    def describe(self):
        return self.what


NAME = Text(r"[A-Za-z_][A-Za-z0-9_.-]{0,63}", "a name (letters, digits, '_', '.', '-')", 64)


class Fixed(Spec):
    """An argument a job may not set: only its default is accepted."""
    settable = False

    def __init__(self, value):
        self.value = value

    def why(self, value):
        return "" if value == self.value and type(value) is type(self.value) else \
            f"is fixed to {self.value!r}: a job may not set it"

    def describe(self):
        return f"fixed: {self.value!r}"


class Maybe(Spec):
    """``spec`` or null."""

    def __init__(self, spec: Spec):
        self.spec = spec

    def why(self, value):
        return "" if value is None else self.spec.why(value)

    def describe(self):
        return f"{self.spec.describe()} or null"


class ListOf(Spec):
    def __init__(self, item: Spec, lo: int = 0, hi: int = 1000):
        self.item, self.lo, self.hi = item, lo, hi

    def why(self, value):
        if not isinstance(value, list):
            return "must be a list"
        if not self.lo <= len(value) <= self.hi:
            return f"must hold {self.lo} to {self.hi} items"
        for i, v in enumerate(value):
            why = self.item.why(v)
            if why:
                return f"item {i} ({show(v)}) {why}"
        return ""

    def describe(self):
        return f"list of {self.lo}-{self.hi} ({self.item.describe()})"


class MapOf(Spec):
    """A dict of plain keys to ``value`` items."""

    def __init__(self, value: Spec, key: Spec = NAME, hi: int = 100):
        self.value, self.key, self.hi = value, key, hi

    def why(self, value):
        if not isinstance(value, dict) or len(value) > self.hi:
            return f"must be a dict of at most {self.hi} entries"
        for k, v in value.items():
            if self.key.why(k):
                return f"key {show(k)} {self.key.why(k)}"
            if self.value.why(v):
                return f"entry {show(k)} {self.value.why(v)}"
        return ""

    def describe(self):
        return f"dict of {self.key.describe()} -> {self.value.describe()}"


class AnyOf(Spec):
    def __init__(self, *specs: Spec):
        self.specs = specs

    def why(self, value):
        whys = [s.why(value) for s in self.specs]
        return "" if any(w == "" for w in whys) else " or ".join(whys)

    def describe(self):
        return " or ".join(s.describe() for s in self.specs)


class Record(Spec):
    """A dict with named fields, each its own spec; unknown fields are refused."""

    def __init__(self, fields: Dict[str, Spec], required: Sequence[str] = ()):
        self.fields, self.required = fields, tuple(required)

    def why(self, value):
        if not isinstance(value, dict):
            return "must be a dict"
        missing = [k for k in self.required if k not in value]
        if missing:
            return f"lacks {missing}"
        for k, v in value.items():
            spec = self.fields.get(k)
            if spec is None:
                return f"has {show(k)}, which is not one of {sorted(self.fields)}"
            why = spec.why(v)
            if why:
                return f"'{k}' ({show(v)}) {why}"
        return ""

    def describe(self):
        return "dict of " + ", ".join(self.fields)


class ByKey(Spec):
    """A dict whose fields depend on a sibling value: ``rule_args`` by rule, ``arch_args`` by arch.
    Checked by :class:`Component` / :data:`MODEL` with the sibling known."""

    def __init__(self, tables: Dict[str, Dict[str, Spec]]):
        self.tables = tables

    def record(self, key) -> Optional[Record]:
        table = self.tables.get(key) if isinstance(key, str) else None
        return None if table is None else Record(table)

    def why(self, value):  # the sibling is unknown here: shape only
        return "" if isinstance(value, dict) else "must be a dict"

    def describe(self):
        return "dict, by " + ", ".join(sorted(self.tables))


def any_braces(value) -> bool:
    if isinstance(value, dict):
        return any(has_braces(k) or any_braces(v) for k, v in value.items())
    if isinstance(value, list):
        return any(any_braces(v) for v in value)
    return has_braces(value)
