"""``hf-hub:ORG/NAME[/SUBFOLDER][@REVISION]`` references: a model or dataset repository on the
Hugging Face Hub, resolved to a local folder.

Every reader that takes a path also takes such a reference: ``--checkpoint`` (and
:func:`demind.checkpoint.load_backbone_and_model`) for a published checkpoint, ``data.shards``
(and every other shard list, :func:`demind.shard_format.resolve_shards`) for published intent
shards. Resolution is ``huggingface_hub.snapshot_download``, so the standard cache
(``HF_HUB_CACHE`` / ``HF_HOME``), offline mode (``HF_HUB_OFFLINE=1``: read the cache only),
tokens and revisions (a branch, tag or commit) behave as in every other Hugging Face library;
the folder is then read exactly as a local one (same identity and integrity checks).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

from demind.errors import DemindError, MissingDependencyError

logger = logging.getLogger(__name__)

HUB_PREFIX = "hf-hub:"
REPO_TYPES = ("model", "dataset")
INSTALL_HINT = "pip install -e '.[hub]' (huggingface_hub, datasets)"

_PART = r"[A-Za-z0-9][A-Za-z0-9._-]*"
_REF = re.compile(rf"^(?P<repo>{_PART}/{_PART})(?P<sub>(/{_PART})*)/?(@(?P<rev>[^@]+))?$")


class HubError(DemindError, OSError):
    """A Hub reference that cannot be resolved: malformed, unknown repository or revision, not in
    the cache while offline, or huggingface_hub missing."""


@dataclass(frozen=True)
class HubRef:
    """A parsed ``hf-hub:`` reference. ``revision`` None is the default branch (``main``)."""

    repo_id: str
    revision: str | None = None
    subfolder: str = ""

    def __str__(self) -> str:
        sub = f"/{self.subfolder}" if self.subfolder else ""
        rev = f"@{self.revision}" if self.revision else ""
        return f"{HUB_PREFIX}{self.repo_id}{sub}{rev}"


def is_hub_ref(spec: object) -> bool:
    """Whether ``spec`` is an ``hf-hub:`` reference (a string starting with the prefix)."""
    return isinstance(spec, str) and spec.startswith(HUB_PREFIX)


def parse_hub_ref(spec: str, setting: str) -> HubRef:
    """``hf-hub:ORG/NAME[/SUBFOLDER][@REVISION]`` -> :class:`HubRef`; a malformed one is a
    :class:`HubError` naming ``setting`` and the expected form."""
    match = _REF.match(spec[len(HUB_PREFIX):]) if is_hub_ref(spec) else None
    if match is None:
        raise HubError(f"{setting}={spec!r} is not a Hub reference; write {HUB_PREFIX}ORG/NAME, "
                       f"{HUB_PREFIX}ORG/NAME@REVISION or {HUB_PREFIX}ORG/NAME/SUBFOLDER@REVISION")
    revision = match["rev"]
    if revision is not None and (problem := revision_problem(revision)):
        raise HubError(f"{setting}={spec!r}: the revision after '@' {problem}; give a branch, tag or commit "
                       f"of the repository, e.g. {HUB_PREFIX}{match['repo']}@main or @v1.0 or @refs/pr/1")
    return HubRef(match["repo"], revision, match["sub"].strip("/"))


_REV_FORBIDDEN = re.compile(r"[\x00-\x20\x7f~^:?*\[\\]")


def revision_problem(revision: str) -> str | None:
    """Why ``revision`` is not a git ref name or commit (git-check-ref-format's rules), or None.

    huggingface_hub joins the revision into cache paths: a leading ``/`` or a ``..`` would
    point it at a folder outside the cache, so these are refused here, naming the setting."""
    if revision.startswith("/") or revision.endswith("/") or "//" in revision:
        return "starts or ends with '/' or holds '//'"
    if ".." in revision or "@{" in revision:
        return "holds '..' or '@{'"
    if bad := _REV_FORBIDDEN.search(revision):
        return f"holds the character {bad.group()!r} (no spaces, control characters or ~^:?*[\\)"
    if any(part.startswith(".") or part.endswith(".lock") for part in revision.split("/")):
        return "has a part starting with '.' or ending in '.lock'"
    return None


PROBE_TIMEOUT_S = 3.0  # a reachable Hub answers a TCP connect in well under a second


def hub_unreachable(timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
    """Why a download from the Hub cannot start now, or None: offline mode (``HF_HUB_OFFLINE=1``, as
    huggingface_hub read it) or no TCP connection to its endpoint (``HF_ENDPOINT``, default
    huggingface.co) within ``timeout_s``. Asked before a download, so that a machine without network
    fails in seconds with one line instead of 30-60 s of retry warnings."""
    try:
        from huggingface_hub import constants
    except ImportError:
        return None  # nothing to download with; the caller names the missing package
    if constants.HF_HUB_OFFLINE:
        return "offline mode is on (HF_HUB_OFFLINE=1)"
    import socket
    import urllib.request
    from urllib.parse import urlsplit

    endpoint = urlsplit(constants.ENDPOINT)
    host, port = endpoint.hostname or "huggingface.co", endpoint.port or (80 if endpoint.scheme == "http" else 443)
    # behind a proxy (HTTPS_PROXY / HTTP_PROXY, as huggingface_hub's client uses them), the proxy is what must answer
    proxy = urllib.request.getproxies().get(endpoint.scheme or "https")
    if proxy and not urllib.request.proxy_bypass(host):
        proxy_url = urlsplit(proxy if "://" in proxy else f"http://{proxy}")
        host, port = proxy_url.hostname or host, proxy_url.port or (443 if proxy_url.scheme == "https" else 80)
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as e:
        return f"{host}:{port} cannot be reached ({e.strerror or e})"
    return None


def import_hub():
    """huggingface_hub, or a MissingDependencyError saying how to install it."""
    try:
        import huggingface_hub
    except ImportError as e:
        raise MissingDependencyError(f"hf-hub: references need huggingface_hub: {INSTALL_HINT} ({e})") from e
    return huggingface_hub


def snapshot_folder(ref: HubRef, repo_type: str, setting: str,
                    allow_patterns: list[str] | None = None) -> Path:
    """The local folder of ``ref`` (its subfolder, if any): downloaded into, or read from, the
    Hugging Face cache by ``snapshot_download``. ``allow_patterns`` limits what is fetched.

    Errors (one :class:`HubError` naming ``setting``, the reference and the fix): the repository
    or revision does not exist or is gated; offline and not in the cache; the subfolder is missing.
    """
    if repo_type not in REPO_TYPES:
        raise ValueError(f"repo_type must be one of {REPO_TYPES}, got {repo_type!r}")
    hub = import_hub()
    from huggingface_hub import errors

    patterns = allow_patterns
    if patterns is not None and ref.subfolder:
        patterns = [f"{ref.subfolder}/{p}" for p in patterns]
    where = f"{setting}={str(ref)!r} ({repo_type} repository {ref.repo_id}, revision {ref.revision or 'main'})"
    # without network, read the cache only (huggingface_hub would retry for a minute first)
    unreachable = hub_unreachable()
    cache_only = unreachable is not None
    try:
        root = Path(hub.snapshot_download(ref.repo_id, repo_type=repo_type, revision=ref.revision,
                                          allow_patterns=patterns, local_files_only=cache_only))
    except errors.GatedRepoError:
        raise HubError(f"{where} is gated: accept its terms on the Hub and log in (hf auth login)") from None
    except errors.RepositoryNotFoundError:
        raise HubError(f"{where} does not exist or is private: check the name, or log in (hf auth login) "
                       f"with a token that can read it") from None
    except errors.RevisionNotFoundError:
        raise HubError(f"{where}: no such revision; give a branch, tag or commit of the repository") from None
    except errors.LocalEntryNotFoundError:
        reason = unreachable or "the Hub cannot be reached"
        raise HubError(f"{where} is not (completely) in the Hugging Face cache and {reason}: download it once "
                       f"while online, or point HF_HUB_CACHE at a cache that holds it") from None
    except errors.HfHubHTTPError as e:
        raise HubError(f"{where}: the Hub answered {e}") from None
    except errors.HFValidationError as e:
        raise HubError(f"{setting}={str(ref)!r} is not a valid repository id or revision ({e})") from None
    folder = root / ref.subfolder if ref.subfolder else root
    if not folder.is_dir():
        raise HubError(f"{where} has no folder {ref.subfolder!r}; check the path after the repository name")
    logger.info("%s resolved to %s", ref, folder)
    return folder


def resolve_hub_folder(spec: str, repo_type: str, setting: str,
                       allow_patterns: list[str] | None = None) -> Path:
    """:func:`parse_hub_ref` then :func:`snapshot_folder`: an ``hf-hub:`` string -> local folder."""
    return snapshot_folder(parse_hub_ref(spec, setting), repo_type, setting, allow_patterns)
