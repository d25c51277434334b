"""What a webhook receiver and a log reader get from hostile input: `verify_signature` answers False
to anything malformed (it never raises inside a receiver), and a URL is only ever shown redacted."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import pytest

from tasks.judge.notify import sign, verify_signature
from tasks.runtime.redact import redacted_url

SECRET = "s3cret"
BODY = b'{"event": "engine.promoted"}'


def signed(delivery_id: str = "d1", timestamp: str | None = None) -> dict[str, str]:
    timestamp = timestamp or str(int(time.time()))
    return {"X-Smelter-Delivery-Id": delivery_id, "X-Smelter-Timestamp": timestamp,
            "X-Smelter-Signature": sign(SECRET, delivery_id, timestamp, BODY)}


def test_a_genuine_delivery_verifies() -> None:
    assert verify_signature(SECRET, signed(), BODY)
    assert verify_signature(SECRET, signed(delivery_id="dé-1"), bytearray(BODY))


MALFORMED: dict[str, tuple[Any, Any, Any]] = {
    "no headers": (SECRET, {}, BODY),
    "headers are None": (SECRET, None, BODY),
    "headers are a list": (SECRET, [("X-Smelter-Timestamp", "1")], BODY),
    "non-text header names": (SECRET, {1: "a", 2: "b"}, BODY),
    "missing signature": (SECRET, {k: v for k, v in signed().items() if k != "X-Smelter-Signature"}, BODY),
    "missing timestamp": (SECRET, {k: v for k, v in signed().items() if k != "X-Smelter-Timestamp"}, BODY),
    "missing delivery id": (SECRET, {k: v for k, v in signed().items() if k != "X-Smelter-Delivery-Id"}, BODY),
    "empty signature": (SECRET, signed() | {"X-Smelter-Signature": ""}, BODY),
    "non-ASCII signature": (SECRET, signed() | {"X-Smelter-Signature": "v1,é" * 10}, BODY),
    "bytes signature": (SECRET, signed() | {"X-Smelter-Signature": b"v1,abc"}, BODY),
    "400-digit timestamp": (SECRET, signed() | {"X-Smelter-Timestamp": "9" * 400}, BODY),
    "non-numeric timestamp": (SECRET, signed() | {"X-Smelter-Timestamp": "yesterday"}, BODY),
    "negative timestamp": (SECRET, signed() | {"X-Smelter-Timestamp": "-5"}, BODY),
    "padded timestamp": (SECRET, signed(timestamp=f" {int(time.time())} "), BODY),
    "Arabic-Indic digits": (SECRET, signed(timestamp="١٧٠٠٠٠٠٠٠٠"), BODY),
    "float timestamp": (SECRET, signed(timestamp=f"{time.time():.3f}"), BODY),
    "lone surrogate in id": (SECRET, signed() | {"X-Smelter-Delivery-Id": "\ud800"}, BODY),
    "huge header": (SECRET, signed() | {"X-Smelter-Signature": "v1," + "A" * 100_000}, BODY),
    "text body": (SECRET, signed(), BODY.decode()),
    "None body": (SECRET, signed(), None),
    "empty secret": ("", signed(), BODY),
    "bytes secret": (SECRET.encode(), signed(), BODY),
    "None secret": (None, signed(), BODY),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_input_is_false_never_an_exception(case: str) -> None:
    secret, headers, body = MALFORMED[case]
    assert verify_signature(secret, headers, body) is False


def test_a_mapping_that_raises_is_false() -> None:
    class Hostile(Mapping):
        def __getitem__(self, key: str) -> str:
            raise TypeError("no")

        def __iter__(self):  # noqa: ANN204
            raise TypeError("no")

        def __len__(self) -> int:
            return 1

    assert verify_signature(SECRET, Hostile(), BODY) is False


@pytest.mark.parametrize("url, shown", [
    ("https://deploy.example/hooks/engines?token=abc", "https://deploy.example/…#"),
    ("https://user:pa55@deploy.example:8443/t0k3n", "https://deploy.example:8443/…#"),
    ("https://deploy.example:secret-port/x", "https://<host>/…#"),
    ("http://[::1]:9/x", "http://[::1]:9/…#"),
    ("http://[::1/x", "<invalid URL>/…#"),
    ("ftp ://we ird/\ud800", "<scheme>://<host>/…#"),
    ("", "<scheme>://<host>/…#"),
])
def test_a_url_is_shown_without_what_may_carry_a_token(url: str, shown: str) -> None:
    redacted = redacted_url(url)
    assert redacted.startswith(shown)
    assert len(redacted.rpartition("#")[2]) == 16
    for secret in ("abc", "pa55", "t0k3n", "secret-port", "hooks"):
        assert secret not in redacted
    assert redacted_url(url) == redacted and redacted_url(url + "x") != redacted
