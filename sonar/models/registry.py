"""Hugging Face `architectures` names -> Sonar model classes."""

from __future__ import annotations

from typing import Any

from torch import nn

from sonar.models.bert import (
    BertForSequenceClassification,
    BertModel,
    RobertaForSequenceClassification,
    RobertaModel,
    XLMRobertaForSequenceClassification,
    XLMRobertaModel,
)
from sonar.models.classifier import (
    LlamaForSequenceClassification,
    MistralForSequenceClassification,
    Qwen2ForSequenceClassification,
    Qwen3ForSequenceClassification,
)
from sonar.models.deepseek import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from sonar.models.errors import UnsupportedArchitectureError
from sonar.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM, GemmaForCausalLM
from sonar.models.gemma3_vl import Gemma3ForConditionalGeneration
from sonar.models.glm4 import Glm4ForCausalLM
from sonar.models.gpt_oss import GptOssForCausalLM
from sonar.models.granite import GraniteForCausalLM
from sonar.models.llama import LlamaForCausalLM, MistralForCausalLM
from sonar.models.llava import LlavaForConditionalGeneration
from sonar.models.llava_next import LlavaNextForConditionalGeneration
from sonar.models.mixtral import MixtralForCausalLM
from sonar.models.olmo2 import Olmo2ForCausalLM
from sonar.models.phi3 import Phi3ForCausalLM
from sonar.models.qwen2 import Qwen2ForCausalLM
from sonar.models.qwen2_vl import Qwen2_5_VLForConditionalGeneration, Qwen2VLForConditionalGeneration
from sonar.models.qwen3 import Qwen3ForCausalLM
from sonar.models.qwen3_vl import Qwen3VLForConditionalGeneration
from sonar.models.qwen3_vl_moe import Qwen3VLMoeForConditionalGeneration
from sonar.models.qwen_moe import Qwen2MoeForCausalLM, Qwen3MoeForCausalLM
from sonar.models.token_classifier import (
    BertForTokenClassification,
    LlamaForTokenClassification,
    MistralForTokenClassification,
    Qwen2ForTokenClassification,
    Qwen3ForTokenClassification,
    RobertaForTokenClassification,
    XLMRobertaForTokenClassification,
)

MODEL_CLASSES: dict[str, type[nn.Module]] = {
    name: cls
    for cls in (
        LlamaForCausalLM,
        MistralForCausalLM,
        Qwen2ForCausalLM,
        Qwen3ForCausalLM,
        Phi3ForCausalLM,
        GraniteForCausalLM,
        Olmo2ForCausalLM,
        Glm4ForCausalLM,
        MixtralForCausalLM,
        Qwen2MoeForCausalLM,
        Qwen3MoeForCausalLM,
        GemmaForCausalLM,
        Gemma2ForCausalLM,
        Gemma3ForCausalLM,
        Gemma3ForConditionalGeneration,
        GptOssForCausalLM,
        DeepseekV2ForCausalLM,
        DeepseekV3ForCausalLM,
        LlavaForConditionalGeneration,
        LlavaNextForConditionalGeneration,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLForConditionalGeneration,
        Qwen3VLForConditionalGeneration,
        Qwen3VLMoeForConditionalGeneration,
        LlamaForSequenceClassification,
        MistralForSequenceClassification,
        Qwen2ForSequenceClassification,
        Qwen3ForSequenceClassification,
        BertModel,
        RobertaModel,
        XLMRobertaModel,
        BertForSequenceClassification,
        RobertaForSequenceClassification,
        XLMRobertaForSequenceClassification,
        BertForTokenClassification,
        RobertaForTokenClassification,
        XLMRobertaForTokenClassification,
        LlamaForTokenClassification,
        MistralForTokenClassification,
        Qwen2ForTokenClassification,
        Qwen3ForTokenClassification,
    )
    for name in cls.architectures
}
"""Causal LMs (`DecoderForCausalLM`), decoder classifiers (`sonar.models.classifier`), encoders
(`sonar.models.bert`) and token classifiers (`sonar.models.token_classifier`): see each base class
for the runner's contract."""


#: Architectures Sonar knows of and does not serve, with why (a clearer refusal than "unsupported").
REFUSED: dict[str, str] = {}


def supported_architectures() -> list[str]:
    return sorted(MODEL_CLASSES)


def model_class(config: Any) -> type[nn.Module]:
    """The class for a config's (object or `config.json` dict) first listed architecture that Sonar implements."""
    get = config.get if isinstance(config, dict) else lambda key: getattr(config, key, None)
    names = list(get("architectures") or [])
    for name in names:
        if name in MODEL_CLASSES:
            return MODEL_CLASSES[name]
    for name in names:
        if name in REFUSED:
            raise UnsupportedArchitectureError(f"{name}: {REFUSED[name]}")
    shown = ", ".join(names) if names else "none listed"
    raise UnsupportedArchitectureError(
        f"unsupported model architecture: {shown} (model_type {get('model_type')!r}); "
        f"Sonar implements {', '.join(supported_architectures())}"
    )


def sequence_classifier(cls: type[nn.Module]) -> type[nn.Module]:
    """The ``*ForSequenceClassification`` class of a causal LM's class (``--convert classify``);
    a class that classifies already, or an encoder, as it is."""
    if hasattr(cls, "classify") or not getattr(cls, "is_causal", True):
        return cls
    for name in cls.architectures:
        found = MODEL_CLASSES.get(name.replace("ForCausalLM", "ForSequenceClassification"))
        if found is not None:
            return found
    raise UnsupportedArchitectureError(f"{cls.__name__} has no sequence-classification counterpart in Sonar")
