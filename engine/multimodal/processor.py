"""Images of a prompt -> the model's placeholder tokens and preprocessed pixels, as HF's
``LlavaProcessor`` / ``Qwen2_5_VLProcessor`` / ``Gemma3Processor`` make them.

It runs on the CPU before the request is admitted (the head's ``engine.core.input_processor``,
or a served model's front, ``cluster.serving.request_inputs``, whose pixels and expanded ids
``check_features`` checks): the expanded prompt is what the budgets and the KV cache are
checked against, the image's hash keys the prefix cache. Never on the workers (it would stall
their step loop).

The image processor is the checkpoint's own (``preprocessor_config.json`` through
transformers' ``AutoImageProcessor``; without torchvision its PIL implementation). Each
``<image>`` placeholder becomes as many image tokens as the model makes embeddings for that
image (``engine.vlm_config.image_feature_size``; Qwen2.5-VL: its merged patch grid,
``engine.qwen_vl_config.image_token_count``); an expanded prompt is kept. Gemma 3's
``<start_of_image>`` becomes ``"\\n\\n" <start_of_image> <image_soft_token> x
mm_tokens_per_image <end_of_image> "\\n\\n"``, the newlines encoded with the prompt text
around them as HF's tokenizer encodes the expanded text; the image's span is its soft tokens.
Pan-and-scan crops (``do_pan_and_scan``) are refused.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
from PIL import Image
from transformers import AutoTokenizer

from engine.errors import ConfigError, InvalidRequestError
from engine.multimodal.inputs import MultiModalFeature, image_feature
from engine.qwen_vl_config import QWEN_VL_ARCHITECTURES, image_token_count
from engine.vlm_config import GEMMA3_VLM, image_feature_size, placeholder_token_id

logger = logging.getLogger("llm_cluster.multimodal")

MODALITIES: tuple[str, ...] = ("image",)


class MultiModalProcessor:
    """A VLM's input processing: ``hf`` its flattened config, the image processor read from
    ``model_path``; ``limits`` caps the items of each modality per prompt."""

    def __init__(self, hf: dict[str, Any], model_path: str, limits: dict[str, int]) -> None:
        self.hf = hf
        self.image_token_id = int(hf["image_token_index"])
        # The token a prompt holds once per image (Gemma 3: <start_of_image>).
        self.placeholder_id = placeholder_token_id(hf)
        self.limits = limits
        # Imported for a VLM only: transformers' image processing pulls in its whole modeling
        # stack (3-8 s of imports on 2 cores), which a text model's head and replica never use.
        from transformers import AutoImageProcessor

        self.image_processor = AutoImageProcessor.from_pretrained(model_path)
        # Gemma 3 wraps each image's run in "\n\n" <start_of_image> ... <end_of_image> "\n\n".
        self.tokenizer: Any = None
        self.eoi_id = -1
        if hf["architectures"][0] == GEMMA3_VLM:
            if getattr(self.image_processor, "do_pan_and_scan", None):
                raise ConfigError(
                    "do_pan_and_scan: Gemma 3's pan-and-scan crops are not supported; set "
                    "do_pan_and_scan to false in preprocessor_config.json"
                )
            self.tokenizer = AutoTokenizer.from_pretrained(model_path)
            self.eoi_id = int(hf["eoi_token_index"])
            self._special_ids = {
                *self.tokenizer.all_special_ids,
                self.placeholder_id,
                self.eoi_id,
                self.image_token_id,
            }

    def process(self, token_ids: list[int], data: Any) -> tuple[list[int], list[MultiModalFeature]]:
        """The prompt with its image placeholders expanded, and one feature per image in
        prompt order; ``InvalidRequestError`` naming ``multi_modal_data`` or ``prompt``."""
        images = self.images_of(data)
        if not images:
            self._check_no_placeholders(token_ids)
            return token_ids, []
        pixels, grids = self._preprocess(images)
        sizes = [self.num_tokens(p.shape, g) for p, g in zip(pixels, grids)]
        token_ids, offsets = self._expand(token_ids, sizes)
        return token_ids, [
            image_feature(p, o, n, g) for p, o, n, g in zip(pixels, offsets, sizes, grids)
        ]

    def num_tokens(self, shape: tuple[int, ...], grid_thw: tuple[int, ...]) -> int:
        """Image tokens of preprocessed pixels of ``shape`` (and patch grid); -1 for pixels
        this model's processor does not make."""
        if self.hf["architectures"][0] in QWEN_VL_ARCHITECTURES:
            vision = self.hf["vision_config"]
            patch = (
                vision["in_channels"] * vision["temporal_patch_size"] * vision["patch_size"] ** 2
            )
            if len(grid_thw) != 3 or tuple(shape) != (int(np.prod(grid_thw)), patch):
                return -1
            merge = vision["spatial_merge_size"]
            if grid_thw[1] % merge or grid_thw[2] % merge:
                return -1
            return image_token_count(self.hf, grid_thw)
        if len(shape) != 3 or grid_thw:
            return -1
        return image_feature_size(self.hf, shape[-2], shape[-1])

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
            size = self.num_tokens(f.shape, f.grid_thw)
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

    def _preprocess(
        self, images: list[Image.Image]
    ) -> tuple[list[np.ndarray], list[tuple[int, ...]]]:
        """Each image's pixels and patch grid (``()`` unless the processor makes one)."""
        try:
            out = self.image_processor(images=images, return_tensors="np")
        except (ValueError, OSError, TypeError) as exc:
            raise InvalidRequestError(
                f"the image processor cannot read it: {exc}", param="multi_modal_data.image"
            ) from exc
        pixels = np.asarray(out["pixel_values"], dtype=np.float32)
        if "image_grid_thw" not in out:
            return list(pixels), [()] * len(pixels)
        # Qwen2-VL's processor: all images' patches in one array, split by each one's grid.
        grids = [tuple(int(x) for x in g) for g in out["image_grid_thw"]]
        ends = np.cumsum([int(np.prod(g)) for g in grids])[:-1]
        return list(np.split(pixels, ends)), grids

    def _check_no_placeholders(self, token_ids: list[int]) -> None:
        count = token_ids.count(self.image_token_id)
        if count:
            raise InvalidRequestError(
                f"the prompt has {count} image placeholder tokens (id {self.image_token_id}) "
                "but no image was given",
                param="multi_modal_data",
            )

    def _join_text(self, out: list[int], at: int, newlines: str, *, before: bool) -> None:
        """Put ``newlines`` into ``out`` at ``at`` as HF's tokenizer puts them in the expanded
        text: it splits the text at special tokens and encodes each piece whole, so the text
        tokens next to ``at`` (back to the previous special token, or on to the next) are
        re-encoded with them (a tokenizer with tokens for runs of newlines, Gemma's, merges
        the prompt's newlines with the image's)."""
        lo, hi = at, at
        if before:
            while lo > 0 and out[lo - 1] not in self._special_ids:
                lo -= 1
        else:
            while hi < len(out) and out[hi] not in self._special_ids:
                hi += 1
        run = self.tokenizer.decode(out[lo:hi])
        text = run + newlines if before else newlines + run
        out[lo:hi] = self.tokenizer.encode(text, add_special_tokens=False)

    def _expand(self, token_ids: list[int], sizes: list[int]) -> tuple[list[int], list[int]]:
        """(expanded prompt, each image's offset). One placeholder per image is expanded to
        its size (with the model's tokens around it); a prompt holding each image's full run
        of image tokens is kept."""
        token = self.image_token_id
        positions = [i for i, t in enumerate(token_ids) if t == token]
        if positions and len(positions) == sum(sizes):
            offsets, start = [], 0
            for size in sizes:
                run = positions[start : start + size]
                if run[-1] - run[0] != size - 1:
                    break
                offsets.append(run[0])
                start += size
            else:
                return token_ids, offsets
        placeholders = [i for i, t in enumerate(token_ids) if t == self.placeholder_id]
        unexpanded = not positions or self.placeholder_id == token
        if unexpanded and len(placeholders) == len(sizes):
            out: list[int] = []
            offsets = []
            last = 0
            for pos, size in zip(placeholders, sizes):
                out.extend(token_ids[last:pos])
                if self.tokenizer is None:
                    offsets.append(len(out))
                    out.extend([token] * size)
                    last = pos + 1
                    continue
                self._join_text(out, len(out), "\n\n", before=True)
                out.append(self.placeholder_id)
                offsets.append(len(out))
                out.extend([token] * size)
                out.append(self.eoi_id)
                last = pos + 1
                end = last
                while end < len(token_ids) and token_ids[end] not in self._special_ids:
                    end += 1
                out.extend(token_ids[last:end])
                self._join_text(out, len(out) - (end - last), "\n\n", before=False)
                last = end
            out.extend(token_ids[last:])
            return out, offsets
        raise InvalidRequestError(
            f"the prompt has {len(placeholders)} image placeholder tokens (id "
            f"{self.placeholder_id}) and {len(positions)} image tokens (id {token}) for "
            f"{len(sizes)} images: it needs one placeholder per image (or each image's "
            f"{sizes} image tokens, already expanded)",
            param="prompt",
        )
