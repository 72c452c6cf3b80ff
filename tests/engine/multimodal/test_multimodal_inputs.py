"""Images into the engine: ``multi_modal_data`` and chat content parts checked and expanded
on the head (``engine.multimodal``), refused by name where the model or the limits say no."""

from __future__ import annotations

import base64
import io

import msgspec
import numpy as np
import pytest
from PIL import Image

from engine import LLM, InvalidRequestError, SamplingParams
from engine.multimodal.chat import decode_data_url, split_content_parts

TEXT = "USER: <image>\nWhat is this? ASSISTANT:"
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _image(seed: int, size: tuple[int, int] = (60, 50)) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray((rng.random((*size, 3)) * 255).astype(np.uint8))


def _data_url(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


@pytest.fixture(scope="module")
def llava() -> LLM:
    return LLM("builtin:tiny-llava", limit_mm_per_prompt={"image": 2}, num_kv_blocks=64)


def test_text_only_model_refuses_an_image_naming_the_field() -> None:
    llm = LLM("builtin:tiny-llama", num_kv_blocks=16)
    with pytest.raises(InvalidRequestError) as err:
        llm.generate({"prompt": "hi", "multi_modal_data": {"image": _image(0)}}, PARAMS)
    assert err.value.param == "multi_modal_data"
    assert "text-only" in str(err.value)
    with pytest.raises(InvalidRequestError, match="text-only"):
        split_content_parts(
            [{"role": "user", "content": [{"type": "image_pil", "image_pil": _image(0)}]}], None
        )


def test_more_images_than_limit_mm_per_prompt_is_refused(llava: LLM) -> None:
    prompt = {"prompt": TEXT * 3, "multi_modal_data": {"image": [_image(i) for i in range(3)]}}
    with pytest.raises(InvalidRequestError, match="at most 2 per prompt") as err:
        llava.generate(prompt, PARAMS)
    assert err.value.param == "multi_modal_data.image"


def test_placeholders_must_match_the_images(llava: LLM) -> None:
    with pytest.raises(InvalidRequestError, match="2 images") as err:
        llava.generate({"prompt": TEXT, "multi_modal_data": {"image": [_image(0)] * 2}}, PARAMS)
    assert err.value.param == "prompt"
    with pytest.raises(InvalidRequestError, match="no image was given"):
        llava.generate(TEXT, PARAMS)


def test_an_unknown_modality_or_a_non_image_is_refused(llava: LLM) -> None:
    with pytest.raises(InvalidRequestError, match="'audio' is not supported"):
        llava.generate({"prompt": TEXT, "multi_modal_data": {"audio": b""}}, PARAMS)
    with pytest.raises(InvalidRequestError, match="PIL image") as err:
        llava.generate({"prompt": TEXT, "multi_modal_data": {"image": "cat.png"}}, PARAMS)
    assert err.value.param == "multi_modal_data.image"


def test_image_tokens_count_against_max_model_len() -> None:
    llm = LLM("builtin:tiny-llava", max_model_len=40, num_kv_blocks=16)
    # 13 text tokens + 36 image tokens > 40, although the text alone fits.
    with pytest.raises(InvalidRequestError, match="max_model_len") as err:
        llm.generate({"prompt": TEXT, "multi_modal_data": {"image": _image(0)}}, PARAMS)
    assert err.value.param == "prompt"


def test_chat_with_a_data_url_equals_generate_with_the_image(llava: LLM) -> None:
    image = _image(4)
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": _data_url(image)}},
                {"type": "text", "text": "What is this?"},
            ],
        }
    ]
    chat = llava.chat(messages, PARAMS, use_tqdm=False)[0]
    tokenizer = llava.get_tokenizer()
    text_messages = [{"role": "user", "content": "<image>\nWhat is this?"}]
    ids = tokenizer.apply_chat_template(
        text_messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    prompt = {"prompt_token_ids": list(ids), "multi_modal_data": {"image": image}}
    direct = llava.generate(prompt, PARAMS, use_tqdm=False)[0]
    assert chat.prompt_token_ids == direct.prompt_token_ids
    assert chat.outputs[0].token_ids == direct.outputs[0].token_ids


def test_image_pil_parts_and_several_images_in_order() -> None:
    first, second = _image(1), _image(2)
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "a"},
                {"type": "image_pil", "image_pil": first},
                {"type": "image_url", "image_url": {"url": _data_url(second)}},
            ],
        }
    ]
    text_messages, images = split_content_parts(messages, "<image>")
    assert text_messages == [{"role": "user", "content": "a\n<image>\n<image>"}]
    assert images[0] is first
    assert np.array_equal(np.asarray(images[1]), np.asarray(second))


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("https://example.com/cat.png", "data: URL"),
        ("data:text/plain;base64,aGk=", "data:image/"),
        ("data:image/png;base64,not base64!", "not valid base64"),
        ("data:image/png;base64," + base64.b64encode(b"not an image").decode(), "decodable"),
    ],
)
def test_bad_image_urls_are_refused_naming_the_part(url: str, reason: str) -> None:
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]
    with pytest.raises(InvalidRequestError, match=reason) as err:
        split_content_parts(messages, "<image>")
    assert err.value.param == "messages[0].content[0]"


def test_decode_data_url_reads_the_image() -> None:
    image = _image(3, (20, 30))
    decoded = decode_data_url(_data_url(image), "url")
    assert decoded.size == (30, 20)
    assert np.array_equal(np.asarray(decoded), np.asarray(image))


def test_preprocessed_features_from_a_front_are_checked_against_the_prompt(llava: LLM) -> None:
    image = _image(5)
    ids = llava.get_tokenizer().encode(TEXT)
    expanded, (feature,) = llava.llm_engine.inputs.multimodal.process(ids, {"image": image})
    direct = llava.generate({"prompt": TEXT, "multi_modal_data": {"image": image}}, PARAMS)[0]
    sent = llava.generate({"prompt_token_ids": expanded, "mm_features": [feature]}, PARAMS)[0]
    assert sent.outputs[0].token_ids == direct.outputs[0].token_ids
    moved = msgspec.structs.replace(feature, offset=feature.offset - 1)
    with pytest.raises(InvalidRequestError, match="placeholder tokens") as err:
        llava.generate({"prompt_token_ids": expanded, "mm_features": [moved]}, PARAMS)
    assert err.value.param == "mm_features"
    with pytest.raises(InvalidRequestError, match="no image covers"):
        llava.generate({"prompt_token_ids": expanded + expanded[-40:], "mm_features": [feature]},
                       PARAMS)  # fmt: skip


def test_beam_search_refuses_images(llava: LLM) -> None:
    prompt = {"prompt": TEXT, "multi_modal_data": {"image": _image(0)}}
    with pytest.raises(InvalidRequestError, match="beam search") as err:
        llava.generate(prompt, SamplingParams(use_beam_search=True, temperature=0, max_tokens=4))
    assert err.value.param == "multi_modal_data"
