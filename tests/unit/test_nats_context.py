"""ferry.launcher.nats_context: the file `nats context save` would write, private, credentials split out."""

from __future__ import annotations

import json

import pytest

from ferry.launcher.nats_context import context_dir, save_context

pytestmark = pytest.mark.unit


def test_a_context_is_saved_where_the_cli_looks_with_credentials_split_out(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    assert context_dir() == tmp_path / "nats/context"
    path = save_context("ferry-up", "nats://admin:s3cret@127.0.0.1:4222,nats://admin:s3cret@h2:4223", "test")
    assert path == tmp_path / "nats/context/ferry-up.json"
    saved = json.loads(path.read_text())
    assert saved["url"] == "nats://127.0.0.1:4222,nats://h2:4223"
    assert (saved["user"], saved["password"], saved["token"]) == ("admin", "s3cret", "")
    assert path.stat().st_mode & 0o777 == 0o600
    token = json.loads(save_context("t", "nats://tok@127.0.0.1:4222", "test").read_text())
    assert (token["token"], token["user"], token["url"]) == ("tok", "", "nats://127.0.0.1:4222")


@pytest.mark.parametrize("name", ["../evil", "a/b", ""])
def test_a_name_the_cli_would_refuse_is_an_error(tmp_path, name):
    with pytest.raises(ValueError, match="--nats-context"):
        save_context(name, "nats://127.0.0.1:4222", "test", directory=tmp_path)
