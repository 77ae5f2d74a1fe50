"""ASCII meanings for the Perl classes of a constraint's patterns.

llguidance's regexes follow Rust's, where `\\d`, `\\w` and `\\s` are Unicode classes (`\\d{4}` takes '۴᱁9൪'),
and its JSON-schema patterns read `\\s` as ECMA-262's Unicode white space. What a user means by them is
ASCII, as JSON Schema's patterns (ECMA-262) read `\\d` and `\\w`: this rewrites each of the six classes as
the ASCII class it names, outside character sets as a set, inside one as its ranges. Everything else is
copied as written; an explicit Unicode class (`\\p{Nd}`) keeps its meaning.
"""
from __future__ import annotations

import re

# each class's ASCII members, as the inside of a character set (the same text in Rust's and ECMA's syntax)
ASCII_CLASSES = {"d": "0-9", "w": "0-9A-Za-z_", "s": "\\t\\n\\v\\f\\r "}
# (?x) switches on comments (`# ...` to the end of the line), where a `[` opens nothing
_VERBOSE_FLAG = re.compile(r"\(\?[a-zA-Z]*x")
# JSON Schema keywords whose value is a schema, a list of schemas, or a map of names to schemas
_SUBSCHEMA = {"items", "additionalItems", "additionalProperties", "contains", "propertyNames", "not", "if",
              "then", "else", "unevaluatedItems", "unevaluatedProperties"}
_SUBSCHEMA_LISTS = {"anyOf", "oneOf", "allOf", "prefixItems"}
_SUBSCHEMA_MAPS = {"properties", "$defs", "definitions", "dependentSchemas"}


def ascii_regex(pattern: str, rust: bool = True) -> str:
    """`pattern` with \\d \\w \\s \\D \\W \\S as ASCII classes. rust: Rust's syntax, where sets nest (`[a[^0-9]]`);
    else ECMA-262's, where they do not, and a negated class inside a set is kept (its Unicode reading
    allows less than the ASCII one, never more)."""
    out, depth, i = [], 0, 0
    verbose = rust and _VERBOSE_FLAG.search(pattern) is not None
    while i < len(pattern):
        c = pattern[i]
        if c == "\\" and i + 1 < len(pattern):
            out.append(_class(pattern[i + 1], depth > 0, rust))
            i += 2
        elif c == "#" and verbose and depth == 0:  # a comment: copied to the end of its line
            end = pattern.find("\n", i)
            end = len(pattern) if end < 0 else end
            out.append(pattern[i:end])
            i = end
        elif c == "[" and rust and depth and pattern.startswith("[:", i) and ":]" in pattern[i:]:
            end = pattern.index(":]", i) + 2  # a POSIX class ([:digit:]) inside a set
            out.append(pattern[i:end])
            i = end
        elif c == "[" and (depth == 0 or rust):
            start = i + 1 + pattern.startswith("^", i + 1)
            start += rust and pattern.startswith("]", start)  # Rust: a `]` first in a set is a member
            out.append(pattern[i:start])
            depth, i = depth + 1, start
        else:
            depth -= c == "]" and depth > 0
            out.append(c)
            i += 1
    return "".join(out)


def _class(letter: str, inside: bool, rust: bool) -> str:
    """The text for the escape `\\<letter>`: an ASCII set for a Perl class, else the escape itself."""
    members = ASCII_CLASSES.get(letter.lower())
    if members is None:
        return "\\" + letter
    if letter.islower():
        return members if inside else f"[{members}]"
    if inside and not rust:
        return "\\" + letter
    return f"[^{members}]"


def ascii_schema(schema):
    """A JSON schema with its `pattern`s and `patternProperties`' names read by ascii_regex (ECMA-262),
    walking only where the keywords hold schemas (an `enum` or `const` value is data, kept as given)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key, value in schema.items():
        if key == "pattern" and isinstance(value, str):
            out[key] = ascii_regex(value, rust=False)
        elif key == "patternProperties" and isinstance(value, dict):
            out[key] = {ascii_regex(k, rust=False): ascii_schema(v) for k, v in value.items()}
        elif key in _SUBSCHEMA:
            out[key] = [ascii_schema(v) for v in value] if isinstance(value, list) else ascii_schema(value)
        elif key in _SUBSCHEMA_LISTS and isinstance(value, list):
            out[key] = [ascii_schema(v) for v in value]
        elif key in _SUBSCHEMA_MAPS and isinstance(value, dict):
            out[key] = {k: ascii_schema(v) for k, v in value.items()}
    return out
