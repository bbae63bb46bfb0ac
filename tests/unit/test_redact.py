"""ferry.redact: no password or token survives in a URL that is shown."""

from __future__ import annotations

import pytest

from ferry.redact import redact_url

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("nats://worker:s3cret@nats:4222", "nats://worker:***@nats:4222"),
        ("redis://:s3cret@redis:6379/0", "redis://:***@redis:6379/0"),
        ("redis://kvcache:s3cret@redis:6379/0", "redis://kvcache:***@redis:6379/0"),
        ("nats://s3cret@127.0.0.1:4222", "nats://***@127.0.0.1:4222"),  # a token alone
        ("tls://a:s3cret@n1:4222,tls://a:s3cret@n2:4222", "tls://a:***@n1:4222,tls://a:***@n2:4222"),
        ("redis://redis:6379/0?password=s3cret&db=1", "redis://redis:6379/0?password=***&db=1"),
        ("nats://127.0.0.1:4222", "nats://127.0.0.1:4222"),
        ("http://127.0.0.1:8000/v1", "http://127.0.0.1:8000/v1"),
    ],
)
def test_secrets_are_replaced_and_the_rest_kept(url, shown):
    assert redact_url(url) == shown
    assert "s3cret" not in redact_url(url)
