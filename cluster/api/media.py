"""Image references in API requests → verified, decoded images (the API edge of issue 46).

An image content part carries a URL; ``load_image`` turns it into an RGB Pillow image and the
sha256 of its encoded bytes (the content hash prefix caching keys on), or raises ``MediaError``
(an ``InvalidRequestError``: the routes answer 400) naming the request field.

    data:image/*;base64,…  ──▶ base64 (strict) ───────────────────────────────────────────┐
    http(s)://host/…  ──▶ host in allowed_media_domains? ──▶ resolve ONCE ──▶ every address │
        public (or private allowed)? ──▶ connect to that address (Host header, TLS SNI = host)│
        ──▶ 200 + image/* ──▶ stream ≤ max_image_bytes, all within media_fetch_timeout_s ────┤
    Pillow: header only ──▶ width·height ≤ max_image_pixels ──▶ verify ──▶ decode ──▶ RGB ◀──┘

Connecting to the checked address (never resolving the name again) defeats DNS rebinding. A
redirect is followed only to the same scheme, host and port, at most ``MAX_REDIRECTS`` times, each
hop resolved and checked again. Link-local (cloud metadata), multicast, reserved and unspecified
addresses are refused even when ``allow_private_media_addresses`` admits private and loopback ones.
Blocking sockets and Pillow run in a worker thread; ``load_image`` is a coroutine.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import http.client
import io
import ipaddress
import re
import socket
import ssl
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import SplitResult, urljoin, urlsplit

from PIL import Image

from engine.errors import ConfigError, InvalidRequestError

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

MAX_REDIRECTS = 3
_CHUNK_BYTES = 64 * 1024
_REDIRECTS = frozenset({301, 302, 303, 307, 308})
_UNTYPED = frozenset({"", "application/octet-stream", "binary/octet-stream"})
# Pillow raises DecompressionBombError itself above 2 × Image.MAX_IMAGE_PIXELS (default 89,478,485).
_PILLOW_PIXEL_LIMIT = 2 * 89_478_485
_HOST_NAME = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_.-]*[A-Za-z0-9_])?\.?")
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
# What allow_private_media_addresses admits: RFC 1918, carrier-grade NAT, unique local, loopback.
_PRIVATE_NETWORKS = tuple(
    ipaddress.ip_network(network)
    for network in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10")
)
_PRIVATE_NETWORKS += tuple(map(ipaddress.ip_network, ("127.0.0.0/8", "fc00::/7", "::1/128")))


class MediaError(InvalidRequestError):
    """An image reference was refused; ``param`` names the request field."""


@dataclass(frozen=True)
class MediaSettings:
    """Where images may come from and how big they may be (all checked at construction)."""

    allowed_media_domains: Sequence[str] = ()  # exact host names; empty: no remote fetching
    allow_private_media_addresses: bool = False  # _PRIVATE_NETWORKS: for in-cluster stores
    max_image_bytes: int = 20 * 1024 * 1024
    max_image_pixels: int = 89_478_485  # width · height, Pillow's own default guard
    media_fetch_timeout_s: float = 5.0  # vLLM's VLLM_IMAGE_FETCH_TIMEOUT default

    def __post_init__(self) -> None:
        domains = self.allowed_media_domains
        if isinstance(domains, str) or not all(isinstance(d, str) for d in domains):
            raise ConfigError("allowed_media_domains: expected a list of host names")
        for domain in domains:
            if not _HOST_NAME.fullmatch(domain):
                raise ConfigError(
                    f"allowed_media_domains: {domain!r} is not a bare ASCII host name "
                    "(no scheme, port, path or user; punycode; e.g. 'images.example.com')"
                )
        object.__setattr__(
            self, "allowed_media_domains", tuple(d.lower().rstrip(".") for d in domains)
        )
        if not isinstance(self.allow_private_media_addresses, bool):
            raise ConfigError("allow_private_media_addresses: expected true or false")
        _check_int("max_image_bytes", self.max_image_bytes, 1, 1 << 30)
        _check_int("max_image_pixels", self.max_image_pixels, 1, _PILLOW_PIXEL_LIMIT)
        timeout = self.media_fetch_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
            raise ConfigError("media_fetch_timeout_s: expected a number of seconds in (0, 600]")
        if not 0 < timeout <= 600:
            raise ConfigError(f"media_fetch_timeout_s: {timeout} is outside (0, 600]")


def _check_int(name: str, value: object, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ConfigError(f"{name}: {value!r} is not an integer in [{low}, {high}]")


@dataclass(frozen=True)
class LoadedImage:
    image: Image.Image  # fully decoded, mode RGB
    sha256: str  # hex digest of the encoded bytes, as received
    format: str = ""  # Pillow's name of the encoding (PNG, JPEG, ...)


async def load_image(url: str, settings: MediaSettings, field: str) -> LoadedImage:
    """The image ``url`` refers to; ``MediaError`` naming ``field`` when it is refused."""
    data = await _image_bytes(url, settings, field)
    return await asyncio.to_thread(decode_image, data, settings, field)


async def image_data_url(url: str, settings: MediaSettings, field: str) -> str:
    """``url`` as the data URL a model replica decodes (``engine.multimodal.chat``), after
    ``load_image``'s checks: a data URL as given, an http(s) image fetched and carried as its
    own bytes (not re-encoded)."""
    data = await _image_bytes(url, settings, field)
    loaded = await asyncio.to_thread(decode_image, data, settings, field)
    if url[:5].lower() == "data:":
        return url
    mime = Image.MIME.get(loaded.format, "application/octet-stream")
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


async def chat_images_as_data(
    messages: list[dict[str, Any]], settings: MediaSettings
) -> list[dict[str, Any]]:
    """Chat ``messages`` with each ``image_url`` part's URL replaced by its ``image_data_url``
    (all fetched at once); ``MediaError`` naming the first part refused."""
    urls: dict[tuple[int, int], Any] = {}
    for i, message in enumerate(messages):
        content = message.get("content")
        for j, part in enumerate(content if isinstance(content, list) else ()):
            if isinstance(part, dict) and part.get("type") == "image_url":
                field = f"messages.{i}.content.{j}.image_url.url"
                urls[i, j] = image_data_url(part["image_url"]["url"], settings, field)
    if not urls:
        return messages
    data = dict(zip(urls, await asyncio.gather(*urls.values()), strict=True))
    out = []
    for i, message in enumerate(messages):
        content = message.get("content")
        if isinstance(content, list) and any(key[0] == i for key in data):
            parts = [{"type": "image_url", "image_url": {"url": data[i, j]}}
                     if (i, j) in data else part for j, part in enumerate(content)]  # fmt: skip
            message = {**message, "content": parts}
        out.append(message)
    return out


async def _image_bytes(url: str, settings: MediaSettings, field: str) -> bytes:
    scheme, colon, _ = url[:16].partition(":")
    scheme = scheme.lower() if colon else ""
    if scheme == "data":
        return await asyncio.to_thread(decode_data_url, url, settings, field)
    if scheme in ("http", "https"):
        return await fetch_image_bytes(url, settings, field)
    raise MediaError(
        "only data:image/...;base64 URLs and http(s):// URLs are accepted for images", field
    )


def decode_data_url(url: str, settings: MediaSettings, field: str) -> bytes:
    """The bytes of a ``data:image/<type>;base64,<payload>`` URL."""
    header, comma, payload = url.partition(",")
    media_type, *params = header[len("data:") :].split(";")
    if not comma or not media_type.strip().lower().startswith("image/"):
        raise MediaError("a data URL must have the form data:image/<type>;base64,<payload>", field)
    if "base64" not in (p.strip().lower() for p in params):
        raise MediaError("a data URL's image must be base64-encoded (;base64,)", field)
    if len(payload) > 4 * (settings.max_image_bytes // 3 + 1):
        raise _too_large(settings, field)
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise MediaError("the data URL's payload is not valid base64", field) from None
    if len(data) > settings.max_image_bytes:
        raise _too_large(settings, field)
    return data


def decode_image(data: bytes, settings: MediaSettings, field: str) -> LoadedImage:
    """Pillow-decoded RGB image of ``data``, its pixel count checked before the full decode."""
    try:
        with Image.open(io.BytesIO(data)) as header:  # reads the header only
            width, height = header.size
            encoding = header.format or ""
            if width * height > settings.max_image_pixels:
                raise _too_many_pixels(width * height, settings, field)
            header.verify()
        with Image.open(io.BytesIO(data)) as image:
            rgb = image.convert("RGB")  # loads (decodes) the first frame
    except MediaError:
        raise
    except Image.DecompressionBombError:
        raise _too_many_pixels(None, settings, field) from None
    except Exception:
        # Hostile bytes make Pillow raise anything (UnidentifiedImageError, truncated data, bad
        # checksums, struct errors): each is the client's 400, and its text stays internal.
        raise MediaError("the image could not be decoded (PNG, JPEG, WebP, ...)", field) from None
    return LoadedImage(image=rgb, sha256=hashlib.sha256(data).hexdigest(), format=encoding)


def _too_large(settings: MediaSettings, field: str) -> MediaError:
    return MediaError(f"the image is larger than max_image_bytes={settings.max_image_bytes}", field)


def _too_many_pixels(pixels: int | None, settings: MediaSettings, field: str) -> MediaError:
    size = f" ({pixels} pixels)" if pixels is not None else ""
    return MediaError(
        f"the image{size} exceeds max_image_pixels={settings.max_image_pixels} (width x height)",
        field,
    )


def resolve_host(host: str, port: int) -> list[IPAddress]:
    """Every address ``host`` resolves to: the one DNS lookup made per connection."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(ipaddress.ip_address(info[4][0]) for info in infos))


def is_public_address(ip: IPAddress) -> bool:
    """True for globally routable unicast addresses; IPv6 forms of IPv4 judged by their IPv4."""
    if isinstance(ip, ipaddress.IPv6Address):
        embedded = ip.ipv4_mapped or ip.sixtofour
        if embedded is None and ip in _NAT64:
            embedded = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
        if embedded is not None:
            return is_public_address(embedded)
        if ip.is_site_local:
            return False
    return ip.is_global and not (ip.is_multicast or ip.is_reserved or ip.is_link_local)


def _is_private(ip: IPAddress) -> bool:
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return any(ip in network for network in _PRIVATE_NETWORKS)


def tls_context() -> ssl.SSLContext:
    """What https fetches trust: the system's CAs, the certificate checked for the URL's host."""
    return ssl.create_default_context()


class PinnedConnection(http.client.HTTPConnection):
    """HTTP(S) to ``host`` over a socket to ``address``: Host header and TLS SNI say ``host``."""

    def __init__(
        self, host: str, port: int, address: IPAddress, timeout: float, tls: ssl.SSLContext | None
    ) -> None:
        super().__init__(host, port, timeout=timeout)
        self.default_port = 443 if tls is not None else 80  # Host header omits the default port
        self._address, self._tls = address, tls
        # Kept past ``close()``: a response to ``Connection: close`` still reads through it.
        self.pinned_sock: socket.socket | None = None

    def connect(self) -> None:
        sock = socket.create_connection((str(self._address), self.port), self.timeout)
        self.sock = self._tls.wrap_socket(sock, server_hostname=self.host) if self._tls else sock
        self.pinned_sock = self.sock


async def fetch_image_bytes(url: str, settings: MediaSettings, field: str) -> bytes:
    """The body at an http(s) ``url``, under every rule of this module's docstring."""
    if not settings.allowed_media_domains:
        raise MediaError(
            "remote image URLs are not accepted by this server (allowed_media_domains is empty); "
            "send the image as a data:image/...;base64 URL",
            field,
        )
    timeout = settings.media_fetch_timeout_s
    deadline = time.monotonic() + timeout
    try:
        return await asyncio.wait_for(
            asyncio.to_thread(_fetch_following_redirects, url, settings, field, deadline), timeout
        )
    except asyncio.TimeoutError:
        raise _timed_out(settings, field) from None


def _fetch_following_redirects(
    url: str, settings: MediaSettings, field: str, deadline: float
) -> bytes:
    target = _checked_url(url, settings, field)
    for _ in range(MAX_REDIRECTS + 1):
        location = _fetch_once(target, settings, field, deadline)
        if isinstance(location, bytes):
            return location
        following = _checked_url(urljoin(target.geturl(), location), settings, field)
        if _origin(following) != _origin(target):
            raise MediaError(
                "the image URL redirects to another host; only same-host redirects are followed",
                field,
            )
        target = following
    raise MediaError(f"the image URL redirects more than {MAX_REDIRECTS} times", field)


def _checked_url(url: str, settings: MediaSettings, field: str) -> SplitResult:
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 (raises ValueError on a bad port)
    except ValueError:
        raise MediaError("the image URL is malformed", field) from None
    if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
        raise MediaError("an image URL must be http(s)://<host>/...", field)
    if not url.isascii():
        raise MediaError("an image URL must be ASCII (punycode host, percent-encoded path)", field)
    if parts.username is not None or parts.password is not None:
        raise MediaError("an image URL must not carry credentials (user@host)", field)
    if parts.hostname.rstrip(".") not in settings.allowed_media_domains:
        raise MediaError(
            "the image URL's host is not in allowed_media_domains: "
            + ", ".join(settings.allowed_media_domains),
            field,
        )
    return parts


def _origin(parts: SplitResult) -> tuple[str, str, int]:
    scheme = parts.scheme.lower()
    return scheme, parts.hostname or "", parts.port or (443 if scheme == "https" else 80)


def _checked_addresses(
    host: str, port: int, settings: MediaSettings, field: str
) -> list[IPAddress]:
    try:
        addresses = resolve_host(host, port)
    except (OSError, UnicodeError, ValueError):
        raise MediaError("the image URL's host name could not be resolved", field) from None

    private_ok = settings.allow_private_media_addresses
    if not addresses or not all(
        is_public_address(ip) or (private_ok and _is_private(ip)) for ip in addresses
    ):
        refused = "link-local, multicast, reserved and unspecified addresses are refused"
        if not private_ok:
            refused = "private, loopback, " + refused + " (allow_private_media_addresses is off)"
        raise MediaError(f"the image URL's host resolves to a refused address: {refused}", field)
    return addresses


def _fetch_once(
    target: SplitResult, settings: MediaSettings, field: str, deadline: float
) -> bytes | str:
    """The body of a 200 answer, or the Location of a redirect."""
    scheme, host, port = _origin(target)
    addresses = _checked_addresses(host, port, settings, field)
    tls = tls_context() if scheme == "https" else None
    path = (target.path or "/") + (f"?{target.query}" if target.query else "")
    try:
        conn = _connect(host, port, addresses, tls, deadline)
        try:
            conn.request("GET", path, headers={"Accept": "image/*", "User-Agent": "llm-cluster"})
            with conn.getresponse() as response:  # closing it closes the socket it reads
                if response.status in _REDIRECTS and response.getheader("Location"):
                    return response.getheader("Location") or ""
                if response.status != 200:
                    raise MediaError(f"the image URL answered HTTP {response.status}", field)
                return _read_image_body(conn, response, settings, field, deadline)
        finally:
            conn.close()
    except TimeoutError:
        raise _timed_out(settings, field) from None
    except ssl.SSLError:
        raise MediaError("the image host's TLS certificate or handshake failed", field) from None
    except (OSError, http.client.HTTPException):
        raise MediaError("the image could not be fetched from its host", field) from None


def _connect(
    host: str, port: int, addresses: list[IPAddress], tls: ssl.SSLContext | None, deadline: float
) -> PinnedConnection:
    """A connection to the first of ``addresses`` (all checked) that answers."""
    for address in addresses[:-1]:
        conn = PinnedConnection(host, port, address, _remaining(deadline), tls)
        try:
            conn.connect()
            return conn
        except OSError:
            conn.close()
    conn = PinnedConnection(host, port, addresses[-1], _remaining(deadline), tls)
    conn.connect()
    return conn


def _read_image_body(
    conn: PinnedConnection,
    response: http.client.HTTPResponse,
    settings: MediaSettings,
    field: str,
    deadline: float,
) -> bytes:
    content_type = (response.getheader("Content-Type") or "").split(";")[0].strip().lower()
    if not content_type.startswith("image/") and content_type not in _UNTYPED:
        raise MediaError(f"the image URL returned {content_type[:60]!r}, not image/*", field)
    if response.length is not None and response.length > settings.max_image_bytes:
        raise _too_large(settings, field)
    body = bytearray()
    while True:
        if conn.pinned_sock is not None:  # each read waits at most until the deadline
            conn.pinned_sock.settimeout(_remaining(deadline))
        chunk = response.read1(_CHUNK_BYTES)
        if not chunk:
            return bytes(body)
        body += chunk
        if len(body) > settings.max_image_bytes:
            raise _too_large(settings, field)


def _remaining(deadline: float) -> float:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TimeoutError
    return remaining


def _timed_out(settings: MediaSettings, field: str) -> MediaError:
    limit = settings.media_fetch_timeout_s
    return MediaError(f"fetching the image took longer than media_fetch_timeout_s={limit}", field)
