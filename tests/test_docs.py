"""The README and docs/ as a reader uses them: every relative link and anchor resolves, every
file path the architecture map names exists, and the README's runnable snippets run."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.cli.conftest import restore_logging  # noqa: F401  (autouse: plan configures logging)

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"```(\w*)\n(.*?)```", re.S)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to dashes."""
    # an underscore inside a word (Q6_K) is text, kept; one at a word's edge is emphasis
    text = re.sub(r"[`*]|(?<!\w)_|_(?!\w)", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    return {slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text, re.M)}


def links(page: Path) -> list[str]:
    return LINK.findall(FENCE.sub("", page.read_text()))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(page: Path):
    broken = []
    for target in links(page):
        if re.match(r"[a-z]+://|mailto:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no file {dest.relative_to(ROOT)}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.name}")
    assert not broken, f"{page.name}: " + "; ".join(broken)


def test_every_doc_is_reachable_from_the_readme():
    reached = {(ROOT / "README.md").resolve()}
    frontier = [ROOT / "README.md"]
    while frontier:
        page = frontier.pop()
        for target in links(page):
            dest = (page.parent / target.partition("#")[0]).resolve()
            if dest.suffix == ".md" and dest.exists() and dest not in reached:
                reached.add(dest)
                frontier.append(dest)
    assert {p.resolve() for p in PAGES} <= reached


def test_architecture_map_names_existing_files():
    """Every path in the architecture page's module map and picture is a file or folder."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    named = set(re.findall(r"\b((?:client|worker|kernels|gateway|bench|pagedq|tests)/[\w/.*]+)", text))
    assert len(named) > 20
    missing = []
    for path in named - {"pagedq/x/y.py", "tests/x/test_y.py"}:  # the naming rule's pattern
        path = path.rstrip(".")
        if "*" in path:
            ok = any(ROOT.glob(path))
        else:
            ok = (ROOT / path).exists()
        if not ok:
            missing.append(path)
    assert not missing, missing


def test_readme_front_page_fits_two_screens():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 130, f"README.md has {len(lines)} lines; move detail to docs/"


# -- the README's commands and snippets ----------------------------------------------------------
def readme_blocks(lang: str) -> list[str]:
    return [body for kind, body in FENCE.findall((ROOT / "README.md").read_text()) if kind == lang]


def readme_pagedq_commands() -> list[list[str]]:
    import shlex

    lines = [part.strip() for block in readme_blocks("bash") for line in block.splitlines()
             for part in line.split("#")[0].split("&&")]
    return [shlex.split(line)[1:] for line in lines if line.startswith("pagedq ")]


def test_every_pagedq_command_in_the_readme_parses():
    """Each `pagedq ...` line of the README names a real command with real flags."""
    from pagedq.worker.cli import build_parser

    commands = readme_pagedq_commands()
    assert {c[0] for c in commands} >= {"demo", "chat", "generate", "worker", "submit", "stats",
                                         "plan", "bench"}
    for argv in commands:
        args = build_parser().parse_args(argv)
        assert callable(args.func), argv


def test_readme_sizing_example_is_what_plan_prints(capsys):
    """The worked example's figures (SmolLM2, 32 jobs of 1,024 tokens) come from `pagedq plan`."""
    from pagedq.worker.cli import main

    assert main(["plan", "--concurrency", "32", "--seq-len", "1024", "--dtype", "float32",
                 "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert main(["plan", "--dtype", "float32", "--device", "cpu", "--quantization", "none"]) == 0
    out_fp32 = capsys.readouterr().out
    readme = (ROOT / "README.md").read_text()
    for figure in ("2 x 30 layers x 3 KV heads x 64 x 4 B = 46,080 B", "1.41 GiB",
                   "Q4_1.gguf kept packed", "0.10 GB"):
        assert figure in out, figure
    assert "134.5 M parameters x 4 B (float32) = 0.54 GB" in out_fp32
    for figure in ("2 × 30 × 3 × 64 × 4 B = 46,080 B", "1.41 GiB", "0.10 GB",
                   "135 M × 4 B = 0.54 GB"):
        assert figure in readme, figure


def test_readme_sdk_snippet_runs(redis_db, tiny_text_model_dir, capsys, monkeypatch, tmp_path):
    """The README's Python snippet, as written, against a real Redis and a worker on a tiny
    model: ``Client()`` with no URL finds the Redis a local worker advertises, as `pagedq
    submit` does (or $REDIS_URL when the suite runs against an external one)."""
    import json

    from pagedq.redis_url import ADVERTISED_FILE
    from tests.service.harness import running_worker

    (snippet,) = [b for b in readme_blocks("python") if "Client(" in b]
    assert "Client()" in snippet
    monkeypatch.setenv("PAGEDQ_CACHE", str(tmp_path))
    if redis_db.startswith("redis://127.0.0.1:"):
        monkeypatch.delenv("REDIS_URL", raising=False)
        (tmp_path / ADVERTISED_FILE).write_text(json.dumps({"url": redis_db}))
    else:
        monkeypatch.setenv("REDIS_URL", redis_db)
    with running_worker(redis_db, str(tiny_text_model_dir), "docs"):
        exec(compile(snippet, "README.md", "exec"), {})
    out = capsys.readouterr().out
    assert "'prompt_tokens'" in out and (": stop" in out or ": length" in out)


def test_readme_acl_advice_is_enough_for_a_worker_and_a_client(tiny_text_model_dir):
    """"An ACL user limited to ~pagedq:*" (the README's Secure Redis): a worker and a client
    that may touch only the queue's keys still claim, stream, cancel and report."""
    import redis

    from pagedq.client import Client, SamplingParams
    from pagedq.embedded_redis import EmbeddedRedis
    from tests.service.harness import running_worker

    assert "`~pagedq:*`" in (ROOT / "README.md").read_text()
    with EmbeddedRedis.start(password="") as server:
        admin = redis.Redis.from_url(server.url)
        admin.execute_command("ACL", "SETUSER", "pagedq", "on", ">pw", "~pagedq:*", "+@all")
        admin.execute_command("ACL", "SETUSER", "default", "off")
        url = server.url.replace("redis://", "redis://pagedq:pw@")
        with running_worker(url, str(tiny_text_model_dir), "acl"), Client(url) as client:
            done = client.submit("Hello", SamplingParams(max_tokens=4, ignore_eos=True))
            assert done.result(timeout=60).usage["completion_tokens"] == 4
            assert [w["name"] for w in client.stats()["workers"]] == ["acl"]
        with pytest.raises(redis.AuthenticationError):
            redis.Redis.from_url(server.url).ping()  # the default user is off
