"""JSON Schema under constrained decoding: the keywords xgrammar enforces; check_schema refuses the
rest by name (so a server's 400 can say which), before anything is compiled.
"""
from __future__ import annotations

# JSON Schema keywords xgrammar 0.2.9 enforces (checked by running it: it ignores the others, so
# they are refused; oneOf is taken as anyOf, allOf of one schema and multipleOf of integers only)
KEYWORDS = frozenset((
    "type", "enum", "const", "properties", "required", "additionalProperties", "items",
    "prefixItems", "minItems", "maxItems", "minLength", "maxLength", "pattern", "format",
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "anyOf", "oneOf", "allOf",
    "$ref", "$defs", "definitions", "minProperties", "maxProperties", "patternProperties",
    "propertyNames", "unevaluatedProperties", "unevaluatedItems", "multipleOf"))
ANNOTATIONS = frozenset((
    "title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated",
    "readOnly", "writeOnly", "contentMediaType", "contentEncoding", "nullable", "strict"))
FORMATS = frozenset((
    "email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid", "uri",
    "uri-reference", "uri-template", "json-pointer", "relative-json-pointer"))
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_ONE = ("additionalProperties", "unevaluatedProperties", "unevaluatedItems",
               "propertyNames", "items")


def check_schema(schema, path: str = "#", patterns: list | None = None) -> list:
    """Refuse a JSON schema using a keyword constrained decoding cannot enforce (ValueError
    naming the keyword and where); returns [(path, pattern)] of its regex patterns."""
    patterns = [] if patterns is None else patterns
    if isinstance(schema, bool):
        return patterns
    if not isinstance(schema, dict):
        raise ValueError(f"json schema at {path}: expected an object or a boolean, got "
                         f"{type(schema).__name__}")
    for k, v in schema.items():
        if k in ANNOTATIONS:
            continue
        why = ("is not supported by constrained decoding" if k not in KEYWORDS else
               "with more than one schema is not enforced" if k == "allOf" and len(v or ()) > 1 else
               'is enforced only with "type": "integer"' if k == "multipleOf"
               and schema.get("type") != "integer" else
               f"format {v!r} is not enforced" if k == "format" and v not in FORMATS else None)
        if why is not None:
            raise ValueError(f"json schema keyword {k!r} at {path} {why} (supported keywords: "
                             f"{', '.join(sorted(KEYWORDS))}; formats: {', '.join(sorted(FORMATS))})")
        at = f"{path}/{k}"
        if k in _SCHEMA_MAPS and isinstance(v, dict):
            for name, sub in v.items():
                check_schema(sub, f"{at}/{name}", patterns)
        elif k in _SCHEMA_LISTS and isinstance(v, list) and v:
            for i, sub in enumerate(v):
                check_schema(sub, f"{at}/{i}", patterns)
        elif k in _SCHEMA_ONE:
            check_schema(v, at, patterns)
        elif k in _SCHEMA_MAPS + _SCHEMA_LISTS:
            raise ValueError(f"json schema {k!r} at {path}: expected "
                             + ("an object of schemas" if k in _SCHEMA_MAPS else "a list of schemas"))
        elif k == "pattern":
            if not isinstance(v, str):
                raise ValueError(f"json schema keyword 'pattern' at {path}: expected a string")
            patterns.append((path, v))
    return patterns

