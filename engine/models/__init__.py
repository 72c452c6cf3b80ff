"""Model registry: HF ``architectures`` name -> model class (one file per family)."""

from __future__ import annotations

from torch import nn

from engine.errors import ConfigError
from engine.hf_config import SUPPORTED_ARCHITECTURES
from engine.models.deepseek import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from engine.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from engine.models.glm4_moe import Glm4MoeForCausalLM
from engine.models.gpt_oss import GptOssForCausalLM
from engine.models.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM
from engine.models.mixtral import MixtralForCausalLM
from engine.models.phi3 import Phi3ForCausalLM
from engine.models.qwen3 import Qwen3ForCausalLM
from engine.models.qwen_moe import Qwen2MoeForCausalLM, Qwen3MoeForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Glm4MoeForCausalLM": Glm4MoeForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}


def get_model_class(architecture: str) -> type[nn.Module]:
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        raise ConfigError(
            f"architectures: {architecture or '(none)'!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        ) from None
