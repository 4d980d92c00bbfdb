"""closed_objects on hand-written schemas, each expectation written out: the plainly listed
objects are closed wherever they sit (properties, items, anyOf, $defs), the others are left
open (their own word on other members, a required name or minProperties the listed ones cannot
meet, properties brought from beside or around them), subtrees that select rather than shape
(not, if, oneOf, contains) and values are untouched, and the input is not changed. A closed
schema refuses an extra member that the original takes (jsonschema)."""
import copy

import pytest

from pdserve.structured.json_schema import closed_objects

jsonschema = pytest.importorskip("jsonschema")

S = {"type": "string"}
CLOSED = {"additionalProperties": False}


def obj(props, **kw):
    return {"type": "object", "properties": props, **kw}


CASES = [
    # LangChain's tool parameters (pydantic, no additionalProperties)
    ("tool", obj({"city": S, "days": {"type": "integer"}}, required=["city", "days"]),
     obj({"city": S, "days": {"type": "integer"}}, required=["city", "days"], **CLOSED)),
    ("nested", obj({"a": obj({"b": S}), "l": {"type": "array", "items": obj({"c": S})},
                    "t": {"prefixItems": [obj({"d": S})]}}),
     obj({"a": obj({"b": S}, **CLOSED), "l": {"type": "array", "items": obj({"c": S}, **CLOSED)},
          "t": {"prefixItems": [obj({"d": S}, **CLOSED)]}}, **CLOSED)),
    # pydantic's Optional[Model] and its $defs
    ("defs", {"$defs": {"M": obj({"x": S})}, **obj({"m": {"anyOf": [{"$ref": "#/$defs/M"},
                                                                       {"type": "null"}]}})},
     {"$defs": {"M": obj({"x": S}, **CLOSED)},
      **obj({"m": {"anyOf": [{"$ref": "#/$defs/M"}, {"type": "null"}]}}, **CLOSED)}),
    ("anyOf members", {"anyOf": [obj({"a": S}), obj({"b": S})]},
     {"anyOf": [obj({"a": S}, **CLOSED), obj({"b": S}, **CLOSED)]}),
    ("extra schema", obj({"a": S}, additionalProperties=obj({"b": S})),
     obj({"a": S}, additionalProperties=obj({"b": S}, **CLOSED))),
    # left open: what the object says of other members, and objects that cannot be closed
    ("its own word", obj({"a": S}, additionalProperties=True),
     obj({"a": S}, additionalProperties=True)),
    ("unevaluated", obj({"a": S}, unevaluatedProperties=S), obj({"a": S}, unevaluatedProperties=S)),
    ("patterns", obj({"a": S}, patternProperties={"^x": S}),
     obj({"a": S}, patternProperties={"^x": S})),
    ("required elsewhere", obj({"a": S}, required=["a", "b"]), obj({"a": S}, required=["a", "b"])),
    ("minProperties", obj({"a": S}, minProperties=2), obj({"a": S}, minProperties=2)),
    ("no properties", {"type": "object"}, {"type": "object"}),
    ("allOf members", {"allOf": [obj({"a": S}), obj({"b": S})]},
     {"allOf": [obj({"a": S}), obj({"b": S})]}),
    ("beside a $ref", {"$defs": {"M": obj({"x": S})}, "$ref": "#/$defs/M", "properties": {"y": S}},
     {"$defs": {"M": obj({"x": S}, **CLOSED)}, "$ref": "#/$defs/M", "properties": {"y": S}}),
    ("anyOf beside properties", obj({"a": S}, anyOf=[obj({"b": S})]),
     obj({"a": S}, anyOf=[obj({"b": S})])),
    ("anyOf beside required", {"required": ["a"], "anyOf": [obj({"a": S}), obj({"b": S})]},
     {"required": ["a"], "anyOf": [obj({"a": S}), obj({"b": S})]}),
    ("then", {"if": obj({"k": {"const": 1}}), "then": obj({"a": S}), "else": obj({"b": S})},
     {"if": obj({"k": {"const": 1}}), "then": obj({"a": S}), "else": obj({"b": S})}),
    # selecting subtrees left whole, and $defs a $ref from them may reach
    ("not", obj({"a": {"not": obj({"b": S})}}), obj({"a": {"not": obj({"b": S})}}, **CLOSED)),
    ("oneOf", {"oneOf": [obj({"a": S}), obj({"b": S})]},
     {"oneOf": [obj({"a": S}), obj({"b": S})]}),
    ("contains", {"type": "array", "contains": obj({"a": S}), "maxContains": 1},
     {"type": "array", "contains": obj({"a": S}), "maxContains": 1}),
    ("defs with not", {"$defs": {"M": obj({"x": S})}, **obj({"m": {"not": {"$ref": "#/$defs/M"}}})},
     {"$defs": {"M": obj({"x": S})}, **obj({"m": {"not": {"$ref": "#/$defs/M"}}}, **CLOSED)}),
    # values are not schemas; a property named like a keyword is a property
    ("values", obj({"a": {"const": {"properties": {}}, "default": {"properties": {}},
                          "enum": [{"properties": {}}]}}),
     obj({"a": {"const": {"properties": {}}, "default": {"properties": {}},
                "enum": [{"properties": {}}]}}, **CLOSED)),
    ("keyword names", obj({"properties": obj({"x": S}), "allOf": S}),
     obj({"properties": obj({"x": S}, **CLOSED), "allOf": S}, **CLOSED)),
    ("not a schema", True, True),
]


@pytest.mark.parametrize("schema, want", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_closed_objects(schema, want):
    before = copy.deepcopy(schema)
    assert closed_objects(schema) == want
    assert schema == before


def test_a_closed_object_refuses_what_the_open_one_takes():
    schema = CASES[0][1]
    value = {"city": "Paris", "days": 3, "population_thousands": 200}
    jsonschema.validate(value, schema)
    with pytest.raises(jsonschema.ValidationError, match="population_thousands"):
        jsonschema.validate(value, closed_objects(schema))
