"""Image references → images (``cluster.api.media``): data URLs decoded, remote URLs fetched from a
real HTTP server on loopback only when the domain and private addresses are allowed, and every
refusal a ``MediaError`` (a 400) naming the request field. Names resolve through a stand-in for
the module's ``resolve_host``, so ``images.test`` can point at 127.0.0.1 or 169.254.169.254."""

from __future__ import annotations

import asyncio
import base64
import datetime
import hashlib
import io
import ipaddress
import re
import socket
import ssl
import struct
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from PIL import Image

from cluster.api import media
from cluster.api.media import (
    MAX_REDIRECTS,
    LoadedImage,
    MediaError,
    MediaSettings,
    PinnedConnection,
    is_public_address,
    load_image,
)
from engine.errors import ConfigError, InvalidRequestError

FIELD = "messages[0].content[1].image_url.url"
HOST = "images.test"


def _png(width: int = 7, height: int = 5) -> bytes:
    image = Image.new("RGB", (width, height))
    image.putdata(
        [(x * 31 % 256, y * 47 % 256, x * y % 256) for y in range(height) for x in range(width)]
    )
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


PNG = _png()


def _data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def _load(url: str, settings: MediaSettings | None = None) -> LoadedImage:
    return asyncio.run(load_image(url, settings or MediaSettings(), FIELD))


def _refusal(url: str, settings: MediaSettings | None = None) -> str:
    with pytest.raises(MediaError) as info:
        _load(url, settings)
    assert info.value.param == FIELD
    assert str(info.value).startswith(f"{FIELD}: ")
    return info.value.reason


# ---- the local HTTP server ----------------------------------------------------------------


Route = Callable[[BaseHTTPRequestHandler], None]


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.port: int = self.server_address[1]
        self.routes: dict[str, Route] = {}
        self.seen: list[tuple[str, str]] = []  # (path, Host header) of each request
        self.client_left = threading.Event()  # a slow answer found its client gone


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def do_GET(self) -> None:
        self.server.seen.append((self.path, self.headers["Host"]))
        self.server.routes.get(self.path, _not_found)(self)

    def log_message(self, *args: object) -> None:
        pass


def _answer(body: bytes, content_type: str = "image/png", length: bool = True) -> Route:
    def route(handler: BaseHTTPRequestHandler) -> None:
        handler.send_response(200)
        handler.send_header("Content-Type", content_type)
        if length:
            handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)

    return route


def _redirect(location: str) -> Route:
    def route(handler: BaseHTTPRequestHandler) -> None:
        handler.send_response(302)
        handler.send_header("Location", location)
        handler.send_header("Content-Length", "0")
        handler.end_headers()

    return route


def _not_found(handler: BaseHTTPRequestHandler) -> None:
    handler.send_error(404)


def _sleep_then_answer(handler: BaseHTTPRequestHandler) -> None:
    time.sleep(3)
    _answer(PNG)(handler)


def _drip(handler: BaseHTTPRequestHandler) -> None:
    handler.send_response(200)
    handler.send_header("Content-Type", "image/png")
    handler.end_headers()
    try:
        for byte in PNG[:40]:  # 4 s in all
            handler.wfile.write(bytes([byte]))
            handler.wfile.flush()
            time.sleep(0.1)
    except OSError:
        handler.server.client_left.set()  # type: ignore[attr-defined]


class ImageServer:
    def __init__(self, httpd: _Server) -> None:
        self.port = httpd.port
        self.seen = httpd.seen
        self.client_left = httpd.client_left

    def url(self, path: str, host: str = HOST) -> str:
        return f"http://{host}:{self.port}{path}"


@pytest.fixture
def server() -> Iterator[ImageServer]:
    httpd = _Server()
    port = httpd.port
    httpd.routes = {
        "/image.png": _answer(PNG),
        "/untyped": _answer(PNG, content_type="application/octet-stream"),
        "/page.html": _answer(b"<html></html>", content_type="text/html"),
        "/announced-big": _answer(PNG + bytes(5000)),
        "/streamed-big": _answer(PNG + bytes(5000), length=False),
        "/redirect-here": _redirect("/image.png"),
        "/redirect-away": _redirect(f"http://elsewhere.test:{port}/image.png"),
        "/loop": _redirect("/loop"),
        "/slow": _sleep_then_answer,
        "/drip": _drip,
    }
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield ImageServer(httpd)
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture
def resolves_to(monkeypatch: pytest.MonkeyPatch) -> Callable[..., list[str]]:
    """``resolves_to("127.0.0.1", ...)``: every name resolves to these addresses; returns the
    list of names looked up."""
    lookups: list[str] = []

    def install(*addresses: str) -> list[str]:
        def resolve(host: str, port: int) -> list[media.IPAddress]:
            lookups.append(host)
            return [ipaddress.ip_address(a) for a in addresses]

        monkeypatch.setattr(media, "resolve_host", resolve)
        return lookups

    return install


def _remote(private: bool = False, **fields: object) -> MediaSettings:
    return MediaSettings(
        allowed_media_domains=[HOST, "elsewhere.test"],
        allow_private_media_addresses=private,
        **fields,  # type: ignore[arg-type]
    )


# ---- data URLs and decoding ---------------------------------------------------------------


def test_a_data_url_decodes_to_the_rgb_image_and_the_sha256_of_its_bytes() -> None:
    loaded = _load(_data_url(PNG))
    assert loaded.image.mode == "RGB"
    assert loaded.image.tobytes() == Image.open(io.BytesIO(PNG)).convert("RGB").tobytes()
    assert loaded.sha256 == hashlib.sha256(PNG).hexdigest()


def test_a_palette_image_is_converted_to_rgb() -> None:
    palette = io.BytesIO()
    Image.open(io.BytesIO(PNG)).convert("P").save(palette, format="PNG")
    assert _load(_data_url(palette.getvalue())).image.mode == "RGB"


def test_bad_base64_is_refused_naming_the_field() -> None:
    assert "not valid base64" in _refusal("data:image/png;base64,iVBOR!!w0K")


def test_a_data_url_of_another_media_type_is_refused() -> None:
    assert "data:image/" in _refusal(_data_url(PNG, media_type="text/plain"))


def test_a_data_url_not_base64_encoded_is_refused() -> None:
    assert "base64" in _refusal("data:image/png,rawbytes")


def test_undecodable_bytes_are_refused_without_pillows_text() -> None:
    reason = _refusal(_data_url(b"this is not an image at all"))
    assert reason.startswith("the image could not be decoded")
    assert "identify" not in reason


def test_a_truncated_image_is_refused() -> None:
    big = _png(64, 64)
    assert "could not be decoded" in _refusal(_data_url(big[: len(big) // 2]))


def test_an_image_over_max_image_bytes_is_refused() -> None:
    reason = _refusal(_data_url(PNG), MediaSettings(max_image_bytes=len(PNG) - 1))
    assert f"max_image_bytes={len(PNG) - 1}" in reason


def test_an_image_over_max_image_pixels_is_refused() -> None:
    reason = _refusal(_data_url(PNG), MediaSettings(max_image_pixels=7 * 5 - 1))
    assert "(35 pixels) exceeds max_image_pixels=34" in reason


def test_the_pixel_cap_is_checked_from_the_header_before_decoding() -> None:
    # The pixel data is cut off: only a check made before the full decode can name the size.
    big = _png(64, 64)
    reason = _refusal(_data_url(big[:64]), MediaSettings(max_image_pixels=1000))
    assert "(4096 pixels) exceeds max_image_pixels=1000" in reason


def test_a_decompression_bomb_header_is_refused_as_too_many_pixels() -> None:
    def chunk(kind: bytes, payload: bytes) -> bytes:
        body = kind + payload
        return struct.pack(">I", len(payload)) + body + struct.pack(">I", zlib.crc32(body))

    header = chunk(b"IHDR", struct.pack(">IIBBBBB", 30000, 30000, 8, 2, 0, 0, 0))
    bomb = b"\x89PNG\r\n\x1a\n" + header + chunk(b"IEND", b"")
    assert "exceeds max_image_pixels" in _refusal(_data_url(bomb))


@pytest.mark.parametrize(
    "url",
    ["file:///etc/passwd", "ftp://images.test/a.png", "images.test/a.png", "gopher://x/"],
)
def test_a_url_scheme_other_than_data_and_http_is_refused(url: str) -> None:
    assert "only data:image/" in _refusal(url, _remote(private=True))


def test_media_error_is_an_invalid_request_error() -> None:
    assert issubclass(MediaError, InvalidRequestError)


# ---- remote URLs --------------------------------------------------------------------------


def test_a_remote_url_is_refused_when_no_domain_is_allowed(server: ImageServer) -> None:
    reason = _refusal(server.url("/image.png", host="127.0.0.1"))
    assert "allowed_media_domains is empty" in reason
    assert server.seen == []


def test_a_remote_url_is_refused_when_its_host_is_not_allowed(
    server: ImageServer, resolves_to: Callable
) -> None:
    resolves_to("127.0.0.1")
    reason = _refusal(server.url("/image.png", host="other.test"), _remote(private=True))
    assert "not in allowed_media_domains: images.test, elsewhere.test" in reason
    assert server.seen == []


def test_an_allowed_domain_resolving_to_loopback_is_refused_without_private_addresses(
    server: ImageServer, resolves_to: Callable
) -> None:
    resolves_to("127.0.0.1")
    reason = _refusal(server.url("/image.png"), _remote(private=False))
    assert "refused address" in reason and "allow_private_media_addresses is off" in reason
    assert server.seen == []


def test_an_allowed_domain_on_loopback_is_served_with_private_addresses_allowed(
    server: ImageServer, resolves_to: Callable
) -> None:
    resolves_to("127.0.0.1")
    loaded = _load(server.url("/image.png"), _remote(private=True))
    assert loaded.image.tobytes() == Image.open(io.BytesIO(PNG)).convert("RGB").tobytes()
    assert loaded.sha256 == hashlib.sha256(PNG).hexdigest()


def test_the_request_carries_the_url_host_not_the_address(
    server: ImageServer, resolves_to: Callable
) -> None:
    resolves_to("127.0.0.1")
    _load(server.url("/image.png"), _remote(private=True))
    assert server.seen == [("/image.png", f"{HOST}:{server.port}")]


def test_the_connection_goes_to_the_checked_address_without_a_second_lookup(
    server: ImageServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    answers = iter([["127.0.0.1"], ["8.8.8.8"]])  # a rebinding DNS: the second answer differs
    lookups: list[str] = []

    def resolve(host: str, port: int) -> list[media.IPAddress]:
        lookups.append(host)
        return [ipaddress.ip_address(a) for a in next(answers)]

    monkeypatch.setattr(media, "resolve_host", resolve)
    _load(server.url("/image.png"), _remote(private=True))
    assert lookups == [HOST]
    assert server.seen == [("/image.png", f"{HOST}:{server.port}")]


@pytest.mark.parametrize("private", [False, True])
def test_a_link_local_address_is_refused_even_with_private_addresses_allowed(
    server: ImageServer, resolves_to: Callable, private: bool
) -> None:
    resolves_to("169.254.169.254")
    assert "refused address" in _refusal(server.url("/image.png"), _remote(private=private))


@pytest.mark.parametrize("address", ["240.0.0.1", "0.0.0.0", "224.0.0.1", "fe80::1", "192.0.2.1"])
def test_private_addresses_allowed_still_refuses_reserved_and_special_addresses(
    server: ImageServer, resolves_to: Callable, address: str
) -> None:
    resolves_to(address)
    assert "refused address" in _refusal(server.url("/image.png"), _remote(private=True))


def test_a_name_that_does_not_resolve_is_refused(
    server: ImageServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    def resolve(host: str, port: int) -> list[media.IPAddress]:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(media, "resolve_host", resolve)
    reason = _refusal(server.url("/image.png"), _remote(private=True))
    assert reason == "the image URL's host name could not be resolved"


def test_an_ipv4_mapped_loopback_address_is_refused_without_private_addresses(
    server: ImageServer, resolves_to: Callable
) -> None:
    resolves_to("::ffff:127.0.0.1")
    assert "refused address" in _refusal(server.url("/image.png"), _remote(private=False))


def test_one_private_address_among_public_ones_refuses_the_host(
    server: ImageServer, resolves_to: Callable
) -> None:
    resolves_to("8.8.8.8", "10.1.2.3")
    assert "refused address" in _refusal(server.url("/image.png"), _remote(private=False))


def test_a_same_host_redirect_is_followed(server: ImageServer, resolves_to: Callable) -> None:
    lookups = resolves_to("127.0.0.1")
    loaded = _load(server.url("/redirect-here"), _remote(private=True))
    assert loaded.sha256 == hashlib.sha256(PNG).hexdigest()
    assert [path for path, _ in server.seen] == ["/redirect-here", "/image.png"]
    assert lookups == [HOST, HOST]  # each hop resolved and checked again


def test_a_redirect_to_another_host_is_refused_even_if_that_host_is_allowed(
    server: ImageServer, resolves_to: Callable
) -> None:
    resolves_to("127.0.0.1")
    reason = _refusal(server.url("/redirect-away"), _remote(private=True))
    assert "redirects to another host" in reason
    assert [path for path, _ in server.seen] == ["/redirect-away"]


def test_a_redirect_loop_is_refused_after_max_redirects(
    server: ImageServer, resolves_to: Callable
) -> None:
    resolves_to("127.0.0.1")
    reason = _refusal(server.url("/loop"), _remote(private=True))
    assert f"more than {MAX_REDIRECTS} times" in reason
    assert len(server.seen) == MAX_REDIRECTS + 1


def test_a_server_slower_than_the_timeout_is_refused(
    server: ImageServer, resolves_to: Callable
) -> None:
    resolves_to("127.0.0.1")
    start = time.monotonic()
    reason = _refusal(server.url("/slow"), _remote(private=True, media_fetch_timeout_s=0.5))
    assert "media_fetch_timeout_s=0.5" in reason
    assert time.monotonic() - start < 2.5


def test_the_timeout_bounds_the_whole_fetch_not_each_read(
    server: ImageServer, resolves_to: Callable
) -> None:
    # A byte every 0.1 s never trips a per-read timeout of 1 s; the total deadline ends it.
    resolves_to("127.0.0.1")
    start = time.monotonic()
    reason = _refusal(server.url("/drip"), _remote(private=True, media_fetch_timeout_s=1.0))
    assert "media_fetch_timeout_s=1.0" in reason
    assert time.monotonic() - start < 3.0


def test_the_fetch_stops_reading_once_the_timeout_passes(
    server: ImageServer, resolves_to: Callable
) -> None:
    # The caller's refusal is not enough: the worker thread must hang up, not read on.
    resolves_to("127.0.0.1")
    _refusal(server.url("/drip"), _remote(private=True, media_fetch_timeout_s=0.5))
    assert server.client_left.wait(timeout=3.0)


def test_a_non_image_content_type_is_refused(server: ImageServer, resolves_to: Callable) -> None:
    resolves_to("127.0.0.1")
    assert "'text/html', not image/*" in _refusal(server.url("/page.html"), _remote(private=True))


def test_an_untyped_body_that_decodes_as_an_image_is_accepted(
    server: ImageServer, resolves_to: Callable
) -> None:
    resolves_to("127.0.0.1")
    loaded = _load(server.url("/untyped"), _remote(private=True))
    assert loaded.sha256 == hashlib.sha256(PNG).hexdigest()


def test_a_content_length_over_max_image_bytes_is_refused(
    server: ImageServer, resolves_to: Callable
) -> None:
    resolves_to("127.0.0.1")
    settings = _remote(private=True, max_image_bytes=len(PNG) + 100)
    assert "max_image_bytes" in _refusal(server.url("/announced-big"), settings)


def test_a_streamed_body_over_max_image_bytes_is_refused(
    server: ImageServer, resolves_to: Callable
) -> None:
    resolves_to("127.0.0.1")
    settings = _remote(private=True, max_image_bytes=len(PNG) + 100)
    assert "max_image_bytes" in _refusal(server.url("/streamed-big"), settings)


def test_an_http_error_status_is_refused(server: ImageServer, resolves_to: Callable) -> None:
    resolves_to("127.0.0.1")
    assert "answered HTTP 404" in _refusal(server.url("/missing.png"), _remote(private=True))


def test_credentials_in_the_url_are_refused(server: ImageServer, resolves_to: Callable) -> None:
    resolves_to("127.0.0.1")
    url = f"http://user:secret@{HOST}:{server.port}/image.png"
    assert "credentials" in _refusal(url, _remote(private=True))


def test_a_non_ascii_url_is_refused(server: ImageServer, resolves_to: Callable) -> None:
    resolves_to("127.0.0.1")
    assert "must be ASCII" in _refusal(server.url("/bild-ä.png"), _remote(private=True))
    assert server.seen == []


def _certificate(host: str, directory: Path) -> tuple[Path, Path, bytes]:
    """A self-signed certificate for ``host``: (cert file, key file, cert PEM to trust)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host)])
    now = datetime.datetime.now(datetime.timezone.utc)
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(host)]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(ski, critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski), False)
        .sign(key, hashes.SHA256())
    )
    pem = cert.public_bytes(serialization.Encoding.PEM)
    (directory / "cert.pem").write_bytes(pem)
    (directory / "key.pem").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return directory / "cert.pem", directory / "key.pem", pem


@pytest.fixture
def https_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> Iterator[ImageServer]:
    """The image server behind TLS with a certificate for ``request.param``, which (alone) the
    module's https fetches trust."""
    cert, key, pem = _certificate(request.param, tmp_path)
    monkeypatch.setattr(
        media, "tls_context", lambda: ssl.create_default_context(cadata=pem.decode())
    )
    httpd = _Server()
    httpd.routes = {"/image.png": _answer(PNG)}
    server_side = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_side.load_cert_chain(cert, key)
    httpd.socket = server_side.wrap_socket(httpd.socket, server_side=True)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield ImageServer(httpd)
    httpd.shutdown()
    httpd.server_close()


@pytest.mark.parametrize("https_server", [HOST], indirect=True)
def test_https_is_served_with_a_certificate_for_the_url_host_from_the_checked_address(
    https_server: ImageServer, resolves_to: Callable
) -> None:
    resolves_to("127.0.0.1")
    url = https_server.url("/image.png").replace("http://", "https://")
    assert _load(url, _remote(private=True)).sha256 == hashlib.sha256(PNG).hexdigest()
    assert https_server.seen == [("/image.png", f"{HOST}:{https_server.port}")]


@pytest.mark.parametrize("https_server", ["elsewhere.test"], indirect=True)
def test_https_with_a_certificate_for_another_host_is_refused(
    https_server: ImageServer, resolves_to: Callable
) -> None:
    resolves_to("127.0.0.1")
    url = https_server.url("/image.png").replace("http://", "https://")
    assert "TLS certificate" in _refusal(url, _remote(private=True))
    assert https_server.seen == []


def test_https_sends_the_url_host_as_tls_sni_to_the_checked_address(
    server: ImageServer,
) -> None:
    handshakes: list[tuple[str, str | None]] = []

    class RecordingContext:
        def wrap_socket(self, sock: socket.socket, server_hostname: str | None) -> None:
            handshakes.append((sock.getpeername()[0], server_hostname))
            sock.close()
            raise ssl.SSLError("stopped after recording the handshake's name")

    address = ipaddress.ip_address("127.0.0.1")
    conn = PinnedConnection(HOST, server.port, address, 5.0, RecordingContext())  # type: ignore[arg-type]
    with pytest.raises(ssl.SSLError):
        conn.connect()
    assert handshakes == [("127.0.0.1", HOST)]


# ---- addresses and settings ---------------------------------------------------------------


@pytest.mark.parametrize("address", ["8.8.8.8", "93.184.216.34", "2606:4700:4700::1111"])
def test_a_global_unicast_address_is_public(address: str) -> None:
    assert is_public_address(ipaddress.ip_address(address))


@pytest.mark.parametrize(
    "address",
    [
        "10.0.0.1", "172.16.0.1", "192.168.1.1", "100.64.0.1", "127.0.0.1", "0.0.0.0",
        "169.254.169.254", "224.0.0.1", "240.0.0.1", "255.255.255.255", "::1", "::",
        "fe80::1", "fc00::1", "fec0::1", "ff02::1", "::ffff:127.0.0.1", "::ffff:10.0.0.1",
        "::ffff:169.254.169.254", "2002:7f00:1::", "64:ff9b::a00:1",
    ],
)  # fmt: skip
def test_a_non_global_address_or_its_ipv6_form_is_not_public(address: str) -> None:
    assert not is_public_address(ipaddress.ip_address(address))


def test_the_defaults_fetch_nothing_remote() -> None:
    settings = MediaSettings()
    assert settings.allowed_media_domains == ()
    assert settings.allow_private_media_addresses is False


def test_allowed_media_domains_are_kept_lowercase_without_a_trailing_dot() -> None:
    settings = MediaSettings(allowed_media_domains=["Images.Example.COM."])
    assert settings.allowed_media_domains == ("images.example.com",)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"allowed_media_domains": "images.test"}, "allowed_media_domains: expected a list"),
        ({"allowed_media_domains": ["https://x.test"]}, "not a bare ASCII host name"),
        ({"allowed_media_domains": ["x.test:8080"]}, "not a bare ASCII host name"),
        ({"allowed_media_domains": ["bücher.test"]}, "not a bare ASCII host name"),
        ({"allow_private_media_addresses": "yes"}, "allow_private_media_addresses: expected"),
        ({"max_image_bytes": 0}, "max_image_bytes: 0 is not an integer in [1, 1073741824]"),
        ({"max_image_pixels": 10**9}, "max_image_pixels: 1000000000 is not an integer in [1, "),
        ({"media_fetch_timeout_s": 0}, "media_fetch_timeout_s: 0 is outside (0, 600]"),
        ({"media_fetch_timeout_s": "5"}, "media_fetch_timeout_s: expected a number"),
    ],
)
def test_an_invalid_setting_is_refused_naming_the_field_and_range(
    fields: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        MediaSettings(**fields)  # type: ignore[arg-type]
