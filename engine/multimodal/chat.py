"""OpenAI-style chat content parts -> a text conversation and its images, for ``LLM.chat``:

    {"type": "text", "text": "..."}
    {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}   (data URLs only)
    {"type": "image_pil", "image_pil": PIL.Image}                              (vLLM's)

A message whose content holds an image part becomes one string: its parts in order, joined
by newlines, each image part replaced by the model's placeholder (``<image>``; Qwen2.5-VL's
``<|vision_start|><|image_pad|><|vision_end|>``; Gemma 3's ``<start_of_image>``), so any chat
template renders it; the images come back in prompt order. Other messages are left as they
are (a template may read text parts itself). Fetching http(s) URLs belongs to
the API edge (``cluster.api.media``), never to the engine.
"""

from __future__ import annotations

import base64
import binascii
import io
from typing import Any

from PIL import Image, UnidentifiedImageError

from engine.errors import InvalidRequestError
from engine.vlm_config import is_vlm, placeholder_token_id


def image_placeholder(hf: dict[str, Any], tokenizer: Any) -> str | None:
    """The text of one image placeholder in the model's prompts (None: a text-only model)."""
    if not is_vlm(hf):
        return None
    image = str(tokenizer.convert_ids_to_tokens(placeholder_token_id(hf)))
    if "vision_start_token_id" in hf:  # Qwen2.5-VL: <|vision_start|><|image_pad|><|vision_end|>
        start, end = tokenizer.convert_ids_to_tokens(
            [int(hf["vision_start_token_id"]), int(hf["vision_end_token_id"])]
        )
        return f"{start}{image}{end}"
    return image


def split_content_parts(
    messages: list[dict[str, Any]], placeholder: str | None
) -> tuple[list[dict[str, Any]], list[Image.Image]]:
    """(messages with string contents, their images in order); ``placeholder`` None: the
    model takes no images, and an image part is refused."""
    out, images = [], []
    for m, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list) or not any(_is_image(part) for part in content):
            out.append(message)
            continue
        pieces = []
        for p, part in enumerate(content):
            field = f"messages[{m}].content[{p}]"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                pieces.append(str(part.get("text", "")))
            elif kind in ("image_url", "image_pil"):
                if placeholder is None:
                    raise InvalidRequestError(
                        "the model is text-only: it takes no image parts", param=field
                    )
                images.append(_image_of(part, kind, field))
                pieces.append(placeholder)
            else:
                raise InvalidRequestError(
                    f"type must be 'text', 'image_url' or 'image_pil', got {kind!r}", param=field
                )
        out.append({**message, "content": "\n".join(pieces)})
    return out, images


def has_image_parts(messages: list[dict[str, Any]]) -> bool:
    return any(
        isinstance(m.get("content"), list) and any(_is_image(p) for p in m["content"])
        for m in messages
    )


def _is_image(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") in ("image_url", "image_pil")


def _image_of(part: dict[str, Any], kind: str, field: str) -> Image.Image:
    if kind == "image_pil":
        image = part.get("image_pil")
        if not isinstance(image, Image.Image):
            raise InvalidRequestError("image_pil must be a PIL image", param=field)
        return image
    spec = part.get("image_url")
    url = spec.get("url") if isinstance(spec, dict) else spec
    if not isinstance(url, str) or not url.startswith("data:"):
        raise InvalidRequestError(
            "image_url.url must be a data: URL in the engine (remote URLs are fetched by the "
            "API server)",
            param=field,
        )
    return decode_data_url(url, field)


def decode_data_url(url: str, field: str) -> Image.Image:
    """``data:image/<type>;base64,<data>`` -> a decoded PIL image."""
    header, sep, payload = url.partition(",")
    if not sep or not header.endswith(";base64") or not header[5:].startswith("image/"):
        raise InvalidRequestError(
            "image_url.url must be data:image/<type>;base64,<data>", param=field
        )
    try:
        image = Image.open(io.BytesIO(base64.b64decode(payload, validate=True)))
        image.load()
    except (binascii.Error, ValueError) as exc:
        message = f"image_url.url is not valid base64: {exc}"
        raise InvalidRequestError(message, param=field) from exc
    except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as exc:
        message = f"image_url.url is not a decodable image: {exc}"
        raise InvalidRequestError(message, param=field) from exc
    return image
