"""Images of a prompt -> the model's placeholder tokens and preprocessed pixels, as HF's
``LlavaProcessor`` makes them.

Where it runs: on the CPU before the request is admitted, in the head's input processing
(``engine.core.input_processor``) for the offline engine, and on a served model's front
(``cluster.serving.request_inputs``), which sends the head pixels and expanded ids
(``check_features`` checks them there). It must run before the scheduler sees the request
(the expanded prompt is what the token budget, ``max_model_len`` and the KV cache are checked
against; the image's hash keys the prefix cache), and never on the GPU workers, whose step
loop would stall on decoding and resizing: they get float32 pixels once and run the tower.

The image processor is the checkpoint's own (``preprocessor_config.json`` through
transformers' ``AutoImageProcessor``: resize, crop, rescale, normalise; without torchvision
transformers uses its PIL implementation). Each ``<image>`` placeholder token of the prompt
becomes as many placeholder tokens as the model makes embeddings for that image
(``engine.vlm_config.image_feature_size``); a prompt already expanded that way is kept.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
from PIL import Image

from engine.errors import InvalidRequestError
from engine.multimodal.inputs import MultiModalFeature, image_feature
from engine.vlm_config import image_feature_size

logger = logging.getLogger("llm_cluster.multimodal")

MODALITIES: tuple[str, ...] = ("image",)


class MultiModalProcessor:
    """A VLM's input processing: ``hf`` its flattened config, the image processor read from
    ``model_path``; ``limits`` caps the items of each modality per prompt."""

    def __init__(self, hf: dict[str, Any], model_path: str, limits: dict[str, int]) -> None:
        self.hf = hf
        self.image_token_id = int(hf["image_token_index"])
        self.limits = limits
        # Imported for a VLM only: transformers' image processing pulls in its whole modeling
        # stack (3-8 s of imports on 2 cores), which a text model's head and replica never use.
        from transformers import AutoImageProcessor

        self.image_processor = AutoImageProcessor.from_pretrained(model_path)

    def process(self, token_ids: list[int], data: Any) -> tuple[list[int], list[MultiModalFeature]]:
        """The prompt with its image placeholders expanded, and one feature per image in
        prompt order; ``InvalidRequestError`` naming ``multi_modal_data`` or ``prompt``."""
        images = self.images_of(data)
        if not images:
            self._check_no_placeholders(token_ids)
            return token_ids, []
        pixels = self._preprocess(images)
        sizes = [image_feature_size(self.hf, p.shape[-2], p.shape[-1]) for p in pixels]
        token_ids, offsets = self._expand(token_ids, sizes)
        return token_ids, [image_feature(p, o, n) for p, o, n in zip(pixels, offsets, sizes)]

    def check_features(self, token_ids: list[int], features: Any) -> list[MultiModalFeature]:
        """Features a front preprocessed (``process`` on another host), checked against the
        expanded prompt: in order, each over a run of placeholder tokens exactly as long as
        its image's embeddings, its pixels whole, every placeholder covered, within the
        limit."""
        if not isinstance(features, list) or not all(
            isinstance(f, MultiModalFeature) for f in features
        ):
            raise InvalidRequestError("must be a list of MultiModalFeature", param="mm_features")
        limit = self.limits.get("image")
        if limit is not None and len(features) > limit:
            raise InvalidRequestError(
                f"has {len(features)} images; at most {limit} per prompt (limit_mm_per_prompt)",
                param="multi_modal_data.image",
            )
        token, end = self.image_token_id, 0
        for i, f in enumerate(features):
            size = image_feature_size(self.hf, *f.shape[-2:]) if len(f.shape) == 3 else -1
            whole = len(f.pixel_values) == 4 * int(np.prod(f.shape))
            placed = f.offset >= end and token_ids[f.offset : f.end] == [token] * f.length
            if f.modality != "image" or f.length != size or not whole or not placed:
                raise InvalidRequestError(
                    f"item {i} does not match the prompt's placeholder tokens or its pixels",
                    param="mm_features",
                )
            end = f.end
        if token_ids.count(token) != sum(f.length for f in features):
            raise InvalidRequestError(
                "the prompt has image placeholder tokens no image covers", param="mm_features"
            )
        return list(features)

    def images_of(self, data: Any) -> list[Image.Image]:
        if data is None:
            return []
        if not isinstance(data, dict):
            raise InvalidRequestError(
                "must be a mapping of modality to items, e.g. {'image': image}",
                param="multi_modal_data",
            )
        for key in data:
            if key not in MODALITIES:
                raise InvalidRequestError(
                    f"{key!r} is not supported (supported: {', '.join(MODALITIES)})",
                    param="multi_modal_data",
                )
        items = data.get("image")
        images = [] if items is None else items if isinstance(items, list) else [items]
        for i, image in enumerate(images):
            if not isinstance(image, Image.Image):
                raise InvalidRequestError(
                    f"item {i} must be a PIL image, got {type(image).__name__}",
                    param="multi_modal_data.image",
                )
        limit = self.limits.get("image")
        if limit is not None and len(images) > limit:
            raise InvalidRequestError(
                f"has {len(images)} images; at most {limit} per prompt (limit_mm_per_prompt)",
                param="multi_modal_data.image",
            )
        return images

    def _preprocess(self, images: list[Image.Image]) -> list[np.ndarray]:
        try:
            out = self.image_processor(images=images, return_tensors="np")
        except (ValueError, OSError, TypeError) as exc:
            raise InvalidRequestError(
                f"the image processor cannot read it: {exc}", param="multi_modal_data.image"
            ) from exc
        return [np.asarray(p, dtype=np.float32) for p in out["pixel_values"]]

    def _check_no_placeholders(self, token_ids: list[int]) -> None:
        count = token_ids.count(self.image_token_id)
        if count:
            raise InvalidRequestError(
                f"the prompt has {count} image placeholder tokens (id {self.image_token_id}) "
                "but no image was given",
                param="multi_modal_data",
            )

    def _expand(self, token_ids: list[int], sizes: list[int]) -> tuple[list[int], list[int]]:
        """(expanded prompt, each image's offset). One placeholder per image is expanded to
        its size; a prompt holding each image's full run of placeholders is kept."""
        token = self.image_token_id
        positions = [i for i, t in enumerate(token_ids) if t == token]
        if len(positions) == len(sizes):
            out: list[int] = []
            offsets = []
            last = 0
            for pos, size in zip(positions, sizes):
                out.extend(token_ids[last:pos])
                offsets.append(len(out))
                out.extend([token] * size)
                last = pos + 1
            out.extend(token_ids[last:])
            return out, offsets
        if len(positions) == sum(sizes):
            offsets, start = [], 0
            for size in sizes:
                run = positions[start : start + size]
                if run[-1] - run[0] != size - 1:
                    break
                offsets.append(run[0])
                start += size
            else:
                return token_ids, offsets
        raise InvalidRequestError(
            f"the prompt has {len(positions)} image placeholder tokens (id {token}) for "
            f"{len(sizes)} images: it needs one placeholder per image (or each image's "
            f"{sizes} placeholders, already expanded)",
            param="prompt",
        )
