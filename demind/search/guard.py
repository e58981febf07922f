"""What keeps the search server safe to expose: host and origin checks, the access token,
and messages and log lines that leak nothing.

Pure functions (no Flask), used by :mod:`demind.search.server`:

* Host check (DNS rebinding): a page on ``evil.example`` whose name is re-pointed at
  127.0.0.1 reaches the server with ``Host: evil.example``; only the names in the allowed set
  (loopback names and the bound host by default) are answered.
* Origin check (cross-site requests): any page the user visits can POST to 127.0.0.1; a browser
  always sends ``Origin`` with a POST, so one that names another site is refused.
* Token: off loopback every request needs it, as ``Authorization: Bearer TOKEN`` or the cookie
  the page gets after ``/?token=TOKEN``; compared in constant time.
* Messages: absolute paths are cut to their last part, long texts shortened for the log.
"""

from __future__ import annotations

import hmac
import ipaddress
import re
import socket
from urllib.parse import urlsplit

LOOPBACK_NAMES = ("127.0.0.1", "localhost", "::1")
WILDCARD_HOSTS = ("0.0.0.0", "::", "")  # every interface: no single name to allow
ANY_HOST = "*"

_POSIX_PATH = re.compile(r"(?<![\w/.~-])(?:/[^\s'\"/:,;()]+)+/([^\s'\"/:,;()]*)")
_WINDOWS_PATH = re.compile(r"\b[A-Za-z]:\\(?:[^\s'\"\\]+\\)*([^\s'\"\\]*)")


def is_loopback(host: str) -> bool:
    """``127.0.0.1``, ``::1``, ``localhost`` (and the rest of 127/8): serves this machine only."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def host_name(host_header: str) -> str:
    """``"LocalHost:8000"`` -> ``"localhost"``, ``"[::1]:8000"`` -> ``"::1"`` (port and case dropped)."""
    host = host_header.strip().lower()
    if host.startswith("["):
        return host[1:].split("]", 1)[0]
    if host.count(":") == 1:
        host = host.split(":", 1)[0]
    return host.rstrip(".")


def default_allowed_hosts(bound_host: str) -> set[str]:
    """Loopback names, plus the bound host unless it is a wildcard (0.0.0.0 names no host)."""
    allowed = set(LOOPBACK_NAMES)
    if bound_host not in WILDCARD_HOSTS:
        allowed.add(host_name(bound_host))
    return allowed


def host_allowed(host_header: str, allowed: set[str] | frozenset[str]) -> bool:
    """Whether a request's ``Host`` header names an allowed host. ``allowed`` holds names as
    :func:`host_name` gives them (``ServerSettings.hosts`` normalises once, not per request)."""
    return ANY_HOST in allowed or host_name(host_header) in allowed


def origin_allowed(origin: str | None, host_header: str) -> bool:
    """A request without ``Origin`` (curl, scripts) passes; a browser's must name this server."""
    if origin is None:
        return True
    if origin == "null":  # sandboxed frames, file:// pages
        return False
    return urlsplit(origin).netloc.lower() == host_header.strip().lower()


def token_matches(given: str | None, token: str) -> bool:
    """Constant-time comparison, so the time to refuse says nothing about the token."""
    return given is not None and hmac.compare_digest(given.encode("utf-8"), token.encode("utf-8"))


def bearer_token(authorization: str | None) -> str | None:
    """``"Bearer abc"`` -> ``"abc"``; anything else -> None."""
    if authorization and authorization[:7].lower() == "bearer ":
        return authorization[7:].strip()
    return None


def redact_paths(message: str) -> str:
    """Absolute paths cut to their last part: ``"cannot read /srv/photos/a.png"`` -> ``"cannot read a.png"``.

    Messages that reach a browser name the file a user knows, never where the server keeps it."""
    return _WINDOWS_PATH.sub(r"\1", _POSIX_PATH.sub(r"\1", message))


def shorten(text: str, limit: int = 120) -> str:
    """A text for the log: ``text`` itself up to ``limit`` characters, else its start and its length."""
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}... ({len(text):,} characters)"


def bind_problem(host: str, port: int) -> str | None:
    """Why the server cannot listen on ``host``:``port`` (a name that does not resolve, an address of
    no interface here, a port in use or not allowed), else None: tried with a socket of the server's
    kind, bound and closed at once, so ``demind-serve`` says it before any model loads."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as e:
        return f"--host {host!r} is not an address or a name this machine resolves ({e}); give an address of this " \
               f"machine (127.0.0.1, 0.0.0.0 for every interface)"
    family, kind, proto, _, address = infos[0]
    probe = socket.socket(family, kind, proto)
    try:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as waitress binds (TIME_WAIT is no obstacle)
        probe.bind(address)
    except OSError as e:
        return f"cannot listen on {host}:{port} ({e.strerror or e}); give another --port (0: any free one) or a " \
               f"--host address of this machine"
    finally:
        probe.close()
    return None
