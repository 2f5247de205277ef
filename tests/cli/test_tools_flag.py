"""``pagedq chat --tools FILE``: the reply's calls, each valid against its function's schema."""

from __future__ import annotations

import json

import jsonschema

from pagedq.worker.cli import main
from tests.engine.structured_cases import build_random_model
from tests.gateway.test_tools import SCHEMAS, TOOLS


def test_chat_with_tools_prints_valid_calls(tmp_path, capsys):
    model = build_random_model(tmp_path / "model")
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps({"tools": TOOLS}))
    code = main(["chat", "Weather in Paris?", "What is 2 + 3?", "--model", str(model), "--json",
                 "--tools", str(tools), "--tool-choice", "required", "--temperature", "1.0",
                 "--seed", "1", "--max-tokens", "160", "--num-kv-blocks", "256"])
    assert code == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(lines) == 2
    for line in lines:
        if line["finish_reason"] == "stop":
            assert line["tool_calls"]
        for call in line["tool_calls"]:
            fn = call["function"]
            jsonschema.validate(json.loads(fn["arguments"]), SCHEMAS[fn["name"]])


def test_bad_tools_fail_before_the_model_loads(tmp_path, capsys):
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps(TOOLS))
    assert main(["chat", "hi", "--tools", str(tools), "--tool-choice", "nope"]) == 2
    assert "tool_choice" in capsys.readouterr().err
    assert main(["chat", "hi", "--tools", str(tmp_path / "missing.json")]) == 2
    assert "--tools" in capsys.readouterr().err


def test_bad_chat_template_kwargs_fail_before_the_model_loads(tmp_path, capsys):
    for bad, says in (("{nope", "JSON object"), ("[1]", "JSON object"),
                      ('{"tools": 1}', "may not set")):
        assert main(["chat", "hi", "--model", str(tmp_path / "absent"),
                     "--chat-template-kwargs", bad]) == 2
        assert says in capsys.readouterr().err
