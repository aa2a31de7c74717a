"""The Llama family: Llama 2/3 (with Llama 3 rope scaling), SmolLM2, Mistral (sliding window)."""

from __future__ import annotations

from sonar.models.decoder import DecoderForCausalLM


class LlamaForCausalLM(DecoderForCausalLM):
    """Llama as published; biases by `attention_bias` / `mlp_bias`, no q/k norm."""

    architectures = ("LlamaForCausalLM",)


class MistralForCausalLM(DecoderForCausalLM):
    """Mistral: Llama's layers; `sliding_window`, when the config sets one, applies to every layer."""

    architectures = ("MistralForCausalLM",)
