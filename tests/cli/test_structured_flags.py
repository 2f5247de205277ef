"""--json-schema / --json-object / --regex / --choice / --grammar on generate and submit."""

from __future__ import annotations

import json

import pytest

from pagedq.errors import InvalidParamsError
from pagedq.worker.cli import build_parser, main
from pagedq.worker.cli.flags import sampling_params
from tests.engine.structured_cases import GRAMMAR, SMALL, build_random_model, is_valid


def structured(command: str, *flags: str) -> dict | None:
    args = build_parser().parse_args([command, "hi", *flags])
    so = sampling_params(args, {}).structured_outputs
    return None if so is None else so.to_dict()


@pytest.mark.parametrize("command", ["generate", "chat", "submit"])
def test_each_flag_builds_its_constraint(command, tmp_path):
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SMALL))
    grammar = tmp_path / "sum.ebnf"
    grammar.write_text(GRAMMAR)
    assert structured(command) is None
    assert structured(command, "--json-schema", str(schema)) == {"json": json.dumps(SMALL)}
    assert structured(command, "--json-object") == {"json_object": True}
    assert structured(command, "--regex", "[0-9]+") == {"regex": "[0-9]+"}
    assert structured(command, "--choice", "yes,no,maybe") == {"choice": ["yes", "no", "maybe"]}
    assert structured(command, "--grammar", str(grammar)) == {"grammar": GRAMMAR}


def test_flags_exclude_each_other_and_bad_values_name_the_problem(tmp_path):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "hi", "--regex", "a", "--choice", "a,b"])
    with pytest.raises(InvalidParamsError, match="--json-schema .*missing.json"):
        structured("generate", "--json-schema", str(tmp_path / "missing.json"))
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(InvalidParamsError, match="not valid JSON"):
        structured("submit", "--json-schema", str(tmp_path / "bad.json"))
    with pytest.raises(InvalidParamsError, match="non-empty list"):
        structured("generate", "--choice", ",")


def test_generate_prints_a_valid_output(tmp_path, capsys):
    model = build_random_model(tmp_path / "model")
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SMALL))
    code = main(["generate", "Fill in:", "Record:", "--model", str(model), "--json",
                 "--json-schema", str(schema), "--temperature", "1.0", "--seed", "3",
                 "--max-tokens", "96", "--num-kv-blocks", "128"])
    assert code == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(lines) == 2
    for line in lines:
        assert line["finish_reason"] == "stop" and is_valid({"json": SMALL}, line["text"])
    code = main(["generate", "Hi", "--model", str(model), "--regex", "a(b"])
    assert code == 2 and "parenthesis" in capsys.readouterr().err
