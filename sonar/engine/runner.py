"""The model runner of one device: the weights, the KV cache tensors, and one step's forward pass.

It keeps, per running request, only what sampling needs (parameters, prompt and output ids); the
scheduler resends that state whenever a request (re)starts, so a new runner can be rebuilt from
the scheduler alone. Everything here is synchronous; the worker actor runs it in a thread.

The device is CUDA when torch sees one (`sonar.engine.device`; ``SONAR_DEVICE=cpu`` forces the
CPU), else the CPU. On CUDA, startup checks ``--gpu-memory-utilization`` against the free memory,
profiles a forward pass and the CUDA graphs, gives the rest to the KV cache
(`sonar.engine.memory`), and captures one graph per decode batch size (`sonar.engine.cudagraph`):
a pure-decode step replays the graph of the smallest size that holds it, any other step runs
eagerly. On CPU the KV cache has a fixed default size, linear weights are prepacked for oneDNN,
and every step runs eagerly and unpadded.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import torch

from sonar.core.outputs import PLACEHOLDER_TOKEN, ScheduledRequest, SchedulerOutput
from sonar.core.request import LoRARequest
from sonar.core.speculative import Proposer, make_proposer
from sonar.engine import memory
from sonar.engine.compile import CompiledForward, compile_forward
from sonar.engine.config import EngineConfig
from sonar.engine.cudagraph import CudaGraphs, DecodeBuffers
from sonar.engine.device import memory_info, select_device
from sonar.engine.drafter import Drafter, EagleDrafter, StepView
from sonar.engine.encoder_cache import EncoderCache
from sonar.engine.logits_processors import ProcessorChain, load_classes
from sonar.engine.nodes import replicas_here
from sonar.engine.otlp import clock_pair, epoch_ns
from sonar.engine.ranks import SOLO, Topology
from sonar.engine.settings import capture_sizes
from sonar.errors import SonarError
from sonar.kernels import native, ops
from sonar.kernels.attention import AttentionMetadata, allocate_kv_caches
from sonar.kernels.attention_op import step_metadata
from sonar.kernels.linear import prepack_linears
from sonar.log import get_logger
from sonar.lora.limits import ModelShapes
from sonar.lora.slots import AdapterSlots
from sonar.models.eagle3 import AuxCapture, head_aux_layer_ids
from sonar.models.eplb import ExpertBalancer
from sonar.models.errors import ModelLoadError
from sonar.models.head_vocab import gather_vocab
from sonar.models.loader import LoadedModel, load_model
from sonar.models.moe import quantized_experts
from sonar.models.parallel import SINGLE, TensorParallel
from sonar.models.pooler import Pooler, PoolState, pooling_info, sentence_transformers_max_len, wants_pooling
from sonar.models.rotary import LONG_ROPE
from sonar.models.sampler import LogprobsTensors, Sampler, SamplingBatch, compute_prompt_logprobs, is_plain_greedy
from sonar.multimodal.limits import image_limit
from sonar.pooling_params import PoolingParams
from sonar.protocol.engine import (
    ExecuteStep,
    ImageInput,
    StepResult,
    StepTokens,
    TokenLogprobs,
    VisionInfo,
    WorkerInfo,
    WorkerSpan,
)
from sonar.sampling_params import GREEDY_EPS, SamplingParams
from sonar.structured.bitmask import apply_token_bitmask
from sonar.units import format_memory_size

log = get_logger("sonar.runner")


def compile_wanted(config: EngineConfig, device: torch.device) -> bool:
    """Whether the runner compiles its forward pass: never with ``enforce_eager``; from ``-O2``
    (the default) on CUDA, only at ``-O3`` on the CPU (see `EngineConfig.optimization_level`)."""
    if config.enforce_eager:
        return False
    return config.optimization_level >= (2 if device.type == "cuda" else 3)


def worker_spans(
    config: EngineConfig, execute: tuple[int, int], forward: tuple[int, int], sample: tuple[int, int]
) -> list[WorkerSpan]:
    """A step's parts as spans, for the modules --collect-detailed-traces names: ``worker`` the
    whole step and its sampling, ``model`` the forward pass; `time.monotonic_ns` intervals, of
    which ``(0, 0)`` were not timed, converted to the epoch here, in the process that read them."""
    now = clock_pair()
    parts = []
    if config.trace_worker:
        parts += [("worker.execute", execute), ("worker.sample", sample)]
    if config.trace_model:
        parts.append(("model.forward", forward))
    return [WorkerSpan(name, epoch_ns(start, now), epoch_ns(end, now)) for name, (start, end) in parts if end]


class UnknownRequestError(SonarError, RuntimeError):
    """A step names a request this runner was never given (a step meant for a predecessor)."""


@dataclass
class _RequestState:
    params: SamplingParams
    prompt: list[int]
    output: list[int]
    plain_greedy: bool = False
    """`is_plain_greedy(params)`, computed once: such rows skip building a `SamplingBatch`."""
    lora: LoRARequest | None = None
    pooling: PoolingParams | None = None
    pool: PoolState | None = None
    """A pooling request: what it has kept of its hidden states so far."""
    images: list[ImageInput] = field(default_factory=list)
    features: dict[int, torch.Tensor] = field(default_factory=dict)
    """Image index -> its feature rows, kept from the step that reaches its first placeholder to
    the one that passes its last (a chunked prefill reads them over several steps)."""
    mrope: torch.Tensor | None = None
    """M-RoPE (Qwen2-VL) with images: the prompt's positions ``[3, prompt length]``; a later
    token's are its position plus `mrope_delta` in all three."""
    mrope_delta: int = 0

    def rope_positions(self, start: int, n: int) -> list[int]:
        """The rotary positions of ``[start, start + n)`` where the three M-RoPE rows agree (text)."""
        if self.mrope is None:
            return list(range(start, start + n))
        prompt = self.mrope.shape[1]
        inside = self.mrope[0, start : min(start + n, prompt)].tolist()
        return inside + list(range(max(start, prompt) + self.mrope_delta, start + n + self.mrope_delta))

    embeds: torch.Tensor | None = None
    """A prompt given as input embeddings (`sonar.engine.prompt_embeds`): ``[prompt, hidden]``."""

    @property
    def prompt_tokens(self) -> list[int] | None:
        """The prompt's tokens as sampling sees them: None for an embeddings prompt (its ids are
        placeholders)."""
        return None if self.embeds is not None else self.prompt


def vision_info(model: Any) -> VisionInfo | None:
    """What the frontend needs to send this model images; None for a text-only model."""
    if hasattr(model, "vision_info"):
        return model.vision_info()
    if not hasattr(model, "encode_images"):
        return None
    return VisionInfo(model.image_token_id, model.tokens_per_image, model.image_size)


def kv_layout(model: Any) -> tuple[int, int, int]:
    """(layers, KV heads, head size) of the model's KV cache. An encoder keeps none (its prompt
    is attended whole, in one step), but the scheduler still counts blocks: one of a single value."""
    if not getattr(model, "is_causal", True):
        return 1, 1, 1
    return model.num_layers, model.num_kv_heads, model.head_dim


def kv_bytes_per_block(model: Any, block_size: int, dtype: torch.dtype) -> int:
    layers, heads, head_dim = kv_layout(model)
    return memory.kv_bytes_per_block(layers, block_size, heads, head_dim, dtype)


def plan_kv_cache(
    config: EngineConfig,
    loaded: LoadedModel,
    kv_bytes: int | None = None,
    kv_dtype: torch.dtype | None = None,
    topology: Topology = SOLO,
    extra_block_bytes: int = 0,
    default_len: int | None = None,
) -> tuple[int, int]:
    """(number of KV blocks, max model length) from the flags, the model and the memory:
    ``--num-gpu-blocks-override``, else ``--kv-cache-memory-bytes`` (per rank), else ``kv_bytes``
    (what profiling left on a GPU), else the CPU default (`sonar.engine.memory`), which the
    data-parallel replicas and the ranks of a parallel group share. The ranks of a group take the
    smallest count any of them can hold: every rank caches the same blocks, each its own heads and
    layers of them. `extra_block_bytes`: what another cache of as many blocks takes per block (a
    draft model's). `default_len`: the context when ``--max-model-len`` is unset, below the
    model's maximum (a sentence-transformers folder's ``max_seq_length``)."""
    dtype = kv_dtype or memory.kv_cache_torch_dtype(config.kv_cache_dtype, loaded.dtype)
    per_block = kv_bytes_per_block(loaded.model, config.block_size, dtype) + extra_block_bytes
    if config.num_gpu_blocks_override is not None:
        num_blocks = config.num_gpu_blocks_override
    else:
        if config.kv_cache_memory_bytes is not None:
            kv_bytes = config.kv_cache_memory_bytes
        elif kv_bytes is None:
            # the replicas' ranks share the default, so they hold no more than one worker would
            physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            kv_bytes = memory.default_cpu_kv_bytes(physical) // (replicas_here(config) * topology.size)
        num_blocks = topology.smallest(memory.num_blocks_for(kv_bytes, per_block))
        if not getattr(loaded.model, "is_causal", True):  # blocks are only counted: enough for a full batch
            num_blocks = min(num_blocks, config.max_num_seqs * -(-loaded.max_model_len // config.block_size) + 1)
    requested = config.max_model_len if config.max_model_len is not None or default_len is None else default_len
    fitted = memory.fit_max_model_len(requested, loaded.max_model_len, num_blocks, config.block_size)
    if fitted.reduced_from is not None:
        log.warning(
            "kv_cache.max_model_len_reduced",
            detail="reduced to fit the KV cache",
            max_model_len=fitted.value,
            model_max=fitted.reduced_from,
        )
    return num_blocks, fitted.value


class ModelRunner:
    def __init__(self, config: EngineConfig, topology: Topology = SOLO, device: torch.device | None = None) -> None:
        """Load the weights, size and allocate the KV cache, capture the CUDA graphs (slow: seconds).

        `topology`: this runner's rank among tensor-parallel and pipeline ranks (`sonar.engine.ranks`
        joined them): every rank runs every step, its shards of its stage's layers; the sampler
        alone samples (and with one stage shares the sampled ids with the other tensor ranks) and
        returns the step's result, the other ranks an empty one. `device`: where to run (None:
        `select_device`)."""
        self.config = cfg = config
        self.topology = topology
        self.requests: dict[str, _RequestState] = {}
        self._cut = -1
        """The multi-step decode to end after its current step (`cut`)."""
        self.device = device = device or select_device(cfg.device_ids)
        self.graphs: CudaGraphs | None = None
        self._decode_buffers: DecodeBuffers | None = None
        cuda = device.type == "cuda"
        if cuda:
            torch.cuda.set_device(device)
            free, total = memory_info(device)
            if cfg.kv_cache_memory_bytes is None and cfg.num_gpu_blocks_override is None:
                memory.check_free_memory(total, free, cfg.gpu_memory_utilization)
            # what this process already holds (an earlier engine's cached blocks, say) is not this one's
            start = memory.CudaBaseline(
                used=total - free,
                allocated=torch.cuda.memory_allocated(device),
                reserved=torch.cuda.memory_reserved(device),
            )
        torch.manual_seed(cfg.seed)
        eplb_config = cfg.eplb()
        t0 = time.perf_counter()
        self.loaded = load_model(
            cfg.model,
            dtype=cfg.dtype,
            load_format=cfg.load_format,
            revision=cfg.revision,
            download_dir=cfg.download_dir,
            device=device,
            quantization=cfg.quantization,
            dequantize_weights=cfg.dequantize_weights,
            parallel=topology.tp,
            expert_placement=cfg.expert_placement_strategy if cfg.enable_expert_parallel else None,
            ep_weight_filter=cfg.enable_ep_weight_filter,
            redundant_experts=eplb_config.num_redundant_experts if eplb_config is not None else None,
            stage=topology.stage,
            hf_overrides=cfg.hf_overrides,
            convert=cfg.convert,
            hf_token=cfg.hf_token,
            ignore_patterns=cfg.ignore_patterns,
            model_loader_extra_config=cfg.model_loader_extra_config,
            safetensors_load_strategy=cfg.safetensors_load_strategy,
            tokenizer_revision=cfg.tokenizer_revision,
            pictures=image_limit(cfg.limit_mm_per_prompt, cfg.language_model_only) > 0,
        )
        self.model = self.loaded.model
        self.weights_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        """The parameters' bytes as loaded (before any CPU repacking): this rank's share."""
        self.hidden_size = int(self.loaded.config.hidden_size)
        self.encoder_cache = EncoderCache(cfg.max_num_batched_tokens)
        """A vision model's image feature rows by image hash (`sonar.engine.encoder_cache`)."""
        self.pooler: Pooler | None = None
        """A pooling model (`sonar.models.pooler`): pools prompts instead of sampling."""
        self.causal = bool(getattr(self.model, "is_causal", True))
        if wants_pooling(type(self.model), cfg.runner, cfg.convert):
            try:
                cfg.check_pooling_model()
            except ValueError as exc:
                raise ModelLoadError(f"{self.loaded.source}: {exc}") from None
            info = pooling_info(self.model, self.loaded.config, self.loaded.model_dir, cfg.convert, cfg.pooler())
            self.pooler = Pooler(info, self.model)
        self.kv_dtype = memory.kv_cache_torch_dtype(cfg.kv_cache_dtype, self.loaded.dtype)
        t_pack = time.perf_counter()
        if not cuda:
            native.available()  # builds the native CPU kernels on a machine's first start, then loads them
        if not cuda and not cfg.enforce_eager:  # enforce_eager: plain eager torch linears
            # a compiled forward pass takes every weight as an input of its graph: kept there
            prepack_linears(self.model, keep_weights=compile_wanted(cfg, device))
        self.lora: AdapterSlots | None = None
        """LoRA (``--enable-lora``): the adapter slots of the model's wrapped linears."""
        if cfg.enable_lora:
            self.lora = AdapterSlots(
                self.model,
                max_loras=cfg.max_loras,
                max_cpu_loras=cfg.max_cpu_loras or cfg.max_loras,
                limits=cfg.lora_limits(),
                shapes=ModelShapes.of_config(self.loaded.config),
                dtype=self.loaded.dtype if cfg.lora_dtype == "auto" else getattr(torch, cfg.lora_dtype),
                device=device,
                fully_sharded=cfg.fully_sharded_loras,
            )
        convert_seconds = self.loaded.convert_seconds + time.perf_counter() - t_pack
        self.forward: Callable[..., torch.Tensor] = self.model
        """The forward pass steps run: the model, or its compiled form (`sonar.engine.compile`)."""
        self.compiled: CompiledForward | None = None
        pipelined = topology.stage.size > 1
        spec = cfg.speculative()
        if compile_wanted(cfg, device) and pipelined:
            log.warning(
                "compile.disabled", detail="a pipeline stage runs eagerly (its forward pass sends and receives)"
            )
        elif compile_wanted(cfg, device) and not self.causal:
            log.warning("compile.disabled", detail="encoder models run eagerly")
        elif compile_wanted(cfg, device) and self.lora is not None:
            log.warning("compile.disabled", detail="LoRA adapters run eagerly (their slots change between steps)")
        elif compile_wanted(cfg, device) and spec is not None and spec.method == "eagle3":
            log.warning("compile.disabled", detail="EAGLE-3 reads the target's layers through hooks, eagerly")
        elif compile_wanted(cfg, device):
            self.compiled = self.forward = self._compile()
        self.drafter: Drafter | EagleDrafter | None = None
        draft_tp = 1 if spec is None else spec.draft_tp(topology.tp.size, topology.stage.size)
        # a whole draft model runs on the sampler alone: its drafts go back with the step's result
        # and come to every rank as the next step's tokens; a split one runs on every tensor rank
        if spec is not None and spec.method == "draft_model" and (topology.samples or draft_tp > 1):
            self.drafter = Drafter(
                spec,
                dtype=cfg.dtype,
                device=device,
                vocab_size=int(self.loaded.config.vocab_size),
                block_size=cfg.block_size,
                parallel=TensorParallel(rank=topology.tp.rank, size=draft_tp, group=topology.tp.group)
                if draft_tp > 1
                else SINGLE,
            )
        elif spec is not None and spec.method in ("eagle", "eagle3", "mtp"):
            # a head too runs on the sampler alone, on the last stage's final states; where the
            # target's vocabulary is split over tensor ranks, the stage's group gathers it whole
            vocab = gather_vocab(self.model) if topology.tp.size > 1 and topology.stage.last else None
            if topology.samples:
                self.drafter = EagleDrafter(
                    spec,
                    target=self.model,
                    dtype=self.loaded.dtype,
                    device=device,
                    block_size=cfg.block_size,
                    checkpoint=self.loaded.model_dir,
                    vocab=vocab,
                )
        self.aux: AuxCapture | None = None
        """EAGLE-3 across pipeline stages: the states of its target layers, which each stage sends
        on to the next with its activations (`_forward_stage`)."""
        if spec is not None and spec.method == "eagle3" and pipelined:
            if isinstance(self.drafter, EagleDrafter):
                self.aux = self.drafter.head.aux
            else:
                assert spec.model is not None
                ids = head_aux_layer_ids(spec.model, int(self.loaded.config.num_hidden_layers))
                self.aux = AuxCapture(self.model, ids)
        self.spec = spec
        self.proposer: Proposer | None = None
        """ngram/suffix with async scheduling: the proposer of the steps' draft slots, made at the
        first such step (`SchedulerConfig.worker_drafts`)."""
        self.worker_drafts = (
            cfg.async_scheduling is True and topology.stage.size == 1 and spec is not None and spec.lookahead > 0
        )
        """A draft model or head with async scheduling: its drafts stay in the worker (`drafted`) and
        fill the request's draft slots in its next step, instead of going back to the scheduler;
        the sampler shares them with the other tensor ranks (`_share_drafts`)."""
        self.drafted: dict[str, list[int]] = {}
        """With `worker_drafts`: each request's drafts after the last token this worker sampled."""
        t1 = time.perf_counter()
        kv_bytes = None
        profile = None
        sizes = capture_sizes(cfg) if cuda else []
        if sizes and pipelined:
            log.warning(
                "cudagraph.disabled", detail="a pipeline stage runs eagerly (its forward pass sends and receives)"
            )
            sizes = []
        if sizes and self.pooler is not None:
            log.info("cudagraph.disabled", detail="a pooling model runs prefills only")
            sizes = []
        if sizes and self.lora is not None:
            log.warning("cudagraph.disabled", detail="LoRA adapters run eagerly (their slots change between steps)")
            sizes = []
        if sizes and any(experts.stacked() is None for experts in quantized_experts(self.model)):
            log.warning(
                "cudagraph.disabled",
                detail="quantized experts that cannot be stacked run one expert at a time, reading the routing on "
                "the host",
            )
            sizes = []
        if sizes and not ops.use_triton(torch.empty(0, device=device)):
            log.warning(
                "cudagraph.disabled",
                detail="the torch references read metadata on the host (Triton missing or SONAR_USE_TRITON=0)",
            )
            sizes = []
        if cuda and cfg.kv_cache_memory_bytes is None and cfg.num_gpu_blocks_override is None:
            profile = self._profile(total, start, sizes)
            kv_bytes = memory.kv_cache_bytes(profile)
        self.memory_profile = profile
        """What the CUDA startup profile measured (None: no profile ran)."""
        draft_kv_dtype = None
        extra = 0
        if self.drafter is not None:  # its KV cache has as many blocks: they share the budget
            draft_dtype = self.drafter.loaded.dtype if isinstance(self.drafter, Drafter) else self.loaded.dtype
            draft_kv_dtype = memory.kv_cache_torch_dtype(cfg.kv_cache_dtype, draft_dtype)
            extra = self.drafter.kv_bytes_per_block(draft_kv_dtype)
        st_len = None if self.pooler is None else sentence_transformers_max_len(self.loaded.model_dir)
        self.num_blocks, self.max_model_len = plan_kv_cache(
            cfg,
            self.loaded,
            kv_bytes,
            self.kv_dtype,
            topology,
            extra_block_bytes=extra,
            default_len=None if st_len is None else min(st_len, self.loaded.max_model_len),
        )
        if self.drafter is not None:
            self.drafter.allocate(self.num_blocks, draft_kv_dtype, self.max_model_len)
        layers, kv_heads, head_dim = kv_layout(self.model)
        self.kv_caches = allocate_kv_caches(
            layers, self.num_blocks, cfg.block_size, kv_heads, head_dim, self.kv_dtype, device
        )
        if self.compiled is not None:  # the graphs of both step kinds, before capture uses them
            self.compiled.warm_up(self.kv_caches, cfg.block_size)
        t2 = time.perf_counter()
        if sizes:
            self.graphs = CudaGraphs(self._forward, self._buffers(sizes[-1]), sizes, self.model.num_kv_heads)
            self.graphs.capture()
            log.info(
                "cudagraph.captured",
                sizes=len(sizes),
                max_size=sizes[-1],
                seconds=round(self.graphs.capture_seconds, 2),
                memory=format_memory_size(self.graphs.memory_bytes),
                estimated=format_memory_size(profile.graphs) if profile else None,
            )
        t3 = time.perf_counter()
        self._warm_up()
        self.eplb: ExpertBalancer | None = None
        """``--enable-eplb``: counts the experts' load each step and rebalances them (`sonar.models.eplb`)."""
        if eplb_config is not None:
            blocks = {n: m for n, m in self.model.named_modules() if getattr(m, "expert_map", None) is not None}
            if blocks:
                nodes = cfg.nnodes if topology.stage.size == 1 else 1  # the nodes one stage's group spans
                self.eplb = ExpertBalancer(blocks, eplb_config, topology.tp, num_nodes=nodes)
            elif topology.stage.size == 1:  # a pipeline stage may hold only dense layers
                raise ModelLoadError(
                    f"--enable-eplb: {self.loaded.architecture} has no mixture-of-experts layers whose experts "
                    "Sonar balances"
                )
        t4 = time.perf_counter()
        per_block = kv_bytes_per_block(self.model, cfg.block_size, self.kv_dtype)
        kv_total = memory.reproduce_bytes(self.num_blocks, per_block)
        self.vocab_size = int(self.loaded.config.vocab_size)
        self.eos_token_ids = self.loaded.eos_token_ids
        self.sampler = Sampler()
        if cfg.enable_prompt_embeds:
            self._check_prompt_embeds()
        self.processors = (
            ProcessorChain([cls(cfg, device, cuda) for cls in load_classes(cfg.logits_processors)])
            if cfg.logits_processors
            else None
        )
        tokenizer = cfg.tokenizer or (str(self.loaded.tokenizer_path) if self.loaded.tokenizer_path else None)
        compile_seconds = self.compiled.compile_seconds if self.compiled is not None else 0.0
        phases = {
            "weights": t1 - t0 - convert_seconds,
            "convert": convert_seconds,
            "kv_cache": t2 - t1 - compile_seconds,
        }
        if self.compiled is not None:
            phases["compile"] = compile_seconds
        if sizes:
            phases["graphs"] = t3 - t2
        phases["warmup"] = t4 - t3
        switch = getattr(self.model, "longrope_switch", None)
        self.info = WorkerInfo(
            model=self.loaded.source,
            architecture=self.loaded.architecture,
            dtype=str(self.loaded.dtype).removeprefix("torch."),
            num_blocks=self.num_blocks,
            block_size=cfg.block_size,
            max_model_len=self.max_model_len,
            vocab_size=self.vocab_size,
            eos_token_ids=self.eos_token_ids,
            kv_cache_memory_bytes=kv_total,
            tokenizer_path=tokenizer,
            pid=os.getpid(),
            startup_seconds=phases,
            num_layers=self.model.num_layers,
            num_kv_heads=self.model.num_kv_heads,
            head_dim=self.model.head_dim,
            device=device.type,
            device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else "",
            projections=ModelShapes.of_config(self.loaded.config).modules if self.causal else {},
            num_hidden_layers=int(self.loaded.config.num_hidden_layers),
            pooling=None if self.pooler is None else self.pooler.info,
            vision=vision_info(self.model),
            hidden_size=self.hidden_size,
            weights_bytes=self.weights_bytes,
            longrope_switch=switch if switch is not None and switch < self.max_model_len else None,
        )
        log.info(
            "kv_cache.allocated",
            device=str(device),
            dtype=str(self.kv_dtype).removeprefix("torch."),
            blocks=self.num_blocks,
            block_size=cfg.block_size,
            tokens=self.num_blocks * cfg.block_size,
            max_model_len=self.max_model_len,
            reproduce_with=f"--kv-cache-memory-bytes {kv_total}",
            size=format_memory_size(kv_total),
            **(profile.describe() if profile else {}),
        )

    # -- sleep mode (`sonar.engine.sleep`) ------------------------------------------------------
    def free_kv_cache(self) -> None:
        """Drop the KV cache tensors, and the CUDA graphs that read them (the scheduler holds no
        request and no cached prefix: nothing in the cache is wanted)."""
        if self.graphs is not None:
            self.graphs.release()
        self.requests.clear()
        self.encoder_cache.clear()
        self.kv_caches = []

    def allocate_kv_cache(self) -> None:
        """A fresh, zeroed KV cache of the same layout; the CUDA graphs are captured again over it
        once the weights are on the device too."""
        layers, kv_heads, head_dim = kv_layout(self.model)
        self.kv_caches = allocate_kv_caches(
            layers, self.num_blocks, self.config.block_size, kv_heads, head_dim, self.kv_dtype, self.device
        )
        self._recapture()

    def offload_weights(self) -> None:
        """Move the weights to host memory (a GPU's; on the CPU they are there already)."""
        if self.device.type == "cpu":
            return
        if self.graphs is not None:
            self.graphs.release()
        self.model.to("cpu")

    def restore_weights(self) -> None:
        """Move the weights back to the device (after `offload_weights`)."""
        if self.device.type == "cpu":
            return
        self.model.to(self.device)
        self._recapture()

    def _recapture(self) -> None:
        on_device = next(self.model.parameters()).device == self.device
        if self.graphs is not None and self.kv_caches and on_device:
            self.graphs.capture()

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.forward(ids, positions, self.kv_caches, meta)

    def _forward_stage(
        self, ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor], meta: AttentionMetadata
    ) -> torch.Tensor | None:
        """This stage's part of a forward pass: the final hidden states on the last stage, None on
        the others (they send theirs on to the next stage)."""
        stage = self.topology.stage
        if stage.size == 1:
            return self.forward(ids, positions, kv_caches, meta)
        owned = self.model.stage.owned(self.model.config.num_hidden_layers)  # the model's: resolved
        aux = self.aux
        with step_metadata(meta):
            received: tuple[torch.Tensor, ...] = ()
            if not stage.first:
                carried = 0 if aux is None else sum(i < owned.start for i in aux.layer_ids)
                received = self.topology.recv_hidden(ids.shape[0], self.hidden_size, self.loaded.dtype, 2 + carried)
                if aux is not None:
                    aux.receive(list(received[2:]))
            out = self.model.forward_tensors(ids, positions, kv_caches, *received[:2])
        if stage.last:
            return out
        self.topology.send_hidden(*out, *(aux.before(owned.stop) if aux is not None else ()))
        return None

    def _compile(self) -> CompiledForward:
        """The model's forward pass compiled, its artifacts cached under ``SONAR_CACHE_ROOT``
        for this model and the settings that shape the code (nothing compiles until a first call)."""
        cfg = self.config
        return compile_forward(
            self.model,
            config_key_parts={
                "model": self.loaded.source,
                "revision": cfg.revision,
                "load_format": cfg.load_format,
                "dtype": str(self.loaded.dtype),
                "block_size": cfg.block_size,
                "kv_cache_dtype": cfg.kv_cache_dtype,
            },
        )

    def _buffers(self, max_size: int) -> DecodeBuffers:
        if self._decode_buffers is None or self._decode_buffers.max_size < max_size:
            self._decode_buffers = DecodeBuffers(max_size, self.max_model_len, self.config.block_size, self.device)
        return self._decode_buffers

    @torch.inference_mode()
    def _profile(self, total: int, start: memory.CudaBaseline, sizes: list[int]) -> memory.MemoryProfile:
        """Measure what serving needs besides the KV cache: a forward pass (and the logits of up
        to ``max_num_seqs`` rows) at ``max_num_batched_tokens`` tokens for the peak activations,
        and, unless graphs are off, a capture of the largest and the smallest decode graph over a
        throwaway KV cache, from which the memory of all graphs is estimated."""
        cfg, model, device = self.config, self.model, self.device
        torch.cuda.synchronize(device)
        weights = torch.cuda.memory_allocated(device) - start.allocated
        tokens = cfg.max_num_batched_tokens
        seq_len = max(
            1, min(tokens, self.loaded.max_model_len if cfg.max_model_len in (None, -1) else cfg.max_model_len)
        )
        q_lens = [seq_len] * (tokens // seq_len) + ([tokens % seq_len] if tokens % seq_len else [])
        bs = cfg.block_size
        blocks_per_seq = -(-seq_len // bs)
        tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(len(q_lens))]
        scratch = allocate_kv_caches(
            model.num_layers,
            blocks_per_seq * len(q_lens),
            bs,
            model.num_kv_heads,
            model.head_dim,
            self.kv_dtype,
            device,
        )
        meta = AttentionMetadata.build(q_lens, q_lens, tables, bs, device=device)
        positions = torch.cat([torch.arange(q) for q in q_lens]).to(device)
        ids = torch.zeros(tokens, dtype=torch.int64, device=device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        hidden = self._forward_stage(ids, positions, scratch, meta)
        rows = min(cfg.max_num_seqs, tokens)
        if hidden is not None:
            torch.softmax(model.compute_logits(hidden[-rows:]), dim=-1)
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - before
        del hidden
        image = self.profile_image()
        tower = 0
        if image is not None:  # the tower runs apart from the forward pass: the larger peak counts
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
            self.encode_image(image)
            torch.cuda.synchronize(device)
            tower = torch.cuda.max_memory_allocated(device) - before
            peak = max(peak, tower)
        graphs = 0
        if sizes:
            self.kv_caches = scratch  # the probe graphs read the throwaway cache (contexts of length 0)
            model_len = cfg.max_model_len if cfg.max_model_len not in (None, -1) else self.loaded.max_model_len
            probe = CudaGraphs(
                self._forward, DecodeBuffers(sizes[-1], model_len, bs, device), sizes, model.num_kv_heads
            )
            probe.capture([sizes[-1]])
            largest = probe.memory_bytes
            probe.capture([sizes[0]])
            graphs = largest + max(probe.memory_bytes - largest, 0) * (len(sizes) - 1)
            probe.release()
            del self.kv_caches
        del scratch
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        free, _ = memory_info(device)
        non_torch = (total - free - start.used) - (torch.cuda.memory_reserved(device) - start.reserved)
        profile = memory.MemoryProfile(
            total=total,
            utilization=cfg.gpu_memory_utilization,
            weights=weights,
            peak_activations=peak,
            non_torch=non_torch,
            graphs=graphs,
            tower=tower,
        )
        log.info("memory.profiled", tokens=tokens, image_rows=image.length if image else 0, **profile.describe())
        return profile

    @torch.inference_mode()
    def execute(
        self,
        msg: ExecuteStep,
        wait_bitmask: Callable[[], torch.Tensor] | None = None,
        decode_step: Callable[[], None] | None = None,
        emit: Callable[[StepTokens], None] | None = None,
    ) -> StepResult:
        """Run one step (a multi-step decode's steps, `_execute_steps`). With `msg.grammar_rows`,
        `wait_bitmask` gives their token bitmask (it may block until the scheduler has sent it):
        called after the forward pass, applied to those rows' logits before either sampler sees
        them. `decode_step`: called before each decode step of a multi-step decode after the first
        (the worker's watchdog times each on its own). `emit`: given each decode step's tokens but
        the last one's, as the decode step after it starts (`StepTokens`)."""
        if msg.output.decode_steps > 1:
            return self._execute_steps(msg, decode_step, emit)
        return self._execute(msg, wait_bitmask)

    def cut(self, step_id: int) -> None:
        """End multi-step decode ``step_id`` after the step it is running, so that a request
        waiting to be admitted gets the next step (`sonar.engine.worker`, from its mailbox thread).
        Ignored with tensor ranks (they must all run the same steps), and once that step is over."""
        self._cut = step_id

    def _execute_steps(
        self, msg: ExecuteStep, decode_step: Callable[[], None] | None, emit: Callable[[StepTokens], None] | None
    ) -> StepResult:
        """A multi-step decode (`SchedulerOutput.decode_steps`): its decode steps one after another,
        each feeding the token the one before sampled (a `PLACEHOLDER_TOKEN` this runner fills, as
        with async scheduling), until all ran or `cut` ended it; one result with each request's
        tokens in order. A request that failed stays in the later steps (every tensor rank runs the
        same batches) but gets nothing after its failure. With `emit`, a decode step that is not
        cut also hands over the tokens the one before it sampled for `ExecuteStep.streamed`, so
        they stream while it runs; the last decode step's tokens are only in the result."""
        out = msg.output
        result = self._execute(msgspec.structs.replace(msg, output=msgspec.structs.replace(out, decode_steps=1)))
        last = result
        alone = self.topology.tp.size == 1
        for j in range(1, out.decode_steps):
            if alone and self._cut == out.step_id:
                break
            if emit is not None:  # copies: the first decode step's lists grow into the result's
                ids = [rid for rid in msg.streamed if rid in last.sampled and rid not in result.failed]
                lps = last.logprobs
                emit(
                    StepTokens(
                        out.step_id,
                        j - 1,
                        {rid: last.sampled[rid][-1:] for rid in ids},
                        {rid: lps[rid][-1:] for rid in ids if rid in lps},
                    )
                )
            if decode_step is not None:
                decode_step()
            decodes = [
                msgspec.structs.replace(s, token_ids=[PLACEHOLDER_TOKEN], start_pos=s.start_pos + j, is_new=False)
                for s in out.requests
            ]
            step = SchedulerOutput(out.step_id, decodes, len(decodes), [], [])
            last = self._execute(msgspec.structs.replace(msg, output=step, new_requests=[]))
            for rid, tokens in last.sampled.items():
                if rid not in result.failed:
                    result.sampled[rid] += tokens
                    if rid in last.logprobs:
                        result.logprobs[rid] += last.logprobs[rid]
            for rid, reason in last.failed.items():
                result.failed.setdefault(rid, reason)
            result.uncache += [rid for rid in last.uncache if rid not in result.uncache]
            result.seconds += last.seconds
            result.forward_seconds += last.forward_seconds
            result.spans += last.spans
        return result

    def _execute(self, msg: ExecuteStep, wait_bitmask: Callable[[], torch.Tensor] | None = None) -> StepResult:
        started = time.perf_counter()
        spans = self.config.step_spans  # --collect-detailed-traces: time the step's parts for its span
        execute_ns = time.monotonic_ns() if spans else 0
        forward_ns = sample_ns = (0, 0)
        out = msg.output
        for rid in out.finished_req_ids:
            ended = self.requests.pop(rid, None)
            if self.proposer is not None:  # suffix keeps finished outputs for later requests
                if ended is not None and ended.output:
                    self.proposer.propose(rid, ended.prompt, ended.output, 0)
                self.proposer.finish(rid)
            self.drafted.pop(rid, None)
        for rid in out.preempted_req_ids:
            self.requests.pop(rid, None)
            self.drafted.pop(rid, None)
        for new in msg.new_requests:
            self.requests[new.req_id] = state = _RequestState(
                new.params, new.prompt_token_ids, list(new.output_token_ids), is_plain_greedy(new.params), new.lora
            )
            state.images = new.images
            if new.images and hasattr(self.model, "rope_index"):
                state.mrope, state.mrope_delta = self.model.rope_index(len(new.prompt_token_ids), new.images)
            if new.prompt_embeds is not None:
                state.embeds = self._embeds(new.req_id, new.prompt_embeds, len(new.prompt_token_ids))
            if new.pooling is not None:
                if self.pooler is None:
                    raise ValueError(f"request {new.req_id}: a pooling request, but this model is not a pooling model")
                state.pooling, state.pool = new.pooling, self.pooler.state(new.pooling)
        unknown = [s.req_id for s in out.requests if s.req_id not in self.requests]
        if unknown:
            raise UnknownRequestError(f"step {out.step_id} names request(s) this worker does not hold: {unknown[:3]}")
        result = StepResult(step_id=out.step_id, sampled={})
        if not out.requests:
            return result
        runs, hits = self.encoder_cache.runs, self.encoder_cache.hits
        ids: list[int] = []
        positions: list[int] = []
        q_lens: list[int] = []
        s_lens: list[int] = []
        tables: list[list[int]] = []
        sample_rows: list[int] = []
        sample_ids: list[str] = []
        drafts: list[list[int]] = []  # per sampled request: the guesses its rows verify
        request_rows: list[int] = []  # per request: the row of its first token (for a drafter)
        num_rows: list[int] = []  # per request: its rows (worker drafts may fill fewer than its slots)
        prompt_rows: list[tuple[str, int, int, int]] = []  # (req, first row, rows, start position)
        pool_rows: list[tuple[_RequestState, str, int, int, int, bool]] = []  # (.., last chunk)
        token_types: list[int] | None = None  # BERT's, where a request is a text pair
        given_rows: list[int] = []  # rows whose first-layer input is given: image features, prompt embeddings
        given_embeds: list[torch.Tensor] = []
        mrope: list[tuple[int, int, int, _RequestState]] = []  # (first row, start, rows, request)
        computed: list[ScheduledRequest] = []  # what each request's rows are (for a drafter)
        long_rows: list[tuple[int, int]] = []  # (first row, rows) of sequences on LongRoPE's long factors
        for sched in out.requests:
            first = len(ids)
            start = sched.start_pos
            if sched.token_ids[-1] == PLACEHOLDER_TOKEN and len(sched.token_ids) == 1 + sched.num_drafts:
                start, tokens = self._draft_into_slots(sched)  # a decode, maybe with worker draft slots
                guesses = tokens[1:]
                if sched.num_drafts:
                    result.drafted[sched.req_id] = len(guesses)
                if self.drafter is not None:  # it reads the rows as computed, not as scheduled
                    sched = msgspec.structs.replace(sched, token_ids=tokens, start_pos=start, num_drafts=len(guesses))
            else:
                if sched.token_ids[-1] == PLACEHOLDER_TOKEN:  # async scheduling: sampled here, not known there
                    tokens = self._fill_placeholders(sched)
                else:
                    tokens = sched.token_ids
                guesses = tokens[len(tokens) - sched.num_drafts :]
            n = len(tokens)
            ids += tokens
            num_rows.append(n)
            computed.append(sched)
            positions += range(start, start + n)
            if sched.long_rope:
                long_rows.append((first, n))
            if sched.num_drafts:
                # a decode row per token, each attending up to itself: the step stays a decode
                # step (the fused CPU path, CUDA graphs), and a step writes every row's KV before
                # any row attends, so each draft sees the ones before it
                q_lens += [1] * n
                s_lens += range(start + 1, start + n + 1)
                tables += [sched.block_ids] * n
            else:
                q_lens.append(n)
                s_lens.append(start + n)
                tables.append(sched.block_ids)
            state = self.requests[sched.req_id]
            if state.mrope is not None:
                mrope.append((first, start, n, state))
            if state.images:
                self._image_rows(state, first, start, n, given_rows, given_embeds)
            if state.embeds is not None and start < len(state.prompt):
                end = min(start + n, len(state.prompt))
                given_rows += range(first, first + end - start)
                given_embeds.append(state.embeds[start:end])
            if state.pooling is not None:
                pool_rows.append((state, sched.req_id, first, n, sched.start_pos, sched.sample))
                pair = state.pooling.pair_start
                if pair is not None and not self.causal:
                    token_types = token_types if token_types is not None else [0] * first
                    token_types += [int(p >= pair) for p in range(sched.start_pos, sched.start_pos + n)]
                elif token_types is not None:
                    token_types += [0] * n
                request_rows.append(first)
                continue
            if token_types is not None:
                token_types += [0] * n
            if state.params.prompt_logprobs is not None and sched.start_pos < sched.num_prompt_tokens:
                rows = min(n, sched.num_prompt_tokens - sched.start_pos)
                prompt_rows.append((sched.req_id, first, rows, sched.start_pos))
            if sched.sample:  # the last position, and each draft's before it (speculative decoding)
                sample_rows += range(len(ids) - 1 - len(guesses), len(ids))
                sample_ids.append(sched.req_id)
                drafts.append(guesses)
            request_rows.append(first)
        hidden = None
        lost: dict[str, str] = {}  # requests whose LoRA adapter could not be loaded, with why
        verified: dict[str, list[int]] = {}  # what each sampling request kept, from the sampled tokens alone
        if self.eplb is not None and self.eplb.due:  # between two steps' forward passes, on every rank
            self.eplb.rebalance()
        result.images_encoded = self.encoder_cache.runs - runs
        result.images_reused = self.encoder_cache.hits - hits
        forward_started = time.perf_counter()
        forward_start_ns = time.monotonic_ns() if spans else 0
        if (
            self.graphs is not None
            and len(ids) == len(q_lens)
            and not prompt_rows
            and not pool_rows
            and not given_rows
            and not mrope  # a graph takes its cache slots from the positions
            and not long_rows
            and self.drafter is None
        ):
            hidden = self.graphs.run(ids, positions, tables)  # a pure decode step: replay its graph
        if hidden is None:
            device = self.device
            meta = AttentionMetadata.build(q_lens, s_lens, tables, self.config.block_size, device=device)
            ids_t, positions_t = torch.tensor(ids, device=device), torch.tensor(positions, device=device)
            rope_t = positions_t
            if mrope:  # the rotary's positions: M-RoPE moves those of requests with images
                rope = list(positions)
                for first, start, n, state in mrope:
                    rope[first : first + n] = state.rope_positions(start, n)
                rope_t = torch.tensor(rope, device=device)
            if long_rows:  # the rotary takes the long factors for positions from LONG_ROPE
                rope = list(positions)
                for first, n in long_rows:
                    rope[first : first + n] = range(LONG_ROPE + rope[first], LONG_ROPE + rope[first] + n)
                rope_t = torch.tensor(rope, device=device)
            with self._adapters(out.requests, num_rows, lost):
                if token_types is not None:
                    types = torch.tensor(token_types, device=device)
                    hidden = self.forward(ids_t, positions_t, self.kv_caches, meta, token_type_ids=types)
                elif given_rows:
                    rows_t = torch.tensor(given_rows, device=device)
                    if mrope:  # image rows' three positions differ: every row's three
                        rope_t = self._mrope_positions(rope_t, mrope)
                    hidden = self.model.forward_rows(
                        ids_t, rope_t, self.kv_caches, meta, rows_t, torch.cat(given_embeds)
                    )
                else:
                    hidden = self._forward_stage(ids_t, rope_t, self.kv_caches, meta)
            for rid, reason in lost.items():
                result.failed[rid] = reason
                result.uncache.append(rid)
        if self.eplb is not None:
            self.eplb.step_done()
        if self.config.trace_model:  # the device runs ahead of the host: wait for it to time the pass
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            result.forward_seconds = time.perf_counter() - forward_started
            if spans:
                forward_ns = (forward_start_ns, time.monotonic_ns())
        if hidden is None:  # a stage before the last: the sampler has the logits, and answers
            return result
        for rid, first, rows, start in prompt_rows:
            result.prompt_logprobs[rid] = self._prompt_logprobs(hidden[first : first + rows], rid, start)
        if pool_rows and self.topology.samples:
            self._pool(pool_rows, hidden, result)
        if sample_rows:
            sample_start_ns = time.monotonic_ns() if spans else 0
            # a pure decode step samples every row: no gather of the rows needed
            rows = (
                hidden
                if len(sample_rows) == hidden.shape[0]
                else hidden[torch.tensor(sample_rows, device=hidden.device)]
            )
            logits = self.model.compute_logits(rows)[:, : self.vocab_size]
            first_rows = list(itertools.accumulate((1 + len(d) for d in drafts[:-1]), initial=0))
            if not self.topology.samples:
                if self.topology.stage.size == 1:  # a tensor rank of the one stage: it embeds the next tokens
                    kept = self._follow_sampling(sample_ids, drafts, first_rows, len(sample_rows))
                    if self.drafter is not None:  # a draft split over the ranks drafts on each, in step
                        self.drafter.draft(
                            self._step_view(
                                computed, request_rows, ids_t, positions_t, meta, hidden, kept, out.requests
                            )
                        )
                    if self.worker_drafts:
                        self._share_drafts(sample_ids, {})
                return result
            if msg.grammar_rows:
                if wait_bitmask is None:
                    raise ValueError(f"step {out.step_id} has grammar rows but no bitmask to wait for")
                where = dict(zip(sample_ids, first_rows))
                masked: list[int] = []
                for rid in msg.grammar_rows:  # a request with drafts is named once per row
                    masked.append(where[rid])
                    where[rid] += 1
                apply_token_bitmask(logits, wait_bitmask(), masked)
            states = [self.requests[rid] for rid in sample_ids]
            processor_failure = None
            if self.processors is not None:
                try:
                    logits = self._process(logits, sample_ids, states, drafts)
                except Exception as exc:  # the operator's code: its requests fail, the worker serves on
                    log.error("logits_processor.failed", error=f"{type(exc).__name__}: {exc}")
                    processor_failure = f"a logits processor failed: {type(exc).__name__}: {exc}"
                    logits = torch.full_like(logits, float("-inf"))
            if all(s.plain_greedy for s in states):
                sampled = Sampler.greedy(logits)
            else:
                params, outputs, prompts = [], [], []
                for state, guesses in zip(states, drafts):
                    for j in range(1 + len(guesses)):  # each row sees the drafts before it as output
                        params.append(state.params)
                        outputs.append(state.output + guesses[:j] if j else state.output)
                        prompts.append(state.prompt_tokens or [])
                batch = SamplingBatch.build(
                    params,
                    outputs,
                    prompts,
                    vocab_size=self.vocab_size,
                    eos_token_ids=self.eos_token_ids,
                    device=logits.device,
                )
                sampled = self.sampler(logits, batch)
            # one copy to the host for both: ids and whether each row failed
            shared = torch.stack((sampled.sampled_token_ids, sampled.failed.long()))
            tokens, failed = shared.tolist()
            if spans:  # the copy to the host waited for the device: the sampling is done
                sample_ns = (sample_start_ns, time.monotonic_ns())
            if self.topology.tp.size > 1 and self.topology.stage.size == 1:
                # the other tensor ranks feed these tokens to later steps too and keep the same
                # drafts (with several stages no step carries a token still in flight:
                # `SchedulerConfig.pipeline_stages`)
                self.topology.share_tokens(shared.to(torch.int64))
            for rid, state, guesses, row in zip(sample_ids, states, drafts, first_rows):
                kept = _verify(tokens, failed, row, guesses)
                if kept:
                    verified[rid] = kept
                if rid in lost:  # computed without its adapter: nothing it sampled is its own
                    state.output.append(0)
                    continue
                if not kept:
                    # a failed row's id is 0, a valid token: a step already sent behind this one can
                    # feed it before the scheduler drops the request
                    state.output.append(0)
                    result.failed[rid] = processor_failure or (
                        "no token could be sampled: every logit was -inf or NaN after the "
                        "request's penalties, logit_bias and min_tokens"
                    )
                    continue
                state.output += kept
                result.sampled[rid] = kept
                if state.params.logprobs is not None and sampled.logprobs is not None:
                    result.logprobs[rid] = [
                        _row(sampled.logprobs, row + j, state.params.logprobs) for j in range(len(kept))
                    ]
        if self.drafter is not None:  # every step: a draft's KV follows every position computed
            view = self._step_view(computed, request_rows, ids_t, positions_t, meta, hidden, verified, out.requests)
            proposed = {rid: guesses for rid, guesses in self.drafter.draft(view).items() if rid in result.sampled}
            if self.worker_drafts:
                if sample_ids:
                    self._share_drafts(sample_ids, {rid: proposed.get(rid, []) for rid in result.sampled})
            else:
                result.proposed = proposed
        result.seconds = time.perf_counter() - started
        if spans:
            result.spans = worker_spans(self.config, (execute_ns, time.monotonic_ns()), forward_ns, sample_ns)
        return result

    def _image_rows(
        self, state: _RequestState, first: int, start: int, n: int, rows: list[int], embeds: list[torch.Tensor]
    ) -> None:
        """Add the rows of positions ``[start, start + n)`` that are image placeholders (at batch
        row ``first`` for ``start``) and their feature rows. The request keeps an image's rows
        from the first step that reaches it to the one that passes its last token; they come from
        the encoder cache when an earlier request left them there, else from the tower (once)."""
        for index, image in enumerate(state.images):
            lo, hi = max(start, image.offset), min(start + n, image.offset + image.length)
            if lo >= hi:
                continue
            features = state.features.get(index)
            if features is None and image.embeds:  # precomputed (--enable-mm-embeds): no tower to spare
                features = image.pixel_values.to(self.device, self.loaded.dtype)
            elif features is None:
                features = self.encoder_cache.get(image.hash, image.length)
                if features is None:
                    features = self.encode_image(image)
                    self.encoder_cache.put(image.hash, features)
            state.features[index] = features
            rows += range(first + lo - start, first + hi - start)
            embeds.append(features[lo - image.offset : hi - image.offset])
            if hi == image.offset + image.length:
                del state.features[index]

    def encode_image(self, image: ImageInput) -> torch.Tensor:
        """An image's feature rows ``[length, width]`` from the vision tower and projector."""
        pixels = image.pixel_values.to(self.device)
        if image.grid is None:
            return self.model.encode_images(pixels.unsqueeze(0))[0]
        return self.model.encode_grid(pixels, image.grid)

    def profile_image(self) -> ImageInput | None:
        """The largest image a request to this server can bring (`sonar.multimodal.profile_image`),
        for the memory profile; None for a text-only model, a model served without images, or
        with ``--skip-mm-profiling``."""
        cfg = self.config
        vision = vision_info(self.model)
        if (
            vision is None
            or cfg.skip_mm_profiling
            or image_limit(cfg.limit_mm_per_prompt, cfg.language_model_only) == 0
        ):
            return None
        from sonar.multimodal.processor import image_processor
        from sonar.multimodal.profile_image import largest_image

        processor = image_processor(vision, cfg.tokenizer or self.loaded.tokenizer_path, cfg.mm_processor_kwargs)
        # an image computed in one step (bidirectional attention) fits one step's budget; the
        # profile runs before the KV cache plan fixes the model length, so an automatic one
        # (-1) counts as the model's own
        model_len = cfg.max_model_len if cfg.max_model_len not in (None, -1) else self.loaded.max_model_len
        max_rows = cfg.max_num_batched_tokens if vision.bidirectional else model_len
        return largest_image(vision, processor, max_rows)

    @staticmethod
    def _mrope_positions(rope: torch.Tensor, requests: list[tuple[int, int, int, _RequestState]]) -> torch.Tensor:
        """The step's M-RoPE positions ``[3, rows]``: `rope` in all three rows, the prompt rows of
        `requests` (first row, start position, rows, request) from their tables."""
        table = rope.expand(3, -1).clone()
        for first, start, n, state in requests:
            assert state.mrope is not None
            inside = min(start + n, state.mrope.shape[1]) - start
            if inside > 0:
                table[:, first : first + inside] = state.mrope[:, start : start + inside].to(table.device)
        return table

    def _pool(
        self, rows: list[tuple[_RequestState, str, int, int, int, bool]], hidden: torch.Tensor, result: StepResult
    ) -> None:
        """Keep what each pooling request needs of its rows; a request whose prompt the step
        completed gets its result."""
        assert self.pooler is not None
        for state, rid, first, n, start, last in rows:
            assert state.pool is not None and state.pooling is not None
            chunk = hidden[first : first + n]
            state.pool.add(chunk, start)
            if last:
                result.pooled[rid] = self.pooler.finish(state.pool, chunk[-1], state.pooling)

    def _adapters(
        self, scheduled: list[ScheduledRequest], num_rows: list[int], lost: dict[str, str]
    ) -> contextlib.AbstractContextManager[None]:
        """Within: forward passes whose rows use the LoRA adapters of their requests (each row of
        a request, its drafts' too, the request's slot). A request whose adapter cannot be loaded
        goes into `lost` with why: its rows run as the base model's, and it must fail."""
        if self.lora is None:
            return contextlib.nullcontext()
        states = [self.requests[s.req_id] for s in scheduled]
        where, failed = self.lora.activate(s.lora for s in states if s.lora is not None)
        rows: list[int] = []
        for sched, state, n in zip(scheduled, states, num_rows):
            slot = -1 if state.lora is None else where.get(state.lora.digest, -1)
            if state.lora is not None and state.lora.digest in failed:
                lost[sched.req_id] = str(failed[state.lora.digest])
            rows += [slot] * n
        return self.lora.context.step(rows)

    def _step_view(
        self,
        computed: list[ScheduledRequest],
        request_rows: list[int],
        ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        hidden: torch.Tensor,
        kept: dict[str, list[int]],
        scheduled: list[ScheduledRequest],
    ) -> StepView:
        """What the step computed, for the drafter; `kept` is what every rank derives from the
        shared sampled tokens alone (a rank's own failures, such as a LoRA adapter it could not
        load, stay out of it), so a draft split over the ranks drafts the same rows on each."""
        next_tokens = {s.req_id: self._next_token(s) for s in scheduled if not s.sample}
        return StepView(computed, request_rows, ids, positions, meta, hidden, kept, next_tokens)

    def _next_token(self, sched: ScheduledRequest) -> int:
        """The known token after a chunk that samples nothing (a prompt, or the outputs of a
        request recomputed after a preemption)."""
        state = self.requests[sched.req_id]
        position = sched.start_pos + len(sched.token_ids)
        prompt = state.prompt
        return prompt[position] if position < len(prompt) else state.output[position - len(prompt)]

    def _follow_sampling(
        self, sample_ids: list[str], drafts: list[list[int]], first_rows: list[int], num_rows: int
    ) -> dict[str, list[int]]:
        """A rank other than the sampler: take the tokens it sampled for this step's rows (and
        whether each failed), and keep what it keeps of each request's drafts (returned, for the
        requests that kept any)."""
        shared = self.topology.share_tokens(torch.empty(2, num_rows, dtype=torch.int64, device=self.device))
        tokens, failed = shared.tolist()
        verified: dict[str, list[int]] = {}
        for rid, guesses, row in zip(sample_ids, drafts, first_rows):
            kept = _verify(tokens, failed, row, guesses)
            self.requests[rid].output += kept or [0]
            if kept:
                verified[rid] = kept
        return verified

    def _share_drafts(self, sample_ids: list[str], proposed: dict[str, list[int]]) -> None:
        """With `worker_drafts`: keep the drafts of this step's sampled requests for their next
        steps. The sampler has them (`proposed`); with tensor ranks it sends them to the others
        (called with none), which fill the same slots with the same tokens."""
        if self.topology.tp.size > 1:
            assert self.spec is not None
            rows = torch.full((len(sample_ids), self.spec.num_speculative_tokens), -1, dtype=torch.int64)
            for i, rid in enumerate(sample_ids):
                guesses = proposed.get(rid, [])
                rows[i, : len(guesses)] = torch.tensor(guesses, dtype=torch.int64)
            # the sampled tokens' broadcast, once more: every rank of the one stage joins it
            shared = self.topology.share_tokens(rows.to(self.device)).tolist()
            proposed = {rid: [t for t in row if t >= 0] for rid, row in zip(sample_ids, shared)}
        for rid in sample_ids:
            self.drafted[rid] = proposed.get(rid, [])

    def _draft_into_slots(self, sched: ScheduledRequest) -> tuple[int, list[int]]:
        """A decode of a token sampled here, or with worker draft slots (async scheduling with
        speculation): its start position and tokens, the request's last token then up to
        ``num_drafts`` drafts from this runner's proposer, or those its draft model or head made
        after the step that sampled that token (`drafted`). With draft slots the scheduler placed a
        request's next step as if every draft of this one were kept; it starts where the kept
        tokens end instead."""
        state = self.requests[sched.req_id]
        prompt, output = state.prompt, state.output
        if sched.token_ids[0] == PLACEHOLDER_TOKEN:  # sampled by the step before, here
            start = len(prompt) + len(output) - 1
            if not output or start > sched.start_pos:
                raise UnknownRequestError(
                    f"request {sched.req_id}: a placeholder at position {sched.start_pos}, past the "
                    f"{len(prompt) + len(output)} tokens this worker holds"
                )
            token = output[-1]
        else:
            start, token = sched.start_pos, sched.token_ids[0]
        if not sched.num_drafts:
            return start, [token]
        if self.worker_drafts:  # made after the step that sampled `token`
            return start, [token, *self.drafted.pop(sched.req_id, [])[: sched.num_drafts]]
        if self.proposer is None:
            assert self.spec is not None, "draft slots without --speculative-config"
            self.proposer = make_proposer(self.spec)
            assert self.proposer is not None, f"draft slots with speculative method {self.spec.method}"
        guesses = self.proposer.propose(sched.req_id, prompt, output, sched.num_drafts)
        return start, [token, *guesses[: sched.num_drafts]]

    def _fill_placeholders(self, sched: ScheduledRequest) -> list[int]:
        """The step's tokens with each `PLACEHOLDER_TOKEN` replaced by the token this runner
        sampled at that position in an earlier step (whose result the scheduler did not have
        when it scheduled this one)."""
        state = self.requests[sched.req_id]
        prompt, output = state.prompt, state.output
        tokens = list(sched.token_ids)
        for i, token in enumerate(tokens):
            if token == PLACEHOLDER_TOKEN:
                pos = sched.start_pos + i - len(prompt)
                if not 0 <= pos < len(output):
                    raise UnknownRequestError(
                        f"request {sched.req_id}: a placeholder at position {sched.start_pos + i}, past the "
                        f"{len(prompt) + len(output)} tokens this worker holds"
                    )
                tokens[i] = output[pos]
        return tokens

    @torch.inference_mode()
    def decode_padded(self, ids: list[int], positions: list[int], tables: list[list[int]], size: int) -> torch.Tensor:
        """Hidden states ``[n, hidden]`` of a decode batch (one token per request) run through the
        static buffers padded to ``size`` rows, without a graph: the path CUDA graphs replay,
        callable on any device (the CPU tests compare it with the unpadded step)."""
        buffers = self._buffers(size)
        buffers.fill(size, ids, positions, tables)
        meta = buffers.metadata(size)
        return self._forward(buffers.input_ids[:size], buffers.positions[:size], meta)[: len(ids)]

    @torch.inference_mode()
    def _warm_up(self) -> None:
        """One short prefill and one decode step through the model on the first KV block, so
        the first request does not pay one-time costs (oneDNN primitive creation, first touch
        of the weights and of the thread pool). Nothing is cached in block 0 yet: the scheduler
        overwrites whatever this writes before any attention reads it."""
        block = self.config.block_size
        n = min(block, self.max_model_len)
        for q_len, s_len in ((n, n), (1, n)):
            meta = AttentionMetadata.build([q_len], [s_len], [[0]], block, device=self.device)
            ids = torch.zeros(q_len, dtype=torch.int64, device=self.device)
            positions = torch.arange(s_len - q_len, s_len, device=self.device)
            hidden = self._forward_stage(ids, positions, self.kv_caches, meta)
            if hidden is not None and self.pooler is None:
                self.model.compute_logits(hidden[-1:]).argmax(dim=-1)
            if not self.causal:  # an encoder attends whole prompts: no decode step to warm
                break

    def _check_prompt_embeds(self) -> None:
        """--enable-prompt-embeds needs a generative model that embeds its input apart
        (`embed`) and takes the embeddings back (`forward_tensors`'s `hidden`)."""
        forward = getattr(self.model, "forward_tensors", None)
        takes = (
            hasattr(self.model, "embed")
            and forward is not None
            and "hidden" in inspect.signature(forward).parameters
            and self.pooler is None
            and vision_info(self.model) is None
        )
        if not takes:
            raise ModelLoadError(
                f"--enable-prompt-embeds: {type(self.model).__name__} takes no prompt embeddings (only generative "
                "text-only decoder models that embed their input apart do; vision-language models not yet)"
            )

    def _embeds(self, rid: str, data: bytes, num_prompt: int) -> torch.Tensor:
        """A request's prompt embeddings (float32 bytes) as a ``[prompt, hidden]`` tensor on the
        model's device and in its dtype (the runner checked at start that the model takes them)."""
        embeds = torch.frombuffer(bytearray(data), dtype=torch.float32)
        if embeds.numel() != num_prompt * self.hidden_size:
            raise ValueError(
                f"request {rid}: {embeds.numel()} embedding values for {num_prompt} positions of {self.hidden_size}"
            )
        return embeds.view(num_prompt, self.hidden_size).to(self.device, self.loaded.dtype)

    def _process(
        self, logits: torch.Tensor, sample_ids: list[str], states: list[_RequestState], drafts: list[list[int]]
    ) -> torch.Tensor:
        """The --logits-processors over the step's logits, one row per request and draft position
        (`sonar.engine.logits_processors`)."""
        assert self.processors is not None
        keys, params, prompts, outputs = [], [], [], []
        for rid, state, guesses in zip(sample_ids, states, drafts):
            for j in range(1 + len(guesses)):
                keys.append((rid, j))
                params.append(state.params)
                prompts.append(state.prompt_tokens)
                outputs.append(state.output if j == 0 else state.output + guesses[:j])
        all_greedy = all(p.temperature < GREEDY_EPS for p in params)
        return self.processors.apply(logits, keys, params, prompts, outputs, all_greedy)

    def _prompt_logprobs(self, hidden: torch.Tensor, rid: str, start: int) -> list[TokenLogprobs | None]:
        """Logprobs of prompt tokens start+1 .. start+rows (row t predicts token t+1)."""
        state = self.requests[rid]
        prompt = state.prompt
        rows = hidden.shape[0]
        last = min(start + rows, len(prompt) - 1)  # the last prompt position predicts no prompt token
        out: list[TokenLogprobs | None] = [None] if start == 0 else []
        if last > start:
            logits = self.model.compute_logits(hidden[: last - start])[:, : self.vocab_size]
            targets = torch.tensor(prompt[start + 1 : last + 1], device=logits.device)
            n = state.params.prompt_logprobs or 0
            lp = compute_prompt_logprobs(logits, targets, n)
            out += [_row(lp, i, n) for i in range(last - start)]
        return out


def _verify(tokens: list[int], failed: list[int], row: int, drafts: list[int]) -> list[int]:
    """The tokens a request keeps from its rows ``row ..``: each row's sample while the one
    before it equals its draft (the drafts the samples agree with, then the first sample that
    differs, or the one after the last draft), stopping before a row that failed. Exact
    rejection sampling for drafts that are one token each (`sonar.core.speculative`)."""
    kept = []
    for j in range(1 + len(drafts)):
        if failed[row + j]:
            break
        token = tokens[row + j]
        kept.append(token)
        if j == len(drafts) or token != drafts[j]:
            break
    return kept


def _row(lp: LogprobsTensors, i: int, n: int) -> TokenLogprobs:
    return TokenLogprobs(
        token_ids=lp.token_ids[i, : 1 + n].tolist(),
        logprobs=lp.logprobs[i, : 1 + n].tolist(),
        rank=int(lp.ranks[i]),
    )
