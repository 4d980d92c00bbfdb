"""JSON-schema rewrites made before a schema becomes a grammar.

closed_objects(schema) closes the objects that list their properties and say nothing of others:
JSON Schema lets such an object hold any further member, and llguidance, which follows the
standard, lets a model write them. A small model given a tool's parameters then writes
"population", "population_thousands", ... until max_tokens (seen with LangChain's
function_calling, whose tool schemas leave additionalProperties out). xgrammar, vLLM's default
engine, closes them (its strict mode); vLLM's guidance backend does so under
disable_additional_properties. A function's arguments have no use for members it did not
declare, so the tool-call constraints close them.

What is closed stays a narrowing of the schema (whatever the closed one accepts, the original
accepts) that is as satisfiable as before:

* only where a subschema shapes what it holds: under properties, items, anyOf, additional-
  Properties and the like. Under not, if, oneOf and contains, a closed object would change
  which instances are selected or counted (so let through what the schema refuses): those
  subtrees are left whole, and so are $defs when such a keyword is anywhere in the schema
  (a $ref from there may reach them);
* an object is closed when it has `properties`, its required names are among them,
  minProperties does not ask for more, and nothing beside or around it brings properties from
  elsewhere: no additionalProperties / unevaluatedProperties / patternProperties, allOf, anyOf,
  oneOf, $ref, if / then / else or dependent* beside it, and it is not itself an allOf member,
  a then / else, or an anyOf member of a schema with object keywords or applicators of its own.

Values (const, enum, default, examples) are never touched.
"""
from __future__ import annotations

from typing import Any

# where subschemas sit: one schema, a list of schemas, a map name -> schema. The ones under a
# combined keyword are joined with what lies beside them, so they are not closed themselves.
_ONE = ("items", "additionalItems", "additionalProperties", "unevaluatedItems",
        "unevaluatedProperties")
_LIST = ("anyOf", "prefixItems", "items")
_MAP = ("properties", "patternProperties")
_COMBINED_ONE = ("then", "else")
_COMBINED_LIST = ("allOf",)
_COMBINED_MAP = ("dependentSchemas",)
_DEFS = ("$defs", "definitions")
# subtrees that select or count instances rather than shape them: left whole
_SELECTING = ("not", "if", "oneOf", "contains")
_OPEN_BESIDE = ("additionalProperties", "unevaluatedProperties", "patternProperties", "allOf",
                "anyOf", "oneOf", "$ref", "$dynamicRef", "if", "then", "else",
                "dependentSchemas", "dependencies", "dependentRequired")
# object keywords and applicators on a schema with anyOf apply to what its members hold
_BESIDE_ANY_OF = ("properties", "required", "minProperties", "maxProperties", "propertyNames",
                  "patternProperties", "additionalProperties", "unevaluatedProperties",
                  "dependentRequired", "dependentSchemas", "dependencies", "allOf", "oneOf",
                  "$ref", "$dynamicRef", "if", "then", "else")


def closed_objects(schema: Any) -> Any:
    """A copy of schema with its plainly listed objects closed (additionalProperties false);
    schema itself is not changed."""
    return _close(schema, closable=True, defs=not _mentions(schema, _SELECTING))


def _close(s: Any, closable: bool, defs: bool) -> Any:
    if not isinstance(s, dict):
        return s
    out = dict(s)

    def sub(v: Any, ok: bool) -> Any:
        return _close(v, ok, defs)

    members_ok = not any(k in s for k in _BESIDE_ANY_OF)
    for keys, ok in ((_ONE, True), (_COMBINED_ONE, False)):
        for k in keys:
            if isinstance(s.get(k), dict):
                out[k] = sub(s[k], ok)
    for keys, ok in ((_LIST, True), (_COMBINED_LIST, False)):
        for k in keys:
            if isinstance(s.get(k), list):
                out[k] = [sub(v, ok and (members_ok or k != "anyOf")) for v in s[k]]
    for keys, ok in ((_MAP, True), (_COMBINED_MAP, False), (_DEFS if defs else (), True)):
        for k in keys:
            if isinstance(s.get(k), dict):
                out[k] = {name: sub(v, ok) for name, v in s[k].items()}
    if closable and not any(k in s for k in _OPEN_BESIDE) and _fits(s):
        out["additionalProperties"] = False
    return out


def _fits(s: dict) -> bool:
    """Whether s lists properties that alone can meet its required and minProperties."""
    names = s.get("properties")
    required, least = s.get("required", []), s.get("minProperties", 0)
    return (isinstance(names, dict) and isinstance(required, list)
            and all(isinstance(r, str) and r in names for r in required)
            and isinstance(least, int) and least <= len(names))


def _mentions(s: Any, words: tuple[str, ...]) -> bool:
    """Whether any object in s has one of words as a key (values included: a cautious yes)."""
    if isinstance(s, dict):
        return any(k in words for k in s) or any(_mentions(v, words) for v in s.values())
    if isinstance(s, list):
        return any(_mentions(v, words) for v in s)
    return False
