"""StructuredOutputsParams: validation, the dict form, and the trip through wire protocol v1."""

from __future__ import annotations

import json

import msgpack
import pytest

from pagedq.client import InvalidParamsError, SamplingParams, StructuredOutputsParams
from pagedq.client.protocol import (
    E_INVALID_PARAMS,
    ProtocolError,
    build_request,
    decode_request,
    encode_request,
)

SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}


@pytest.mark.parametrize("value", [
    {"json": SCHEMA}, {"json": json.dumps(SCHEMA)}, {"json_object": True}, {"regex": "[a-z]+"},
    {"choice": ["yes", "no"]}, {"grammar": 'root ::= "a" | "b"'},
])
def test_each_kind_round_trips_through_the_wire(value):
    params = SamplingParams(structured_outputs=value, max_tokens=8)
    req = build_request("hi", params)
    back = decode_request(encode_request(req))
    assert back.params == params
    assert back.params.structured_outputs == StructuredOutputsParams(**value)
    (kind,) = value
    assert back.params.structured_outputs.kind == kind
    raw = msgpack.unpackb(encode_request(req))
    assert raw["params"]["structured_outputs"] == value  # one field; only the set key travels


def test_dataclass_and_dict_are_interchangeable():
    a = SamplingParams(structured_outputs={"choice": ["x", "y"]})
    b = SamplingParams(structured_outputs=StructuredOutputsParams(choice=["x", "y"]))
    assert a == b and a.to_dict() == b.to_dict()
    assert SamplingParams().to_dict()["structured_outputs"] is None


def test_spec_keeps_property_order_and_ignores_spacing():
    as_dict = StructuredOutputsParams(json=SCHEMA)
    as_text = StructuredOutputsParams(json=json.dumps(SCHEMA, indent=4))
    assert as_dict.spec == as_text.spec
    assert list(json.loads(as_dict.spec)["properties"]) == ["b", "a"]


@pytest.mark.parametrize("value, problem", [
    ({}, "exactly one"),
    ({"regex": "a", "choice": ["a"]}, "exactly one"),
    ({"choice": []}, "non-empty list"),
    ({"choice": "a,b"}, "non-empty list"),
    ({"choice": ["a", 3]}, "non-empty strings"),
    ({"choice": ["a", ""]}, "non-empty strings"),
    ({"regex": ""}, "non-empty string"),
    ({"grammar": 5}, "non-empty string"),
    ({"json": "{not json"}, "not valid JSON"),
    ({"json": "[1, 2]"}, "JSON Schema object"),
    ({"json": 3}, "JSON Schema object"),
    ({"json_object": False}, "exactly one"),
    ({"json_object": "yes"}, "json_object"),
    ({"jsonschema": {}}, "unknown structured_outputs keys"),
    ("[a-z]+", "must be a dict"),
])
def test_invalid_values_name_the_problem(value, problem):
    with pytest.raises(InvalidParamsError, match=problem):
        SamplingParams(structured_outputs=value)


def test_a_bad_constraint_on_the_wire_is_invalid_params():
    payload = msgpack.unpackb(encode_request(build_request("hi", SamplingParams())))
    payload["params"]["structured_outputs"] = {"choice": []}
    with pytest.raises(ProtocolError, match="non-empty list") as info:
        decode_request(msgpack.packb(payload))
    assert info.value.code == E_INVALID_PARAMS
