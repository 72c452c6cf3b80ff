"""Model registry: HF ``architectures`` name -> model class (one file per family), and the
class a ``ModelConfig`` builds (``model_class``: the family under its task's head)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from engine.errors import ConfigError
from engine.hf_config import SUPPORTED_ARCHITECTURES
from engine.models.deepseek import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from engine.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from engine.models.gemma3_mm import Gemma3ForConditionalGeneration
from engine.models.glm4_moe import Glm4MoeForCausalLM
from engine.models.gpt_oss import GptOssForCausalLM
from engine.models.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM
from engine.models.llava import LlavaForConditionalGeneration
from engine.models.mixtral import MixtralForCausalLM
from engine.models.phi3 import Phi3ForCausalLM
from engine.models.pooling_heads import with_head
from engine.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration
from engine.models.qwen3 import Qwen3ForCausalLM
from engine.models.qwen3_vl import Qwen3VLForConditionalGeneration
from engine.models.qwen_moe import Qwen2MoeForCausalLM, Qwen3MoeForCausalLM

if TYPE_CHECKING:
    from engine.config_sections import ModelConfig

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Gemma3ForConditionalGeneration": Gemma3ForConditionalGeneration,
    "Glm4MoeForCausalLM": Glm4MoeForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "LlavaForConditionalGeneration": LlavaForConditionalGeneration,
    "MistralForCausalLM": MistralForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen2_5_VLForConditionalGeneration": Qwen2_5_VLForConditionalGeneration,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Qwen3VLForConditionalGeneration": Qwen3VLForConditionalGeneration,
}


def get_model_class(architecture: str) -> type[nn.Module]:
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        raise ConfigError(
            f"architectures: {architecture or '(none)'!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        ) from None


def model_class(model: ModelConfig) -> type[nn.Module]:
    """The class to build for ``model``: its family's causal LM, or that decoder under the
    pooling head of its task (``engine.models.pooling_heads``)."""
    family = get_model_class(model.architecture)
    task = model.task
    if task == "generate":
        return family
    return with_head(family, task, model.classifier_token_ids if task == "classify" else ())
