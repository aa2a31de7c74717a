"""The engine's configuration: the server flags that shape the engine, with underscores.

`EngineConfig.from_args(**engine_args)` is what `sonar.open(model, **engine_args)` and (later)
the CLI use; unknown names are a `TypeError`, bad values a `ValueError` naming the argument.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import msgspec

from sonar.actors.spec import ChildProcess, InProcess, Remote, parse_placement, placement_name
from sonar.engine.nodes import check_data_parallel_nodes, check_nodes, replica_on_node
from sonar.units import parse_max_model_len, parse_memory_size

ACTORS = ("worker", "offload", "detokenizer", "scheduler")

DATA_PARALLEL_ROUTING = ("prefix", "load")

#: The request-size limits, each a `serve` flag of the same name (dashes for underscores).
LIMITS = (
    "max_prompt_chars",
    "max_stop_strings",
    "max_stop_string_chars",
    "max_stop_token_ids",
    "max_logit_bias",
    "max_chat_messages",
    "max_completions_per_request",
    "max_structured_output_chars",
)


#: The step's token budget when none is given (and `max_num_seqs` is not larger).
DEFAULT_MAX_NUM_BATCHED_TOKENS = 512
DECODE_STEPS = 8
"""Decode steps per trip by default (`EngineConfig.decode_steps`): the trip is then ~1/8 of its
cost per token, and a stream sees each token as it is sampled all the same (BENCHMARKS.md)."""


class EngineConfig(msgspec.Struct, kw_only=True, frozen=True):
    model: str | None = None
    tokenizer: str | None = None
    revision: str | None = None
    download_dir: str | None = None
    load_format: str = "auto"
    """How weights are read (`sonar.models.load_formats`, `sonar.models.loader`)."""
    hf_token: str | None = None
    """Authenticates hub downloads (`sonar.models.hub`); None: ``HF_TOKEN`` or huggingface_hub's login."""
    tokenizer_revision: str | None = None
    """The revision of the tokenizer's repository (`tokenizer`, else the model's) to download its files at."""
    ignore_patterns: list[str] = msgspec.field(default_factory=lambda: ["original/**/*"])
    """Files neither downloaded nor read as weights (globs relative to the model folder)."""
    model_loader_extra_config: dict[str, Any] = {}
    """The load format's own settings (``concurrency`` of ``runai_streamer``)."""
    safetensors_load_strategy: str | None = None
    """``lazy`` (None: memory-mapped) or ``eager`` (each file read whole first)."""
    dtype: str = "auto"
    quantization: str | None = None
    """The weights' quantization method (None: what the checkpoint declares)."""
    dequantize_weights: bool = False
    """Serve a quantized checkpoint dequantized to `dtype` (the reference path)."""
    seed: int = 0
    max_model_len: int | None = None  # None: from the model's config; -1: auto (fit the KV cache)
    block_size: int = 16
    kv_cache_memory_bytes: int | None = None
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "sha256"
    max_num_seqs: int = 256
    max_waiting_seqs: int = 4096
    """Most sequences (a request with ``n`` completions counts ``n``) waiting to be scheduled; new
    ones beyond are refused (`ServerOverloadedError`, HTTP 429) rather than queued without end."""
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    """On CPU a 2048-token step makes every running request wait ~2 s for a wave of prefills; 512
    interleaves them with decodes at the same prefill throughput (BENCHMARKS.md). Not given, it is
    at least `max_num_seqs` (each running sequence takes a token of every step); given below it,
    it is refused."""
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    scheduling_policy: str = "fcfs"
    watermark: float = 0.0
    scheduler_reserve_full_isl: bool = True
    async_scheduling: bool | None = None
    """Schedule and send step N+1 while step N runs (`sonar.engine.scheduler`). None: on for a
    CUDA device, off on the CPU, where the scheduler's work then competes with the step's
    threads for the cores (measured slower on 2 cores, BENCHMARKS.md). Off with KV offloading."""
    decode_steps: int | None = None
    """Multi-step decode: the most decode steps the worker runs back to back for one message from
    the scheduler, when every running request decodes and nothing waits (`sonar.core.schedule`),
    so the trip between them is paid once per that many tokens; a request that arrives meanwhile
    waits for one decode step, not for all. None: `DECODE_STEPS` on one rank where it can run,
    else 1 (also with a fault plan or detailed traces, which count decode steps). An explicit
    number above 1 falls back to 1, with a warning at start, under async scheduling (the GPU
    default), speculative decoding or pipeline stages, which keep one decode step per trip."""
    stream_steps: bool = True
    """A multi-step decode's tokens go out as each of its decode steps samples them, while the
    next one runs, so a stream sees each token as soon as it would without it; False: with the
    step's result (``serve`` with ``--stream-interval`` above 1, which holds them back anyway)."""
    max_logprobs: int = 20
    enforce_eager: bool = False
    optimization_level: int = 2
    """``-O``: 0 compiles nothing and captures no CUDA graph; 1 captures graphs; 2 (default) also
    compiles the model with ``torch.compile`` on CUDA; 3 compiles on the CPU too, where it was
    measured ~5-7 % faster per step for 12-15 s more start-up with a warm cache (81 s cold), so
    it is not the default there (BENCHMARKS.md). ``enforce_eager`` overrides every level."""
    """Plain eager PyTorch: no CUDA graphs (and on CPU no oneDNN prepacking)."""
    gpu_memory_utilization: float = 0.92
    """Share of the device's *total* memory this instance may use (weights, activations, graphs,
    KV cache); startup fails when that much is not free. Unused on CPU."""
    kv_cache_dtype: str = "auto"
    """Storage type of the KV cache: auto (the model's dtype), bfloat16, float16, fp8 / fp8_e4m3."""
    cudagraph_capture_sizes: list[int] | None = None
    """Decode batch sizes captured as CUDA graphs; None: derived (`sonar.engine.cudagraph`)."""
    max_cudagraph_capture_size: int | None = None
    device_ids: str | None = None
    """One CUDA device index to run on (``--device-ids 1``); None: device 0. ``SONAR_DEVICE``
    (cpu, cuda, cuda:N) overrides the choice of device."""
    placement: dict[str, str] = {}
    tensor_parallel_size: int = 1
    """Ranks each layer's weights split over (`sonar.models.parallel`): one worker process per rank,
    under a one-for-all supervisor (`sonar.engine.tree`)."""
    pipeline_parallel_size: int = 1
    """Stages the layers are partitioned into, each its own tensor-parallel group of ranks
    (``SONAR_PP_LAYER_PARTITION``, layers per stage, overrides the even partition)."""
    enable_expert_parallel: bool = False
    """Deal each MoE layer's experts, whole, over the tensor-parallel ranks instead of slicing every
    expert (`sonar.models.moe`); the expert-parallel size is `tensor_parallel_size` (data-parallel
    replicas are independent engines, each holding every expert). Dense models: no effect."""
    expert_placement_strategy: str = "linear"
    """With expert parallelism: ``linear`` (contiguous ranges of experts per rank) or ``round_robin``
    (expert ``e`` on rank ``e % tensor_parallel_size``)."""
    enable_ep_weight_filter: bool = False
    """With expert parallelism, do not read other ranks' per-expert tensors from safetensors files
    (lazy reads; a stacked-experts tensor is read whole)."""
    enable_eplb: bool = False
    """With expert parallelism, rebalance each MoE layer's experts over the ranks by the load the
    router gives them (`sonar.models.eplb`), as `eplb_config` says."""
    eplb_config: dict[str, Any] = {}
    """`--eplb-config` (`sonar.core.eplb.EplbConfig`): window_size, step_interval,
    num_redundant_experts, log_balancedness, log_balancedness_interval."""
    distributed_executor_backend: str | None = None
    """How the ranks start: ``uni`` (one worker, no group), ``mp`` (a process per rank on this
    machine), ``ray`` (a process per rank placed by Ray, `sonar.actors.ray_runner`) or
    ``external_launcher`` (torchrun's processes, each one rank); None: ``uni`` for one rank, ``mp``
    for several (``ray`` with ``data_parallel_backend`` ``ray``)."""
    distributed_timeout_seconds: float | None = None
    """Bound on the group's rendezvous and collectives (NCCL); None: torch's default."""
    cpu_distributed_timeout_seconds: float | None = None
    """The same for gloo groups (the CPU); None: `distributed_timeout_seconds`, else torch's default."""
    nnodes: int = 1
    """Machines the group's ranks are split over, evenly and in order (`sonar.engine.nodes`)."""
    node_rank: int = 0
    """This machine's node: 0 is the head (API server, scheduler, rank 0), the others run
    ``sonar serve --headless``."""
    master_addr: str = "127.0.0.1"
    """The head's address: torch's rendezvous store listens there, at `master_port`."""
    master_port: int = 29501
    """The rendezvous store's port; a headless node's rank ``r`` listens on ``master_port + r``."""
    node_hosts: tuple[str, ...] = ()
    """The head only: the address of each headless node (1 .. nnodes-1), as they reported it at
    the rendezvous (`sonar.engine.node_agent.open_head`)."""
    data_parallel_size: int = 1
    """Engine replicas (`sonar.engine.replicas`): each a whole engine with its own worker,
    scheduler, detokenizer and KV cache; requests go to the one holding the longest cached prefix
    of their prompt, else the least loaded (`sonar.core.routing`). They share the KV memory budget."""
    data_parallel_size_local: int | None = None
    """Replicas on this machine, ``data_parallel_start_rank`` onward; None: all of them. Fewer than
    `data_parallel_size` spreads the replicas over several machines (`sonar.engine.nodes`)."""
    data_parallel_start_rank: int = 0
    """The first replica of this machine: 0 on the head, past the head's on a headless node."""
    data_parallel_backend: str = "mp"
    """How the replicas' workers start: ``mp`` (Sonar's own processes, on this machine and on
    ``--headless`` nodes) or ``ray`` (each replica's worker, or each of its ranks, placed by Ray over
    the cluster's nodes: `distributed_executor_backend` ``ray`` for every replica, see
    `sonar.actors.ray_runner`)."""
    data_parallel_address: str | None = None
    """With replicas on several machines: the head's address, where its rendezvous store listens."""
    data_parallel_rpc_port: int | None = None
    """With replicas on several machines: the rendezvous store's port; replica ``i`` of a headless
    node listens at ``data_parallel_rpc_port + i`` (its worker's actor host)."""
    data_parallel_nodes: tuple[tuple[str, int, int], ...] = ()
    """The head only: each headless node's address, first replica and replica count, as they
    reported them at the rendezvous (`sonar.engine.node_agent.open_data_parallel_head`)."""
    data_parallel_routing: str = "prefix"
    """How requests pick a replica: "prefix" (the longest cached prefix first, then load) or
    "load" (load only)."""
    data_parallel_index: int = 0
    """Which replica this engine is; set by the engine tree for each replica, not a flag."""
    step_timeout: float = 600.0
    """Seconds the scheduler waits for one step (a multi-step decode: for each of its decode steps)
    before it counts the worker as failed."""
    hang_margin: float = 10.0
    """Slack of the worker's liveness deadline: a step counts as hung past four times what earlier
    steps predict for its size plus this many seconds (`step_timeout` until a first step has
    finished)."""
    fault_injection: str | None = None
    """Make the worker fail on purpose (see `sonar.engine.faults`); off by default."""
    enable_logging_iteration_details: bool = False
    """Log one `scheduler.iteration` line per step: its batch composition and elapsed time."""
    kv_cache_metrics: bool = False
    """Follow a sample of KV blocks' lifetimes, idle times and reuse gaps (`sonar.core.kv_residency`)."""
    kv_cache_metrics_sample: float = 0.01
    """The fraction of allocated blocks `kv_cache_metrics` follows, in (0, 1]."""
    enable_mfu_metrics: bool = False
    collect_detailed_traces: str | None = None
    """``model``, ``worker``, ``all`` or two of them comma-separated: each request's updates carry
    its worker time (`RequestModelTime`; ``model`` times the forward pass, synchronizing the device)."""
    otlp_traces_endpoint: str | None = None
    """With `collect_detailed_traces`: the OTLP/HTTP collector the scheduler exports its per-step
    spans to (`sonar.engine.step_spans`; `serve` sets it from --otlp-traces-endpoint)."""
    """Count each step's estimated FLOPs and bytes read, and the worker's time (`sonar.core.flops`)."""
    kv_offloading_size: float | None = None
    """GiB of CPU memory for a second KV tier (`--kv-offloading-size`); None: no offloading."""
    kv_offloading_backend: str = "native"
    kv_transfer_config: dict[str, Any] | None = None
    """`--kv-transfer-config`: the OffloadingConnector with a CPU or a CPU-then-disk spec."""
    kv_events_config: dict[str, Any] | None = None
    """`--kv-events-config`: publish KV cache events over ZMQ."""
    speculative_config: dict[str, Any] | None = None
    """`--speculative-config` (`sonar.core.speculative.SpeculativeConfig`); None: no speculation."""
    spec_method: str | None = None
    """`--spec-method`: the ``method`` of the speculative config."""
    spec_tokens: int | None = None
    """`--spec-tokens`: its ``num_speculative_tokens``."""
    spec_model: str | None = None
    """`--spec-model`: its ``model`` (a draft model)."""
    enable_lora: bool = False
    """Serve LoRA adapters (`sonar.lora`): the targeted linears get ``max_loras`` adapter slots."""
    lora_modules: list[Any] | None = None
    """Adapters served from the start: ``name=path`` strings or ``{"name", "path", "base_model_name"}``
    objects (`sonar.lora.registry.parse_lora_modules`)."""
    max_loras: int = 1
    """Most distinct adapters in one step (the scheduler holds back requests of others)."""
    max_lora_rank: int = 16
    lora_dtype: str = "auto"
    """The adapters' slots' dtype; auto: the model's."""
    max_cpu_loras: int | None = None
    """Adapters kept in host memory once read (an LRU); None: ``max_loras``."""
    lora_target_modules: list[str] | None = None
    """Projections adapters apply to (`sonar.lora.adapter.TARGET_NAMES`); None: all."""
    fully_sharded_loras: bool = False
    """With tensor parallelism, shard the adapters' rank (column-parallel layers) and output
    rows (row-parallel layers) too, exchanging the shrink's result (`sonar.models.lora`)."""
    runner: str = "auto"
    """``generate``, ``pooling`` (embeddings, classification, scores: `sonar.models.pooler`), or
    ``auto``: pooling for a model that can only pool (an encoder, a classifier of sequences or tokens)."""
    convert: str = "auto"
    """``embed`` / ``classify`` / ``reward``: serve the model as an embedding model / a classifier /
    a per-token reward model (vLLM's, beyond the reference's choices); ``none`` as it is."""
    pooler_config: dict[str, Any] | None = None
    """`--pooler-config` (`sonar.pooling_params.PoolerConfig`): pooling type, normalize, dimensions,
    use_activation."""
    limit_mm_per_prompt: dict[str, Any] = {}
    """`--limit-mm-per-prompt`: most items of each modality in one prompt (`sonar.multimodal.limits`)."""
    language_model_only: bool = False
    """`--language-model-only`: accept no images (as a limit of 0)."""
    skip_mm_profiling: bool = False
    """`--skip-mm-profiling`: the CUDA memory profile leaves out the vision tower's run on the largest
    image (`ModelRunner.profile_image`)."""
    enable_mm_embeds: bool = False
    """`--enable-mm-embeds`: accept images given as their feature rows (`sonar.engine.image_embeds`)."""
    mm_processor_kwargs: dict[str, Any] | None = None
    media_io_kwargs: dict[str, Any] = {}
    """`--media-io-kwargs`: how images are loaded (`sonar.multimodal.media.image_io`)."""
    mm_processor_cache_gb: float = 4.0
    """`--mm-processor-cache-gb`: GiB of processed images kept by their bytes (`sonar.multimodal.cache`)."""
    """`--mm-processor-kwargs`: settings over the image processor's (`sonar.multimodal.processor`)."""
    hf_overrides: dict[str, Any] = {}
    """Fields that replace those of the model's Hugging Face config (a reranker's
    ``classifier_from_token``, say)."""
    # What one request may ask for (`LIMITS`): going over one is an InvalidRequestError naming the
    # parameter and the limit, checked where the request enters the engine (`LLM`).
    max_prompt_chars: int = 1_000_000
    """Characters of one text prompt (a chat: of its rendered template), checked before tokenizing."""
    max_stop_strings: int = 64
    max_stop_string_chars: int = 1024
    max_stop_token_ids: int = 1024
    max_logit_bias: int = 1024
    """Entries of one request's `logit_bias`."""
    max_chat_messages: int = 1024
    max_completions_per_request: int = 256
    """Completions one call may ask for: n x prompts (`generate_many`, a batched HTTP request)."""
    max_structured_output_chars: int = 65536
    """Characters of one request's structured output spec (schema, regex, grammar, choices)."""
    structured_outputs_compile_timeout: float = 10.0
    """Seconds a request waits for its grammar to compile before it is refused."""
    structured_outputs_config: dict[str, Any] = {}
    """`--structured-outputs-config`: backend, disable_any_whitespace, disable_additional_properties
    (`sonar.structured.StructuredOutputsConfig`)."""
    enable_sleep_mode: bool = False
    """Allow `LLM.sleep` / `wake_up` (``POST /sleep``, ``/wake_up``): free the KV cache and move
    or drop the weights while the engine is not needed (`sonar.core.sleep`)."""
    enable_prompt_embeds: bool = False
    """`--enable-prompt-embeds`: a prompt may be given as its input embeddings instead of token ids
    (`sonar.engine.prompt_embeds`)."""
    logits_processors: tuple[str, ...] | None = None
    """`--logits-processors`: classes the worker loads and applies to every step's logits before
    sampling (`sonar.engine.logits_processors`)."""
    profiler_config: dict[str, Any] = {}
    """`--profiler-config` (`sonar.engine.profiler.ProfilerConfig`): with ``profiler`` ``torch``,
    `LLM.start_profile` / `stop_profile` trace the workers' steps into ``torch_profiler_dir``."""
    weight_transfer_config: dict[str, Any] | None = None
    """`--weight-transfer-config` (`sonar.core.weights.WeightTransferConfig`): set, `LLM.update_weights`
    writes new weights into the running engine (``POST /update_weights``)."""

    @classmethod
    def from_args(cls, model: str | None = None, **args: Any) -> "EngineConfig":
        fields = set(cls.__struct_fields__)
        unknown = sorted(set(args) - fields)
        if unknown:
            raise TypeError(f"unknown engine argument(s): {', '.join(unknown)}")
        for name in (
            "kv_transfer_config",
            "kv_events_config",
            "structured_outputs_config",
            "speculative_config",
            "pooler_config",
            "hf_overrides",
            "model_loader_extra_config",
            "profiler_config",
            "weight_transfer_config",
            "eplb_config",
        ):
            if isinstance(args.get(name), str):  # a JSON object, as on the command line
                args[name] = _json_object(args[name], name)
        if args.get("max_num_batched_tokens") is None:
            args.pop("max_num_batched_tokens", None)
            seqs = args.get("max_num_seqs")
            if isinstance(seqs, int) and not isinstance(seqs, bool) and seqs > DEFAULT_MAX_NUM_BATCHED_TOKENS:
                args["max_num_batched_tokens"] = seqs
        if "max_model_len" in args and args["max_model_len"] is not None:
            args["max_model_len"] = parse_max_model_len(args["max_model_len"])
        if args.get("kv_cache_memory_bytes") is not None:
            args["kv_cache_memory_bytes"] = parse_memory_size(args["kv_cache_memory_bytes"])
        if args.get("data_parallel_backend") == "ray" and args.get("distributed_executor_backend") is None:
            args["distributed_executor_backend"] = "ray"  # Ray places every replica's ranks
        placement = args.get("placement")
        if isinstance(placement, str):  # "worker=process,detokenizer=inprocess"
            pairs = [p.split("=", 1) for p in placement.split(",") if p.strip()]
            if any(len(p) != 2 for p in pairs):
                raise ValueError(f"placement: expected actor=where pairs, got {placement!r}")
            args["placement"] = {k.strip(): v.strip() for k, v in pairs}
        try:
            config = msgspec.convert(dict(args, model=model), cls)
        except msgspec.ValidationError as exc:
            raise ValueError(f"invalid engine argument: {exc}") from None
        config.check()
        return config

    def check(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.max_model_len is not None and self.max_model_len != -1 and self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive or 'auto', got {self.max_model_len}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override <= 0:
            raise ValueError(f"num_gpu_blocks_override must be positive, got {self.num_gpu_blocks_override}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError(f"kv_cache_memory_bytes must be positive, got {self.kv_cache_memory_bytes}")
        if self.optimization_level not in (0, 1, 2, 3):
            raise ValueError(f"optimization_level must be 0, 1, 2 or 3, got {self.optimization_level}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.otlp_traces_endpoint is not None:
            if not self.collect_detailed_traces:
                raise ValueError(
                    "otlp_traces_endpoint: the engine exports only the step spans of collect_detailed_traces; "
                    "set that too"
                )
            from sonar.engine.otlp import TracingConfigError, traces_url

            try:
                traces_url(self.otlp_traces_endpoint)
            except TracingConfigError as exc:
                raise ValueError(f"otlp_traces_endpoint: {exc}") from None
        from sonar.engine.settings import (
            capture_sizes,
            check_expert_parallel,
            check_kv_cache_dtype,
            check_load_settings,
            parse_device_ids,
        )
        from sonar.multimodal.limits import ProcessorConfigError, check_processor_kwargs, image_limit
        from sonar.multimodal.media import image_io

        try:
            image_limit(self.limit_mm_per_prompt, self.language_model_only)
            check_processor_kwargs(self.mm_processor_kwargs)
            loader = image_io(self.media_io_kwargs)
        except ProcessorConfigError as exc:
            raise ValueError(str(exc)) from None
        if loader.image_mode != "RGB" and (self.mm_processor_kwargs or {}).get("do_convert_rgb") is False:
            raise ValueError(
                f"--media-io-kwargs image_mode {loader.image_mode!r} needs the image processor's do_convert_rgb "
                "(--mm-processor-kwargs sets it false): the vision tower takes RGB"
            )
        if not self.mm_processor_cache_gb >= 0:
            raise ValueError(f"mm_processor_cache_gb must be 0 (off) or more, got {self.mm_processor_cache_gb}")
        check_kv_cache_dtype(self.kv_cache_dtype)
        check_load_settings(self)
        capture_sizes(self)
        parse_device_ids(self.device_ids)
        self._check_lora()
        self._check_pooling()
        if self.max_waiting_seqs <= 0:
            raise ValueError(f"max_waiting_seqs must be positive, got {self.max_waiting_seqs}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            # Every running sequence takes at least one token of a step.
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least max_num_seqs "
                f"({self.max_num_seqs}): raise --max-num-batched-tokens or lower --max-num-seqs"
            )
        if self.hang_margin <= 0:
            raise ValueError(f"hang_margin must be positive, got {self.hang_margin}")
        if self.fault_injection:
            from sonar.engine.faults import FaultPlan

            plan = FaultPlan.parse(self.fault_injection)
            ranks = sorted({f.rank for f in plan.faults} if plan is not None else ())
            if ranks and ranks[-1] >= self.tensor_parallel_size * self.pipeline_parallel_size:
                raise ValueError(
                    f"fault_injection names rank {ranks[-1]}, but the worker has "
                    f"{self.tensor_parallel_size * self.pipeline_parallel_size} rank(s)"
                )
        for name in LIMITS:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        self.structured_config()
        if self.structured_outputs_compile_timeout <= 0:
            raise ValueError(
                f"structured_outputs_compile_timeout must be positive, got {self.structured_outputs_compile_timeout}"
            )
        if self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be -1 (no cap) or >= 0, got {self.max_logprobs}")
        if self.decode_steps is not None and self.decode_steps < 1:
            raise ValueError(f"decode_steps must be at least 1, got {self.decode_steps}")
        for actor, where in self.placement.items():
            if actor not in ACTORS:
                raise ValueError(f"placement: unknown actor {actor!r} (one of {', '.join(ACTORS)})")
            parse_placement(where)
        self.check_parallel()
        self._check_data_parallel()
        check_expert_parallel(self)
        self._check_speculative()
        offload = self.offload_config()
        self.kv_events()
        if offload is not None and self.kv_cache_dtype != "auto":
            raise ValueError(
                f"KV offloading with kv_cache_dtype {self.kv_cache_dtype} is not supported yet "
                "(the offload tiers store the model's dtype); drop one of the two"
            )
        self.profiler()
        self._check_sleep_mode()
        self._check_weight_transfer()
        if self.enable_prompt_embeds and self.world_size > 1:
            raise ValueError(
                "--enable-prompt-embeds with tensor or pipeline parallelism is not supported yet (only one worker "
                "rank feeds embeddings to the model)"
            )
        if offload is not None and not self.enable_prefix_caching:
            raise ValueError(
                "KV offloading needs prefix caching (offloaded chunks are keyed by its block hashes); "
                "drop --no-enable-prefix-caching"
            )

    @property
    def step_spans(self) -> bool:
        """Per-step spans are exported (`sonar.engine.step_spans`)."""
        return bool(self.collect_detailed_traces) and self.otlp_traces_endpoint is not None

    @property
    def trace_worker(self) -> bool:
        """--collect-detailed-traces names the worker (or all): requests carry their worker time."""
        return bool(self.collect_detailed_traces) and self.collect_detailed_traces != "model"

    @property
    def trace_model(self) -> bool:
        """--collect-detailed-traces names the model (or all): the worker times each forward pass."""
        modules = set((self.collect_detailed_traces or "").split(","))
        return bool(modules & {"model", "all"})

    @property
    def world_size(self) -> int:
        """The worker processes: tensor-parallel ranks times pipeline stages."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def check_parallel(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        tp, pp = self.tensor_parallel_size, self.pipeline_parallel_size
        if pp == 1:
            what = f"tensor_parallel_size {tp}"
        elif tp == 1:
            what = f"pipeline_parallel_size {pp}"
        else:
            what = f"{tp} x {pp} ranks (tensor x pipeline)"
        self._check_data_parallel_backend()
        backend = self.distributed_executor_backend
        if backend == "external_launcher":
            self._check_launched()
        if backend not in (None, "uni", "mp", "ray", "external_launcher"):
            raise ValueError(
                f"distributed_executor_backend {backend!r} is not supported yet "
                "(Sonar starts ranks with 'uni', 'mp' or 'ray')"
            )
        if backend == "ray" and not ray_installed():
            raise ValueError("distributed_executor_backend 'ray' needs Ray: pip install sonar[ray]")
        if backend == "ray" and isinstance(self.placement_of("worker"), Remote):
            raise ValueError(
                "distributed_executor_backend 'ray' places the workers itself; drop the worker placement "
                f"{self.placement['worker']}"
            )
        last_port = self.master_port + self.data_parallel_size * self.world_size - 1
        if backend == "ray" and not 0 < self.master_port <= last_port <= 65535:
            raise ValueError(
                f"master_port {self.master_port}: a rank Ray places on another node listens at master_port + rank "
                f"(past the data-parallel replicas before its own), up to {last_port}, which must be a port"
            )
        for name in ("distributed_timeout_seconds", "cpu_distributed_timeout_seconds"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        check_nodes(self)
        if self.world_size == 1:
            return
        if backend == "uni":
            raise ValueError(
                f"distributed_executor_backend 'uni' runs one worker; {what} need 'mp' (a process per rank)"
            )
        # a headless node's replica: its ranks in the actor hosts its node keeps for them
        if not isinstance(self.placement_of("worker"), (InProcess, ChildProcess)) and not replica_on_node(self):
            raise ValueError(
                f"{what} start their ranks on this machine; a remote worker placement "
                f"({self.placement['worker']}) is not supported with them yet"
            )
        if self.offload_config() is not None:
            raise ValueError(
                f"KV offloading with {what} is not supported yet (each rank caches its own heads and layers); "
                "drop one of the two"
            )

    def _check_data_parallel_backend(self) -> None:
        """``--data-parallel-backend ray``: Ray places every replica's ranks over the cluster's
        nodes, so what lays the replicas out over machines by hand (headless nodes) is refused by
        name, as is an executor backend other than Ray's."""
        backend = self.data_parallel_backend
        if backend not in ("mp", "ray"):
            raise ValueError(f"--data-parallel-backend must be 'mp' or 'ray', got {backend!r}")
        if backend == "mp":
            return
        if not ray_installed():
            raise ValueError("--data-parallel-backend ray needs Ray: pip install sonar[ray]")
        executor = self.distributed_executor_backend
        if executor is None:  # `from_args` sets it; a config built field by field must say it
            raise ValueError(
                "--data-parallel-backend ray needs distributed_executor_backend 'ray' (Ray places the ranks)"
            )
        if executor != "ray":
            raise ValueError(
                "--data-parallel-backend ray places each replica's ranks with Ray, which is "
                f"--distributed-executor-backend ray; drop --distributed-executor-backend {executor}"
            )
        size = self.data_parallel_size
        why = "Ray decides which node runs each replica"
        refused = [
            (
                "--data-parallel-size-local",
                self.data_parallel_size_local not in (None, size),
                self.data_parallel_size_local,
            ),
            ("--data-parallel-start-rank", self.data_parallel_start_rank != 0, self.data_parallel_start_rank),
            ("--data-parallel-address", self.data_parallel_address is not None, self.data_parallel_address),
            ("--data-parallel-rpc-port", self.data_parallel_rpc_port is not None, self.data_parallel_rpc_port),
            ("--nnodes", self.nnodes != 1, self.nnodes),
        ]
        for flag, given, value in refused:
            if given:
                raise ValueError(f"{flag} {value} is not supported with --data-parallel-backend ray: {why}")
        if self.pipeline_parallel_size > 1:
            raise ValueError(
                f"--pipeline-parallel-size {self.pipeline_parallel_size} with --data-parallel-backend ray is not "
                "supported yet: a replica's pipeline stages answer its rank 0 over a local socket, and Ray may put "
                "that replica on another node than the scheduler's; use --tensor-parallel-size"
            )

    @property
    def launched(self) -> bool:
        """torchrun started this process as one rank of the world (``external_launcher``): its one
        worker runs here, in-process, and its peers are torchrun's other processes
        (`sonar.engine.launcher`)."""
        return self.distributed_executor_backend == "external_launcher"

    def _check_launched(self) -> None:
        """What torchrun's ranks cannot run yet, refused by name: rank 0 alone schedules and
        broadcasts each step, so anything that reaches the workers outside a step, or keeps
        several steps in flight, has no way to the other ranks."""
        refused = [
            ("data_parallel_size > 1 (start one torchrun world per replica)", self.data_parallel_size > 1),
            ("async_scheduling (the ranks take one step at a time)", self.async_scheduling is True),
            ("enable_sleep_mode", self.enable_sleep_mode),
            ("weight_transfer_config", self.weight_transfer_config is not None),
            ("profiler_config", bool(self.profiler_config)),
            ("KV offloading or KV events (an offload manager)", self.offload_manager_needed),
            ("a worker placement (torchrun placed this rank)", "worker" in self.placement),
            ("fault_injection at a rank other than 0 (the other ranks run no worker)", self._faults_past_rank0()),
        ]
        for name, given in refused:
            if given:
                raise ValueError(f"distributed_executor_backend 'external_launcher' does not support {name} yet")

    def _faults_past_rank0(self) -> bool:
        from sonar.engine.faults import FaultPlan

        plan = FaultPlan.parse(self.fault_injection)
        return plan is not None and any(fault.rank > 0 for fault in plan.faults)

    def collective_timeout(self, device_type: str) -> float | None:
        """Seconds the tensor-parallel group's rendezvous and collectives may take (None: torch's
        default): NCCL's on a GPU, gloo's on the CPU."""
        if device_type == "cuda":
            return self.distributed_timeout_seconds
        return self.cpu_distributed_timeout_seconds or self.distributed_timeout_seconds

    def _check_data_parallel(self) -> None:
        size = self.data_parallel_size
        if size < 1:
            raise ValueError(f"data_parallel_size must be at least 1, got {size}")
        if not 0 <= self.data_parallel_index < size:
            raise ValueError(f"data_parallel_index must be in 0..{size - 1}, got {self.data_parallel_index}")
        if self.data_parallel_routing not in DATA_PARALLEL_ROUTING:
            raise ValueError(
                f"data_parallel_routing must be one of {', '.join(DATA_PARALLEL_ROUTING)}, "
                f"got {self.data_parallel_routing!r}"
            )
        check_data_parallel_nodes(self)
        if size == 1:
            return
        remote = sorted(a for a, where in self.placement.items() if isinstance(parse_placement(where), Remote))
        if remote == ["worker"] and self.data_parallel_nodes:
            remote = []  # a replica of a headless node: its worker runs in the host that node keeps for it
        if remote:
            raise ValueError(
                f"data_parallel_size {size} with {remote[0]} placed on another machine is not supported: "
                "every replica would use the same actor host"
            )
        if self.offload_manager_needed:
            raise ValueError(
                f"data_parallel_size {size} with KV offloading or KV events is not supported yet "
                "(the replicas would share one offload directory and one event endpoint)"
            )

    def speculative(self) -> Any:
        """The `SpeculativeConfig` of ``--speculative-config`` and the ``--spec-*`` flags, or None
        (ValueError naming what is wrong; a flag and the JSON key it stands for must agree)."""
        from sonar.core.speculative import SpeculativeConfig

        raw = dict(self.speculative_config or {})
        for flag, key in (
            ("spec_method", "method"),
            ("spec_tokens", "num_speculative_tokens"),
            ("spec_model", "model"),
        ):
            value = getattr(self, flag)
            if value is None:
                continue
            if raw.get(key) is not None and raw[key] != value:
                raise ValueError(
                    f"--{flag.replace('_', '-')} {value!r} differs from --speculative-config.{key} {raw[key]!r} "
                    "(they are one setting: give one, or the same in both)"
                )
            raw[key] = value
        if not raw or (set(raw) == {"method"} and raw["method"] is None):
            return None
        return SpeculativeConfig.parse(raw)

    def _check_speculative(self) -> None:
        spec = self.speculative()
        if spec is None:
            return
        spec.draft_tp(self.tensor_parallel_size, self.pipeline_parallel_size)
        if spec.lookahead and self.offload_config() is not None:
            raise ValueError(
                f"speculative method {spec.method} with KV offloading is not supported yet (the tiers keep the "
                "target's KV only, not the draft's); drop one of the two"
            )

    def profiler(self) -> Any:
        """The `ProfilerConfig` of ``--profiler-config``, None when profiling is off (ValueError
        naming a bad or unsupported field)."""
        from sonar.engine.profiler import ProfilerConfig

        return ProfilerConfig.parse(self.profiler_config)

    def eplb(self) -> Any:
        """The `EplbConfig` of ``--eplb-config`` when ``--enable-eplb`` is on, else None
        (ValueError naming a bad or unsupported field)."""
        from sonar.core.eplb import EplbConfig

        return EplbConfig.parse(self.eplb_config) if self.enable_eplb else None

    def weight_transfer(self) -> Any:
        """The `WeightTransferConfig` of ``--weight-transfer-config``, None when weight updates
        are off (ValueError naming a bad field or a refused backend)."""
        from sonar.core.weights import WeightTransferConfig

        return WeightTransferConfig.parse(self.weight_transfer_config)

    def _check_weight_transfer(self) -> None:
        if self.weight_transfer() is not None and self.world_size > 1:
            raise ValueError(
                f"weight updates (--weight-transfer-config) with {self.world_size} worker ranks (tensor / pipeline "
                "parallelism) are not supported yet; drop one of the two"
            )

    def _check_sleep_mode(self) -> None:
        if not self.enable_sleep_mode:
            return
        spec = self.speculative()
        for name, on in (
            (f"{self.world_size} worker ranks (tensor / pipeline parallelism)", self.world_size > 1),
            ("LoRA adapters (--enable-lora)", self.enable_lora),
            ("a draft model (--speculative-config)", spec is not None and spec.lookahead),
        ):
            if on:
                raise ValueError(
                    f"sleep mode (--enable-sleep-mode) with {name} is not supported yet; drop one of the two"
                )

    def _check_lora(self) -> None:
        from sonar.lora.limits import MAX_RANKS, TARGET_NAMES
        from sonar.lora.registry import parse_lora_modules

        if not self.enable_lora:
            given = [
                name
                for name, default in (
                    ("lora_modules", None),
                    ("max_loras", 1),
                    ("max_lora_rank", 16),
                    ("lora_dtype", "auto"),
                    ("max_cpu_loras", None),
                    ("lora_target_modules", None),
                    ("fully_sharded_loras", False),
                )
                if getattr(self, name) != default
            ]
            if given:
                raise ValueError(f"{given[0]} is set but LoRA is off: add enable_lora (--enable-lora)")
            return
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be at least 1, got {self.max_loras}")
        if self.max_lora_rank not in MAX_RANKS:
            raise ValueError(f"max_lora_rank must be one of {', '.join(map(str, MAX_RANKS))}, got {self.max_lora_rank}")
        if self.lora_dtype not in ("auto", "bfloat16", "float16"):
            raise ValueError(f"lora_dtype must be auto, bfloat16 or float16, got {self.lora_dtype!r}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras})")
        unknown = sorted(set(self.lora_target_modules or ()) - set(TARGET_NAMES))
        if unknown or self.lora_target_modules == []:
            raise ValueError(
                f"lora_target_modules: unknown module {unknown[0] if unknown else '(none given)'}; "
                f"choose from {', '.join(TARGET_NAMES)}"
            )
        parse_lora_modules(self.lora_modules or [])

    def pooling_requested(self) -> bool:
        """Whether the flags make this a pooling model whatever the checkpoint (``auto`` may too)."""
        return self.runner == "pooling" or self.convert in ("embed", "classify", "reward")

    def pooler(self) -> Any:
        """The `PoolerConfig` of ``--pooler-config``."""
        from sonar.pooling_params import PoolerConfig

        return PoolerConfig.parse(self.pooler_config)

    def _check_pooling(self) -> None:
        # reward is vLLM's, beyond the reference's choices (docs/pooling.md)
        runners, converts = ("auto", "generate", "pooling"), ("auto", "none", "embed", "classify", "reward")
        if self.runner not in runners:
            hint = " (a draft model is given with --speculative-config)" if self.runner == "draft" else ""
            raise ValueError(f"runner {self.runner!r} is not supported; choose one of {', '.join(runners)}{hint}")
        if self.convert not in converts:
            raise ValueError(f"convert {self.convert!r} is not supported; choose one of {', '.join(converts)}")
        if self.runner == "generate" and self.convert in ("embed", "classify", "reward"):
            raise ValueError(f"convert {self.convert} makes a pooling model: it cannot run with runner generate")
        self.pooler()  # a PoolingParamsError is a ValueError naming the field
        if self.pooler_config is not None and self.runner == "generate":
            raise ValueError("pooler_config only applies to pooling models, not with runner generate")
        if "model_type" in self.hf_overrides:
            raise ValueError("hf_overrides may not change model_type (it decides how the checkpoint is read)")
        if self.pooling_requested():
            self.check_pooling_model()

    def check_pooling_model(self) -> None:
        """Refuse what a pooling model cannot be served with (also checked by the worker once it
        knows a model pools by itself)."""
        for name, on in (
            ("enable_lora", self.enable_lora),
            ("speculative_config", self.speculative() is not None),
            ("pipeline_parallel_size > 1", self.pipeline_parallel_size > 1),
        ):
            if on:
                raise ValueError(f"{name} is not supported with a pooling model (embeddings, classification, scores)")

    def lora_limits(self) -> Any:
        """The `LoRALimits` of the LoRA flags (None when LoRA is off)."""
        from sonar.lora.limits import LoRALimits

        if not self.enable_lora:
            return None
        targets = self.lora_target_modules
        return LoRALimits(self.max_lora_rank, None if targets is None else frozenset(targets))

    def offload_config(self) -> Any:
        """The `OffloadConfig` the offload flags ask for, or None (raises ValueError naming the rule)."""
        from sonar.offload.config import offload_config_from_flags

        return offload_config_from_flags(
            primary_block_size=self.block_size,
            kv_offloading_size=self.kv_offloading_size,
            kv_offloading_backend=self.kv_offloading_backend,
            kv_transfer_config=self.kv_transfer_config,
        )

    def structured_config(self) -> Any:
        """The `StructuredOutputsConfig` of `--structured-outputs-config` (ValueError naming a bad key)."""
        from sonar.structured.config import StructuredOutputsConfig

        return StructuredOutputsConfig.parse(self.structured_outputs_config)

    def kv_events(self) -> Any:
        """The `KVEventsConfig` of `--kv-events-config`, or None when events are off."""
        from sonar.offload.config import kv_events_config_from_flags

        return kv_events_config_from_flags(self.kv_events_config)

    @property
    def offload_manager_needed(self) -> bool:
        """The engine runs the KV offload manager (second tiers, or KV events, or both)."""
        return self.offload_config() is not None or self.kv_events() is not None

    def placement_of(self, actor: str):
        return parse_placement(self.placement.get(actor, "inprocess"))

    def describe_placement(self) -> dict[str, str]:
        """Where each actor of this engine runs (the offload manager only when it runs)."""
        actors = [a for a in ACTORS if a != "offload" or self.offload_manager_needed]
        return {a: placement_name(self.placement_of(a)) for a in actors}


def ray_installed() -> bool:
    """Whether Ray can be imported (the ``sonar[ray]`` extra), without importing it."""
    try:
        return importlib.util.find_spec("ray") is not None
    except ValueError:  # ``sys.modules["ray"] = None``: an import of it fails
        return False


def _json_object(text: str, name: str) -> dict[str, Any]:
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{name}: not valid JSON ({exc.msg} at position {exc.pos})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name}: expected a JSON object, got {type(value).__name__}")
    return value
