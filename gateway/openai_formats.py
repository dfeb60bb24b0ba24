"""The HTTP API's ways of asking for an output format, translated to one `StructuredOutput` (or none).

    response_format             OpenAI's: {"type": "text" | "json_object" | "json_schema", "json_schema": {...}}
    structured_outputs          vLLM's: {"json": schema, "regex": str, "grammar": str, "json_object": bool}
    guided_json, guided_regex,  vLLM's older top-level fields (what vLLM clients send for regex and grammar;
    guided_grammar              OpenAI has no regex)

At most one format per request. The values are checked for shape here (a 400 naming the field); whether a
schema, regex or grammar compiles is the grammar compiler's to say (core.py asks it before routing).
Options vLLM has and we do not (choice, structural_tag, whitespace_pattern) are refused, not ignored: a request
that silently loses its format would return unconstrained text.
"""

from __future__ import annotations

import json
from typing import Any

from shared.errors import InvalidRequestError
from shared.grammar import StructuredOutput

# structured_outputs keys that do not name a format: accepted where they mean what we do anyway (output JSON
# is always compact, and there is no other backend to fall back to).
_NEUTRAL_OPTIONS = {"disable_any_whitespace": (True, False), "disable_fallback": (True, False)}
_UNSUPPORTED = ("choice", "structural_tag", "whitespace_pattern", "disable_additional_properties")
_LEGACY_FORMATS = {"guided_json": "json_schema", "guided_regex": "regex", "guided_grammar": "grammar"}
_LEGACY_UNSUPPORTED = ("guided_choice", "guided_whitespace_pattern")


def structured_output_from_http(
    response_format: Any, structured_outputs: Any, legacy: dict[str, Any]
) -> StructuredOutput | None:
    """The one format a request asks for. `legacy`: the guided_* fields by name (unset ones None)."""
    found: list[tuple[str, StructuredOutput]] = []
    if response_format is not None:
        constraint = _from_response_format(response_format)
        if constraint is not None:
            found.append(("response_format", constraint))
    if structured_outputs is not None:
        found += _from_structured_outputs(structured_outputs)
    for name in _LEGACY_UNSUPPORTED:
        if legacy.get(name) is not None:
            raise InvalidRequestError(f"{name} is not supported; use guided_regex or structured_outputs.regex")
    for name, kind in _LEGACY_FORMATS.items():
        value = legacy.get(name)
        if value is not None:
            found.append((name, _constraint(name, kind, value)))
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise InvalidRequestError(f"set at most one output format per request, got {len(found)}: {names}")
    return found[0][1] if found else None


def _from_response_format(value: Any) -> StructuredOutput | None:
    if not isinstance(value, dict):
        raise InvalidRequestError("response_format must be an object with a type, e.g. {'type': 'json_object'}")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json_object")
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise InvalidRequestError(
                "response_format.json_schema must be an object: {'name': ..., 'schema': {...}, 'strict': true}"
            )
        if "name" in spec and not isinstance(spec["name"], str):
            raise InvalidRequestError("response_format.json_schema.name must be a string")
        if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
            raise InvalidRequestError("response_format.json_schema.strict must be true or false")
        if "schema" not in spec:
            raise InvalidRequestError("response_format.json_schema.schema is missing: give the JSON Schema there")
        return _json_schema("response_format.json_schema.schema", spec["schema"], text_allowed=False)
    raise InvalidRequestError(
        f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}"
        + (" (structural_tag is not supported)" if kind == "structural_tag" else "")
    )


def _from_structured_outputs(value: Any) -> list[tuple[str, StructuredOutput]]:
    if not isinstance(value, dict):
        raise InvalidRequestError("structured_outputs must be an object, e.g. {'regex': '[0-9]+'}")
    found: list[tuple[str, StructuredOutput]] = []
    for key, item in value.items():
        name = f"structured_outputs.{key}"
        if item is None:
            continue
        if key == "json":
            found.append((name, _json_schema(name, item, text_allowed=True)))
        elif key in ("regex", "grammar"):
            found.append((name, _constraint(name, key, item)))
        elif key == "json_object":
            if not isinstance(item, bool):
                raise InvalidRequestError(f"{name} must be true or false")
            if item:
                found.append((name, StructuredOutput("json_object")))
        elif key in _NEUTRAL_OPTIONS:
            if item not in _NEUTRAL_OPTIONS[key]:
                raise InvalidRequestError(f"{name} must be true or false")
        elif key in _UNSUPPORTED:
            raise InvalidRequestError(f"{name} is not supported (supported: json, json_object, regex, grammar)")
        else:
            raise InvalidRequestError(f"{name} is not a structured_outputs field (json, json_object, regex, grammar)")
    return found


def _constraint(name: str, kind: str, value: Any) -> StructuredOutput:
    if kind == "json_schema":
        return _json_schema(name, value, text_allowed=True)
    if not isinstance(value, str):
        raise InvalidRequestError(f"{name} must be a string")
    return StructuredOutput(kind, value)


def _json_schema(name: str, schema: Any, text_allowed: bool) -> StructuredOutput:
    """A schema object (or true/false) serialized as JSON text, key order kept (properties are generated in
    the schema's order); vLLM's fields also take the schema as JSON text, passed on as is."""
    if isinstance(schema, str) and text_allowed:
        return StructuredOutput("json_schema", schema)
    if not isinstance(schema, dict | bool):
        what = "a JSON Schema object (or its JSON text)" if text_allowed else "a JSON Schema object"
        raise InvalidRequestError(f"{name} must be {what}, got {type(schema).__name__}")
    return StructuredOutput("json_schema", json.dumps(schema, separators=(",", ":"), ensure_ascii=False))
