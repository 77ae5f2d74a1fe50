"""\\d \\w \\s and their negations read as ASCII in regex constraints (Rust syntax) and JSON-schema patterns
(ECMA-262), outside character sets and inside them; everything else copied as written."""
from __future__ import annotations

import pytest

from engine.sampling.regex_classes import ascii_regex, ascii_schema

WORD, SPACE = "0-9A-Za-z_", "\\t\\n\\v\\f\\r "


@pytest.mark.parametrize("pattern, rust, ecma", [
    (r"\d{4}-\d{2}-\d{2}", "[0-9]{4}-[0-9]{2}-[0-9]{2}", "[0-9]{4}-[0-9]{2}-[0-9]{2}"),
    (r"\w+\s\S", f"[{WORD}]+[{SPACE}][^{SPACE}]", f"[{WORD}]+[{SPACE}][^{SPACE}]"),
    (r"\D\W", f"[^0-9][^{WORD}]", f"[^0-9][^{WORD}]"),
    (r"[\d_.]", "[0-9_.]", "[0-9_.]"),                    # inside a set: the ranges
    (r"[^\s,]", f"[^{SPACE},]", f"[^{SPACE},]"),
    (r"[a\D]", "[a[^0-9]]", r"[a\D]"),                     # Rust nests sets; ECMA keeps the (narrower) class
    (r"[[:alpha:]\d]", "[[:alpha:]0-9]", "[[:alpha:][0-9]]"),  # ECMA: `[` in a set is a member, `]` ends it
    (r"[]\d]", "[]0-9]", "[][0-9]]"),                     # Rust: a first `]` is a member; ECMA: `[]` is empty
    (r"\\d\\\d", r"\\d\\[0-9]", r"\\d\\[0-9]"),             # an escaped backslash is not an escape
    (r"\p{Nd}\x{41}\.\[\d", r"\p{Nd}\x{41}\.\[[0-9]", r"\p{Nd}\x{41}\.\[[0-9]"),  # explicit classes kept
    ("(?x) \\d # a [comment \\w\n\\s", f"(?x) [0-9] # a [comment \\w\n[{SPACE}]", None),
])
def test_perl_classes_become_their_ascii_sets(pattern, rust, ecma):
    assert ascii_regex(pattern) == rust
    if ecma is not None:
        assert ascii_regex(pattern, rust=False) == ecma


def test_schema_patterns_are_rewritten_only_where_the_keywords_hold_schemas():
    schema = {"type": "object",
              "properties": {"pattern": {"type": "string", "pattern": r"^\d+$"},
                             "list": {"type": "array", "items": {"pattern": r"\w"},
                                      "prefixItems": [{"pattern": r"\s"}]}},
              "patternProperties": {r"^\w+$": {"pattern": r"\d"}},
              "anyOf": [{"pattern": r"\d"}], "$defs": {"x": {"not": {"pattern": r"\d"}}},
              "enum": [{"pattern": r"\d"}], "const": {"pattern": r"\d"}, "default": {"pattern": r"\d"}}
    out = ascii_schema(schema)
    assert out["properties"]["pattern"]["pattern"] == "^[0-9]+$"
    assert out["properties"]["list"]["items"]["pattern"] == f"[{WORD}]"
    assert out["properties"]["list"]["prefixItems"][0]["pattern"] == f"[{SPACE}]"
    assert out["patternProperties"] == {f"^[{WORD}]+$": {"pattern": "[0-9]"}}
    assert out["anyOf"][0]["pattern"] == out["$defs"]["x"]["not"]["pattern"] == "[0-9]"
    for data in ("enum", "const", "default"):  # values, not schemas
        assert out[data] == schema[data]
    assert schema["properties"]["pattern"]["pattern"] == r"^\d+$"  # the caller's schema is left as it was
