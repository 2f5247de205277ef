"""What the commands read from a person (prompts from arguments, files, stdin) and say back."""

from __future__ import annotations

import io
import types

import pytest

from pagedq.errors import InvalidRequestError
from pagedq.worker.cli.console import event_sentence, finish_sentence, read_prompt, read_prompts


def test_prompt_from_the_argument_file_and_stdin(tmp_path):
    big = "word " * 50_000  # more than a command line can carry
    (tmp_path / "q.txt").write_text(big)
    assert read_prompt("hello") == "hello"
    assert read_prompt(f"@{tmp_path / 'q.txt'}") == big
    assert read_prompt("-", io.StringIO("from stdin\n")) == "from stdin\n"
    assert read_prompt("@@home") == "@home"
    assert read_prompt("@") == "@"


@pytest.mark.parametrize("arg,message", [
    ("", "empty"), ("   \n", "empty"), ("@/nonexistent/prompt.txt", "cannot read the prompt file"),
])
def test_unusable_prompts_say_why(arg, message):
    with pytest.raises(InvalidRequestError, match=message):
        read_prompt(arg, io.StringIO(""))


def test_empty_stdin_and_stdin_twice():
    with pytest.raises(InvalidRequestError, match="standard input is empty"):
        read_prompt("-", io.StringIO(""))
    with pytest.raises(InvalidRequestError, match="only once"):
        read_prompts(["-", "-"], io.StringIO("x"))


def test_events_read_as_sentences():
    usage = {"prompt_tokens": 12, "completion_tokens": 48}
    assert finish_sentence(["stop"], usage) == (
        "done: the model ended its answer (48 tokens generated, prompt 12 tokens)")
    assert "token limit (--max-tokens)" in finish_sentence(["length"], usage)
    both = finish_sentence(["stop", "length"], usage)
    assert "ended its answer" in both and "token limit" in both
    failed = types.SimpleNamespace(type="error", error_code="invalid_params",
                                   error="temperature must be >= 0")
    assert event_sentence(failed) == "failed (invalid_params): temperature must be >= 0"
    for text in (finish_sentence(["stop"], usage), event_sentence(failed)):
        assert "[" not in text and "{" not in text  # no Python reprs
