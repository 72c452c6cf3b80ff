"""HF's reference for the Qwen2.5-VL and Qwen3-VL tests: the checkpoint's model class, its
image processor and tokenizer, and the placeholder expansion of HF's Qwen VL processors (whose
classes need torchvision for their video processors, which this environment lacks); the check
that the engine's M-RoPE positions equal HF's ``get_rope_index``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import transformers
from PIL import Image
from transformers import AutoImageProcessor, AutoTokenizer

from engine import LLM
from tests.engine.vlm_checks import Case, hf_greedy, mm_prompt

MAX_TOKENS = 20


class Reference:
    """HF's model, image processor and tokenizer, with the placeholder expansion of HF's
    ``Qwen2_5_VLProcessor`` (its class needs torchvision for its video processor)."""

    def __init__(self, path: Path) -> None:
        config = json.loads((path / "config.json").read_text())
        model_class = getattr(transformers, config["architectures"][0])
        self.path = path
        self.image_processor = AutoImageProcessor.from_pretrained(path)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.config = config
        self.model = model_class.from_pretrained(path, dtype=torch.float32).eval()

    def inputs(
        self, text: str, images: list[Image.Image], special: bool = True
    ) -> dict[str, torch.Tensor]:
        out = self.image_processor(images=images, return_tensors="pt")
        merge = self.image_processor.merge_size**2
        for grid in out["image_grid_thw"]:
            text = text.replace("<|image_pad|>", "<|X|>" * int(grid.prod() // merge), 1)
        text = text.replace("<|X|>", "<|image_pad|>")
        ids = self.tokenizer(text, return_tensors="pt", add_special_tokens=special)
        input_ids = ids["input_ids"]
        image_token = self.config["image_token_id"]
        return {
            "input_ids": input_ids,
            "attention_mask": ids["attention_mask"],
            "pixel_values": out["pixel_values"],
            "image_grid_thw": out["image_grid_thw"],
            # What the processor returns (return_mm_token_type_ids): 1 on image tokens.
            "mm_token_type_ids": (input_ids == image_token).int(),
        }

    def generate(self, text: str, images: list[Image.Image], special: bool = True) -> list[int]:
        return hf_greedy(self.model, self.inputs(text, images, special), MAX_TOKENS)


def assert_positions_equal_hf(ref: Reference, model: str, cases: list[Case]) -> list[tuple]:
    """For each case the engine's expanded prompt is the processor's and its M-RoPE positions
    and delta are HF's ``get_rope_index``; returns (prompt ids, positions, HF's ``[3, n]``
    positions) per case."""
    llm = LLM(model)
    checked = []
    for text, images in cases:
        inputs = ref.inputs(text, images)
        want, delta = ref.model.model.get_rope_index(
            inputs["input_ids"], inputs["mm_token_type_ids"], inputs["image_grid_thw"]
        )
        ids = llm.get_tokenizer().encode(text)
        ids, feats = llm.llm_engine.inputs.process_multimodal(mm_prompt(text, images), ids)
        assert ids == inputs["input_ids"][0].tolist()
        mrope = llm.llm_engine.inputs.mrope_positions(ids, feats)
        assert mrope is not None and mrope.delta == int(delta)
        assert np.array_equal(mrope.array(), want[:, 0].numpy())
        checked.append((ids, mrope, want[:, 0].numpy()))
    return checked
