"""A small client of the OCI distribution API: manifests, blobs, token auth.

Only what pulling needs: ``GET /v2/NAME/manifests/REF`` and ``GET /v2/NAME/blobs/DIGEST``, the
``WWW-Authenticate: Bearer realm=…`` token dance (anonymous, or with credentials), Basic where a
registry asks for it, and ranged GETs to continue a blob a killed pull left half-downloaded.

Credentials come from, first match wins:

* ``ROLLCAGE_REGISTRY_AUTH``: a JSON object ``{"HOST[:PORT]": "USER:PASSWORD", ...}``;
* a docker client config, ``$DOCKER_CONFIG/config.json`` or ``~/.docker/config.json``: its
  ``auths`` entries' base64 ``auth`` (``credsStore``/``credHelpers`` are not consulted).

They are sent only to the registry they are named for and to the token realm it names, and
never logged, recorded or put in an error message.

Plain ``http://`` is used only for loopback registries (``localhost``, ``127.0.0.0/8``,
``[::1]``) or hosts named in ``ROLLCAGE_INSECURE_REGISTRIES`` (comma-separated ``HOST[:PORT]``).
"""

from __future__ import annotations

import base64
import hashlib
import ipaddress
import json
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Final

import httpx

from rollcage.errors import ImagePullError, ImageReferenceError, ImageRefusedError
from rollcage.images._ref import DOCKER_HUB, ImageRef

__all__ = ["MANIFEST_TYPES", "RegistryClient", "credentials_for"]

AUTH_ENV: Final = "ROLLCAGE_REGISTRY_AUTH"
INSECURE_ENV: Final = "ROLLCAGE_INSECURE_REGISTRIES"
MANIFEST_TYPES: Final = (
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.docker.distribution.manifest.v2+json",
)
_MANIFEST_LIMIT: Final = 4 << 20
_CHUNK: Final = 1 << 20
_PARAM: Final = re.compile(r'(\w+)="([^"]*)"')


def _loopback(host: str) -> bool:
    name = host.rsplit(":", 1)[0] if not host.endswith("]") and host.count(":") == 1 else host
    name = name.split("]")[0].lstrip("[") if name.startswith("[") else name
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def credentials_for(registry: str) -> tuple[str, str] | None:
    """(user, password) for ``registry`` from the environment or the docker config, or ``None``."""
    raw = os.environ.get(AUTH_ENV)
    if raw:
        try:
            table = json.loads(raw)
        except ValueError as exc:
            raise ImageReferenceError(f"{AUTH_ENV} is not a JSON object of HOST: 'USER:PASSWORD'") from exc
        if not isinstance(table, dict):
            raise ImageReferenceError(f"{AUTH_ENV} is not a JSON object of HOST: 'USER:PASSWORD'")
        value = table.get(registry)
        if isinstance(value, str) and ":" in value:
            user, _, password = value.partition(":")
            return user, password
    config_dir = os.environ.get("DOCKER_CONFIG")
    path = Path(config_dir) / "config.json" if config_dir else Path.home() / ".docker" / "config.json"
    try:
        auths = json.loads(path.read_text(encoding="utf-8")).get("auths", {})
    except (OSError, ValueError, AttributeError):
        return None
    keys = [registry, f"https://{registry}", f"http://{registry}"]
    if registry == DOCKER_HUB:
        keys += ["https://index.docker.io/v1/", "index.docker.io", "registry-1.docker.io"]
    for key in keys:
        entry = auths.get(key) if isinstance(auths, dict) else None
        if isinstance(entry, dict) and isinstance(entry.get("auth"), str):
            try:
                user, _, password = base64.b64decode(entry["auth"]).decode().partition(":")
            except ValueError:
                continue
            return user, password
    return None


class RegistryClient:
    """Speaks the distribution API to one repository of one registry. Close it (or use ``with``)."""

    def __init__(self, ref: ImageRef, *, timeout_s: float = 60.0, insecure: bool = False) -> None:
        if ref.transport != "docker" or ref.repository is None:
            raise ValueError(f"{ref} is not a registry reference")
        self.ref = ref
        host = ref.api_host
        allowed = {h.strip() for h in os.environ.get(INSECURE_ENV, "").split(",") if h.strip()}
        plain = insecure or _loopback(host) or host in allowed or (ref.registry or "") in allowed
        self.base = f"{'http' if plain else 'https'}://{host}/v2/{ref.repository}"
        self._credentials = credentials_for(ref.registry or host)
        self._token: str | None = None
        self._basic = False
        self._http = httpx.Client(timeout=httpx.Timeout(timeout_s), follow_redirects=True)

    def __enter__(self) -> RegistryClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the connections."""
        self._http.close()

    # ----------------------------------------------------------------------- requests

    def _headers(self) -> dict[str, str]:
        if self._token is not None:
            return {"Authorization": f"Bearer {self._token}"}
        if self._basic and self._credentials is not None:
            user, password = self._credentials
            return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}
        return {}

    @contextmanager
    def _get(self, url: str, what: str, headers: dict[str, str] | None = None) -> Iterator[httpx.Response]:
        for attempt in range(2):
            try:
                request = self._http.build_request("GET", url, headers={**(headers or {}), **self._headers()})
                response = self._http.send(request, stream=True)
            except httpx.HTTPError as exc:
                raise ImagePullError(f"{self.ref}: {what}: {type(exc).__name__}: {exc}") from exc
            try:
                if response.status_code == 401 and attempt == 0:
                    challenge = response.headers.get("www-authenticate", "")
                    response.close()
                    self._authenticate(challenge)
                    continue
                self._check(response, what)
                yield response
                return
            finally:
                response.close()

    def _check(self, response: httpx.Response, what: str) -> None:
        status = response.status_code
        if status < 300:
            return
        if status in (401, 403):
            who = "the credentials given" if self._credentials else f"anonymous access (set {AUTH_ENV})"
            raise ImagePullError(f"{self.ref}: {what}: the registry refused {who} (HTTP {status})")
        if status == 404:
            raise ImageReferenceError(f"{self.ref}: {what}: the registry has no such thing (HTTP 404)")
        raise ImagePullError(f"{self.ref}: {what}: HTTP {status} from the registry")

    def _authenticate(self, challenge: str) -> None:
        scheme, _, rest = challenge.partition(" ")
        if scheme.lower() == "basic":
            if self._credentials is None:
                raise ImagePullError(f"{self.ref}: the registry asks for credentials (set {AUTH_ENV})")
            self._basic = True
            return
        if scheme.lower() != "bearer":
            raise ImagePullError(f"{self.ref}: the registry asks for unsupported auth {scheme!r}")
        params = dict(_PARAM.findall(rest))
        realm = params.pop("realm", None)
        if not realm or not realm.startswith(("https://", "http://")):
            raise ImagePullError(f"{self.ref}: the registry's Bearer challenge names no realm")
        params.setdefault("scope", f"repository:{self.ref.repository}:pull")
        auth = httpx.BasicAuth(*self._credentials) if self._credentials else None
        try:
            response = self._http.get(realm, params=params, auth=auth)
        except httpx.HTTPError as exc:
            raise ImagePullError(f"{self.ref}: token endpoint: {type(exc).__name__}: {exc}") from exc
        if response.status_code in (401, 403):
            who = "the credentials given" if self._credentials else f"anonymous access (set {AUTH_ENV})"
            raise ImagePullError(
                f"{self.ref}: the token endpoint refused {who} (HTTP {response.status_code})"
            )
        if response.status_code >= 300:
            raise ImagePullError(f"{self.ref}: token endpoint: HTTP {response.status_code}")
        try:
            body = response.json()
            token = body.get("token") or body.get("access_token")
        except (ValueError, AttributeError):
            token = None
        if not isinstance(token, str) or not token:
            raise ImagePullError(f"{self.ref}: the token endpoint answered no token")
        self._token = token

    # ----------------------------------------------------------------------- manifests and blobs

    def manifest(self, reference: str) -> tuple[bytes, str, str]:
        """(body, media type, digest) of a manifest or index; the digest is checked against the body."""
        what = f"manifest {reference}"
        with self._get(
            f"{self.base}/manifests/{reference}", what, {"Accept": ", ".join(MANIFEST_TYPES)}
        ) as r:
            body = _read_bounded(r, _MANIFEST_LIMIT, f"{self.ref}: {what}")
            media_type = r.headers.get("content-type", "").split(";")[0].strip()
            claimed = r.headers.get("docker-content-digest")
        digest = "sha256:" + hashlib.sha256(body).hexdigest()
        expected = reference if reference.startswith("sha256:") else claimed
        if expected is not None and expected != digest:
            raise ImageRefusedError(f"{self.ref}: {what}: its digest is {digest}, expected {expected}")
        return body, media_type, digest

    def blob_bytes(self, digest: str, limit: int) -> bytes:
        """A small blob (a config), read whole and checked against its digest."""
        with self._get(f"{self.base}/blobs/{digest}", f"blob {digest}") as r:
            body = _read_bounded(r, limit, f"{self.ref}: blob {digest}")
        actual = "sha256:" + hashlib.sha256(body).hexdigest()
        if actual != digest:
            raise ImageRefusedError(f"{self.ref}: blob {digest}: its digest is {actual}")
        return body

    def download(self, digest: str, partial: Path, final: Path, limit: int) -> None:
        """Download a blob to ``final``, through ``partial``, continuing what ``partial`` already holds.

        The digest is checked before ``final`` appears (renamed into place, fsynced); a mismatch
        removes ``partial`` and raises ``ImageRefusedError``. The caller holds the blob's lock.
        """
        hasher = hashlib.sha256()
        have = 0
        if partial.exists():
            with partial.open("rb") as f:
                while chunk := f.read(_CHUNK):
                    hasher.update(chunk)
                    have += len(chunk)
        if have and "sha256:" + hasher.hexdigest() == digest:
            os.replace(partial, final)  # killed after the last byte, before the rename
            return
        headers = {"Range": f"bytes={have}-"} if have else {}
        with self._get(f"{self.base}/blobs/{digest}", f"blob {digest}", headers) as r:
            if have and r.status_code != 206:
                hasher, have = hashlib.sha256(), 0  # the registry sent it whole: start over
            with partial.open("ab" if have else "wb") as out:
                try:
                    for chunk in r.iter_bytes(_CHUNK):
                        have += len(chunk)
                        if have > limit:
                            partial.unlink(missing_ok=True)
                            raise ImageRefusedError(
                                f"{self.ref}: blob {digest} is over {limit} bytes (the store's limit)"
                            )
                        hasher.update(chunk)
                        out.write(chunk)
                except httpx.HTTPError as exc:
                    raise ImagePullError(
                        f"{self.ref}: blob {digest}: {type(exc).__name__}: {exc} (a later pull continues it)"
                    ) from exc
                finally:
                    out.flush()
                    os.fsync(out.fileno())
        actual = "sha256:" + hasher.hexdigest()
        if actual != digest:
            partial.unlink(missing_ok=True)
            raise ImageRefusedError(f"{self.ref}: blob {digest}: its digest is {actual}")
        os.replace(partial, final)


def _read_bounded(response: httpx.Response, limit: int, what: str) -> bytes:
    parts: list[bytes] = []
    size = 0
    try:
        for chunk in response.iter_bytes():
            size += len(chunk)
            if size > limit:
                raise ImageRefusedError(f"{what}: over {limit} bytes")
            parts.append(chunk)
    except httpx.HTTPError as exc:
        raise ImagePullError(f"{what}: {type(exc).__name__}: {exc}") from exc
    return b"".join(parts)
