"""LLMServer without Ray, for a vision-language model: a chat's image parts (data URLs) are
decoded and preprocessed on the front and reach the engine as pixels and expanded prompt ids;
the output equals the offline engine's on the same image. A text-only model refuses them."""

from __future__ import annotations

import asyncio
import base64
import io
from typing import Any

import msgspec
import numpy as np
import pytest
from PIL import Image

from cluster.api.replica_messages import GenerateRequest, StreamDelta
from cluster.serving.llm_server import LLMServer
from engine import LLM, SamplingParams

LLAVA_ARGS = {"model": "builtin:tiny-llava", "num_kv_blocks": 64, "device": "cpu"}
QWEN_VL_ARGS = {"model": "builtin:tiny-qwen2.5-vl", "num_kv_blocks": 64, "device": "cpu"}
QWEN3_VL_ARGS = {"model": "builtin:tiny-qwen3-vl", "num_kv_blocks": 64, "device": "cpu"}
PARAMS = {"temperature": 0, "max_tokens": 10, "ignore_eos": True}


def _data_url(seed: int) -> str:
    rng = np.random.default_rng(seed)
    image = Image.fromarray((rng.random((50, 70, 3)) * 255).astype(np.uint8))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def _messages(url: str) -> list[dict[str, Any]]:
    parts = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "Hm?"}]
    return [{"role": "user", "content": parts}]


def _collect(server: LLMServer, request: dict[str, Any]) -> list[dict[str, Any]]:
    async def run() -> list[dict[str, Any]]:
        items = []
        async for item in server.generate(GenerateRequest(**request)):
            data = msgspec.to_builtins(item)
            if isinstance(item, StreamDelta):
                data["choices"] = [msgspec.structs.asdict(c) for c in item.choices]
            items.append(data)
        return items

    return asyncio.run(run())


@pytest.mark.parametrize(
    "args", [LLAVA_ARGS, QWEN_VL_ARGS, QWEN3_VL_ARGS], ids=["llava", "qwen2.5-vl", "qwen3-vl"]
)
def test_chat_image_part_reaches_the_engine_as_offline(args: dict[str, Any]) -> None:
    # Qwen2.5-VL: the patch grid travels in the feature, the head computes the M-RoPE positions.
    server = LLMServer(args["model"].removeprefix("builtin:"), args)
    try:
        url = _data_url(0)
        items = _collect(server, {"messages": _messages(url), "params": PARAMS})
        offline = LLM(**args).chat(_messages(url), SamplingParams(**PARAMS), use_tqdm=False)[0]
        assert items[0]["type"] == "start"
        assert items[0]["prompt_tokens"] == len(offline.prompt_token_ids)
        tokens = [t for i in items[1:] for c in i["choices"] for t in c["token_ids"]]
        assert tokens == list(offline.outputs[0].token_ids)
        # /tokenize counts the image's tokens as the engine sees them.
        counted = asyncio.run(server.tokenize(GenerateRequest(messages=_messages(url))))
        assert counted.tokens == list(offline.prompt_token_ids)
        # Another image behind the same text: its own answer.
        other = _collect(server, {"messages": _messages(_data_url(1)), "params": PARAMS})
        assert [t for i in other[1:] for c in i["choices"] for t in c["token_ids"]] != tokens
    finally:
        server.engine.shutdown()


def test_an_undecodable_image_is_a_400_naming_the_part() -> None:
    server = LLMServer("tiny-llava", LLAVA_ARGS)
    try:
        bad = "data:image/png;base64," + base64.b64encode(b"not a png").decode()
        items = _collect(server, {"messages": _messages(bad), "params": PARAMS})
        assert items[0]["type"] == "error" and items[0]["status"] == 400
        assert items[0]["param"] == "messages[0].content[0]"
        # The server keeps serving.
        good = _collect(server, {"messages": _messages(_data_url(2)), "params": PARAMS})
        assert good[0]["type"] == "start"
    finally:
        server.engine.shutdown()


def test_a_text_only_model_refuses_an_image_part() -> None:
    server = LLMServer("tiny", {"model": "builtin:tiny-llama", "num_kv_blocks": 16})
    try:
        items = _collect(server, {"messages": _messages(_data_url(0)), "params": PARAMS})
        assert items[0]["type"] == "error" and items[0]["status"] == 400
        assert items[0]["param"] == "messages[0].content[0]"
        assert "text-only" in items[0]["message"]
    finally:
        server.engine.shutdown()
