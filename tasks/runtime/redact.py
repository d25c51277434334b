"""URLs as smelter shows them: a webhook URL's path, query or userinfo may carry a token."""

from __future__ import annotations

import hashlib
import re
from urllib.parse import urlsplit

_HOST_PORT = re.compile(r"(?:[A-Za-z0-9][A-Za-z0-9.-]{0,252}|\[[0-9A-Fa-f:.]{2,45}\])(?::[0-9]{1,5})?")
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]{0,19}")


def redacted_url(url: str) -> str:
    """scheme://host[:port]/…#<16 hex digits of the URL's sha256>, for any input; never raises.

    The hash tells configured webhooks apart without storing or printing the URL itself.
    """
    digest = hashlib.sha256(url.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    try:
        parts = urlsplit(url)
    except ValueError:
        return f"<invalid URL>/…#{digest}"
    scheme = parts.scheme if _SCHEME.fullmatch(parts.scheme) else "<scheme>"
    host = parts.netloc.rpartition("@")[2]
    return f"{scheme}://{host if _HOST_PORT.fullmatch(host) else '<host>'}/…#{digest}"
