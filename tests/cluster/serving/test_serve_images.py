"""Images through ``cluster serve``'s app with the official ``openai`` client, on
``builtin:tiny-llava`` (a random-weight LLaVA with its real processor):

- a data-URL image in chat, streamed and not, gives the offline engine's greedy text for the
  same messages; another image gives its own answer;
- the Responses API's ``input_image`` is the chat image part;
- an http URL on a local server (``media.allowed_media_domains: [localhost]`` with private
  addresses allowed) is fetched by the ingress and served like the same image inline; a host
  not allowed is a 400 naming the part;
- an undecodable or oversized image is a 400 naming the part, and the server keeps serving."""

from __future__ import annotations

import base64
import io
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import numpy as np
import pytest
from openai import BadRequestError, OpenAI
from PIL import Image

from engine import LLM, SamplingParams
from tests.cluster.conftest import ServeCluster

APP = "images"
MODEL = "tiny-llava"
ENGINE = {"device": "cpu", "dtype": "float32", "max_model_len": 1024, "num_kv_blocks": 128}
MAX_IMAGE_BYTES = 100_000

pytestmark = pytest.mark.slow


def _png(seed: int, size: tuple[int, int] = (70, 50)) -> bytes:
    rng = np.random.default_rng(seed)
    pixels = (rng.random((size[1], size[0], 3)) * 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def _data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def _ask(url: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "What is this?"}]}]  # fmt: skip


@pytest.fixture(scope="module")
def image_server() -> Iterator[str]:
    """http://localhost:<port>/ serving /a.png (``_png(1)``)."""
    body = _png(1)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path != "/a.png":
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://localhost:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture(scope="module")
def client(serve_cluster: ServeCluster) -> Iterator[OpenAI]:
    from ray import serve

    config = {
        "models": [{"model_loading_config": {"model_id": MODEL,
                                             "model_source": "builtin:tiny-llava"},
                    "engine_kwargs": ENGINE, "deployment_config": {"num_replicas": 1}}],
        "media": {"allowed_media_domains": ["localhost"], "allow_private_media_addresses": True,
                  "max_image_bytes": MAX_IMAGE_BYTES},
    }  # fmt: skip
    url = serve_cluster.deploy(config, APP, f"/{APP}")
    yield OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    serve.delete(APP)


@pytest.fixture(scope="module")
def offline() -> LLM:
    return LLM("builtin:tiny-llava", **ENGINE)


def _chat(client: OpenAI, messages: Any, stream: bool = False) -> str:
    args = {"model": MODEL, "messages": messages, "max_tokens": 10, "temperature": 0}
    if not stream:
        return client.chat.completions.create(**args).choices[0].message.content or ""
    chunks = client.chat.completions.create(**args, stream=True)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def _offline(llm: LLM, messages: Any) -> str:
    params = SamplingParams(temperature=0, max_tokens=10)
    return llm.chat(messages, params, use_tqdm=False)[0].outputs[0].text


def test_a_data_url_image_in_chat_answers_as_offline(client: OpenAI, offline: LLM) -> None:
    first, second = _ask(_data_url(_png(0))), _ask(_data_url(_png(7, (40, 90))))
    expected = _offline(offline, first)
    assert _chat(client, first) == expected
    assert _chat(client, first, stream=True) == expected
    assert _chat(client, second) == _offline(offline, second) != expected


def test_the_responses_api_input_image_is_the_chat_image(client: OpenAI, offline: LLM) -> None:
    url = _data_url(_png(0))
    reply = client.responses.create(
        model=MODEL, max_output_tokens=10, temperature=0,
        input=[{"role": "user", "content": [{"type": "input_image", "image_url": url},
                                            {"type": "input_text", "text": "What is this?"}]}],
    )  # fmt: skip
    assert reply.output_text == _offline(offline, _ask(url))


def test_an_allowed_url_is_fetched_and_served_as_the_same_image_inline(
    client: OpenAI, image_server: str
) -> None:
    assert _chat(client, _ask(f"{image_server}/a.png")) == _chat(client, _ask(_data_url(_png(1))))


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("http://127.0.0.1:9/a.png", "not in allowed_media_domains"),
        ("data:image/png;base64,bm90IGFuIGltYWdl", "could not be decoded"),
        (_data_url(_png(3, (400, 400))), "max_image_bytes=100000"),
        ("ftp://localhost/a.png", "only data:image"),
    ],
)
def test_a_refused_image_is_a_400_naming_the_part_and_the_server_keeps_serving(
    client: OpenAI, url: str, message: str
) -> None:
    with pytest.raises(BadRequestError) as info:
        _chat(client, _ask(url))
    body: Any = info.value.body
    assert body["param"] == "messages.0.content.0.image_url.url" and message in body["message"]
    assert _chat(client, [{"role": "user", "content": "Still there?"}])
