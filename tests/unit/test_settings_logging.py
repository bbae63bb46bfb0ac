"""ferry.logs: FERRY_LOG_JSON lines carry the request id from the context; text lines show it too."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest

from ferry.logs import request_context, setup_logging

pytestmark = pytest.mark.unit

log = logging.getLogger("ferry.test")


@pytest.fixture(autouse=True)
def restore_root_logger():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def test_json_lines_carry_the_request_id_only_inside_its_context(capsys):
    setup_logging("INFO", json=True)
    log.info("outside")
    with request_context("req-7"):
        log.warning("inside %d", 7)
    lines = json_lines(capsys.readouterr().err)
    assert [(l["msg"], l.get("request_id")) for l in lines] == [("outside", None), ("inside 7", "req-7")]
    assert lines[1]["level"] == "WARNING" and lines[1]["logger"] == "ferry.test"


def test_tasks_started_inside_a_request_keep_its_id(capsys):
    setup_logging("INFO", json=True)

    async def work() -> None:
        await asyncio.sleep(0)
        log.info("in task")

    async def main() -> None:
        with request_context("req-9"):
            task = asyncio.create_task(work())
        await task

    asyncio.run(main())
    (line,) = json_lines(capsys.readouterr().err)
    assert line["request_id"] == "req-9"


def test_exceptions_and_level_filtering(capsys):
    setup_logging("WARNING", json=True)
    log.info("hidden")
    try:
        raise KeyError("k")
    except KeyError:
        log.exception("failed")
    (line,) = json_lines(capsys.readouterr().err)
    assert line["msg"] == "failed" and "KeyError" in line["exc"]


def test_text_mode_shows_the_request_id_and_a_second_setup_replaces_the_first(capsys):
    setup_logging("INFO", json=False)
    setup_logging("INFO", json=False)
    with request_context("req-1"):
        log.info("hello")
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1
    assert "INFO" in lines[0] and "ferry.test: hello [request_id=req-1]" in lines[0]


def test_unknown_level_is_rejected():
    with pytest.raises(ValueError, match="level='LOUD'"):
        setup_logging("LOUD")
