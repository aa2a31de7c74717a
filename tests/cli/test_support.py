"""Flags Sonar does not implement: their default (or a value that means the same for Sonar) is
accepted; any other value stops the start with one clear error naming the flag, and why."""

from __future__ import annotations

import pytest

from sonar.cli import FLAGS, Status, parse_serve_args


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (
            ["--decode-context-parallel-size", "2"],
            "sonar serve: --decode-context-parallel-size is not supported yet (got 2; Sonar accepts only 1)",
        ),
        (
            ["-dcp", "4"],
            "sonar serve: --decode-context-parallel-size is not supported yet (got 4; Sonar accepts only 1)",
        ),
        (
            ["--lora-modules", "a=/x"],
            "sonar serve: error: lora_modules is set but LoRA is off: add enable_lora (--enable-lora)",
        ),
        (["--enable-lora", "--max-loras", "0"], "sonar serve: error: argument --max-loras: must be positive, got 0"),
        (
            ["--enable-lora", "--max-loras", "4", "--max-cpu-loras", "2"],
            "sonar serve: error: max_cpu_loras (2) must be at least max_loras (4)",
        ),
        (
            ["--enable-lora", "--lora-target-modules", "q_proj", "lm_head"],
            "sonar serve: error: lora_target_modules: unknown module lm_head; choose from q_proj, k_proj, v_proj, "
            "o_proj, gate_proj, up_proj, down_proj, qkv_proj, gate_up_proj",
        ),
        (
            ["--enable-lora", "--lora-modules", "a"],
            "sonar serve: error: lora_modules: expected name=path or a JSON object, got 'a'",
        ),
        (
            ["--fully-sharded-loras"],
            "sonar serve: error: fully_sharded_loras is set but LoRA is off: add enable_lora (--enable-lora)",
        ),
        (["--grpc"], "sonar serve: --grpc is not supported yet"),
        (
            ["--media-io-kwargs.video.num_frames", "40"],
            "sonar serve: error: --media-io-kwargs: video settings are not supported: Sonar serves no video",
        ),
        (
            ["--media-io-kwargs", '{"image": {"image_mode": "RGB", "size": 3}}'],
            "sonar serve: error: --media-io-kwargs: image size not supported (the image loader takes image_mode, "
            "rgba_background_color)",
        ),
        (
            ["--media-io-kwargs.image.image_mode", "L", "--mm-processor-kwargs", '{"do_convert_rgb": false}'],
            "sonar serve: error: --media-io-kwargs image_mode 'L' needs the image processor's do_convert_rgb "
            "(--mm-processor-kwargs sets it false): the vision tower takes RGB",
        ),
        (
            ["--api-server-count", "2"],
            "sonar serve: error: argument --api-server-count: 2 API servers cannot run with --max-stored-responses: "
            "the Responses API's store is kept in each API server's memory, so a response stored by one would be "
            "missing on the others; start with --max-stored-responses 0",
        ),
        (
            ["-asc", "4", "--max-stored-responses", "0", "--enable-lora"],
            "sonar serve: error: argument --api-server-count: 4 API servers cannot run with --enable-lora: the LoRA "
            "adapter registry (load and unload by name) lives in the engine's own API server process, so the other "
            "API servers would not see it",
        ),
        (
            ["--speculative-config.method", "ngram"],
            "sonar serve: error: --speculative-config needs num_speculative_tokens (or --spec-tokens)",
        ),
        (
            ["--spec-method", "medusa", "--spec-tokens", "3"],
            "sonar serve: error: --speculative-config method 'medusa' needs a Medusa or MLP-speculator head, which "
            "Sonar does not run yet; the methods that work are ngram, suffix, draft_model, eagle, eagle3, mtp",
        ),
        (
            ["--kv-cache-dtype", "fp8_e5m2"],
            "sonar serve: --kv-cache-dtype is not supported yet (got fp8_e5m2; "
            "Sonar accepts only auto or bfloat16 or float16 or fp8 or fp8_e4m3)",
        ),
        (
            ["--kv-cache-dtype", "nvfp4"],
            "sonar serve: --kv-cache-dtype is not supported yet (got nvfp4; "
            "Sonar accepts only auto or bfloat16 or float16 or fp8 or fp8_e4m3)",
        ),
        (
            ["--calculate-kv-scales"],
            "sonar serve: --calculate-kv-scales is not supported yet (Sonar accepts only --no-calculate-kv-scales)",
        ),
        (
            ["--load-format", "tensorizer"],
            "sonar serve: --load-format is not supported yet (got tensorizer; Sonar accepts only auto or safetensors "
            "or pt or gguf or dummy or runai_streamer)",
        ),
    ],
)
def test_unsupported_values_fail_clearly(usage_error, argv: list[str], expected: str) -> None:
    assert usage_error(*argv) == expected


def test_unsupported_still_checks_the_value_first(usage_error) -> None:
    assert usage_error("--decode-context-parallel-size", "two").startswith(
        "sonar serve: error: argument --decode-context-parallel-size/-dcp: expected an integer"
    )


def test_the_server_refuses_torchruns_ranks_by_name(usage_error) -> None:
    assert "one HTTP server per torchrun rank makes no sense" in usage_error(
        "--distributed-executor-backend", "external_launcher"
    )


@pytest.mark.parametrize(
    "argv",
    [
        ["--tensor-parallel-size", "1"],
        ["--pipeline-parallel-size", "1"],
        ["--data-parallel-size", "1"],
        ["--api-server-count", "1"],
        ["-asc", "2", "--max-stored-responses", "0"],
        ["--kv-cache-dtype", "auto"],
        ["--no-enable-lora"],
        ["--distributed-executor-backend", "uni"],
        ["--tokenizer-mode", "hf"],
        ["-O0"],
        ["--load-format", "gguf"],
        ["--load-format", "dummy"],
    ],
)
def test_values_that_mean_the_default_are_accepted(argv: list[str]) -> None:
    parse_serve_args(argv)


#: Every flag that Sonar once accepted and ignored, by group, each with a value other than its
#: default: each must now stop the start.
REFUSED_BY_GROUP: dict[str, list[list[str]]] = {
    "options": [["--gdn-prefill-backend", "triton"]],
    "Frontend": [
        ["--data-parallel-supervisor-port", "9300"],
        ["--dp-supervisor-probe-interval-s", "1"],
        ["--dp-supervisor-probe-timeout-s", "1"],
        ["--dp-supervisor-probe-failure-threshold", "5"],
        ["--enable-offline-docs"],
        ["--no-enable-flash-late-interaction"],
    ],
    "ModelConfig": [
        ["--code-revision", "main"],
    ],
    "LoadConfig": [
        ["--safetensors-prefetch-num-threads", "4"],
        ["--safetensors-prefetch-block-size", "1M"],
    ],
    "MambaConfig": [
        ["--mamba-backend", "flashinfer"],
        ["--enable-mamba-cache-stochastic-rounding"],
        ["--mamba-cache-philox-rounds", "7"],
    ],
    "ParallelConfig": [
        ["--numa-bind-nodes", "0", "1"],
        ["--numa-bind-cpus", "0-3", "4-7"],
        ["--dcp-comm-backend", "a2a"],
        ["--dcp-kv-cache-interleave-size", "16"],
        ["--cp-kv-cache-interleave-size", "16"],
        ["--all2all-backend", "naive"],
        ["--ubatch-size", "8"],
        ["--dbo-decode-token-threshold", "64"],
        ["--dbo-prefill-token-threshold", "1024"],
        ["--disable-nccl-for-dp-synchronization"],
        ["--no-disable-nccl-for-dp-synchronization"],
        ["--max-parallel-loading-workers", "2"],
        ["--ray-workers-use-nsight"],
        ["--fault-tolerance-config", '{"engine_recovery_timeout": 30}'],
    ],
    "CacheConfig": [
        ["--mamba-cache-dtype", "float32"],
        ["--mamba-ssm-cache-dtype", "float16"],
        ["--mamba-block-size", "64"],
        ["--mamba-cache-mode", "all"],
        ["--replayssm-buffer-len", "32"],
        ["--use-replayssm"],
    ],
    "OffloadConfig": [
        ["--offload-backend", "uva"],
        ["--cpu-offload-params", "mlp"],
        ["--offload-num-in-group", "2"],
        ["--offload-prefetch-step", "2"],
        ["--offload-params", "mlp"],
    ],
    "MultiModalConfig": [
        ["--mm-processor-cache-type", "shm"],
        ["--mm-shm-cache-max-object-size-mb", "64"],
        ["--mm-encoder-tp-mode", "data"],
        ["--mm-encoder-attn-backend", "TORCH_SDPA"],
        ["--mm-encoder-attn-dtype", "fp8"],
        ["--mm-encoder-fp8-scale-path", "/tmp/scales.json"],
        ["--mm-encoder-fp8-scale-save-path", "/tmp/scales.json"],
        ["--mm-encoder-fp8-scale-save-margin", "2"],
        ["--interleave-mm-strings"],
        ["--video-pruning-rate", "0.5"],
        ["--video-pruning-method", "vidcom2"],
        ["--mm-tensor-ipc", "torch_shm"],
    ],
    "LoRAConfig": [
        ["--enable-tower-connector-lora"],
        ["--default-mm-loras", '{"image": "/adapters/vision"}'],
        ["--specialize-active-lora"],
        ["--enable-mixed-moe-lora-format"],
        ["--enable-moe-shared-loras"],
    ],
    "SchedulerConfig": [["--disable-chunked-mm-input"]],
    "KernelConfig": [
        ["--enable-flashinfer-autotune"],
        ["--linear-backend", "marlin"],
    ],
}


@pytest.mark.parametrize("group", sorted(REFUSED_BY_GROUP))
def test_former_no_op_flags_refuse_other_values_and_say_why(usage_error, group: str) -> None:
    for argv in REFUSED_BY_GROUP[group]:
        name = argv[0].split(".")[0].replace("--no-", "--")
        flag = FLAGS[name]
        assert flag.group == group, name
        message = usage_error(*argv)
        assert message.startswith(f"sonar serve: {argv[0].split('.')[0]} is not supported yet"), message
        assert flag.why is not None and message.endswith(f": {flag.why}"), message


def test_refusal_text_reads_as_one_sentence(usage_error) -> None:
    assert usage_error("--all2all-backend", "naive") == (
        "sonar serve: --all2all-backend is not supported yet (got naive; Sonar accepts only "
        "allgather_reducescatter): Sonar's expert parallelism exchanges no tokens: every rank has every token "
        "(tensor parallelism replicates them) and the all-reduce that ends each MoE layer sums the ranks' experts"
    )


@pytest.mark.parametrize(
    "argv",
    [
        # Permissions Sonar never needs, and choices that ask for what Sonar always does.
        ["--trust-remote-code"],
        ["--allow-deprecated-quantization"],
        ["--aggregate-engine-logging"],
        ["--no-disable-cascade-attn"],
        ["--no-use-tqdm-on-load"],
        ["--disable-custom-all-reduce"],
        ["--no-enable-flashinfer-autotune"],
        ["--language-model-only"],
        ["--data-parallel-backend", "mp"],
        ["--all2all-backend", "allgather_reducescatter"],
    ],
)
def test_values_that_mean_what_sonar_does_are_accepted(argv: list[str]) -> None:
    parse_serve_args(argv)


def test_refused_values_are_still_validated(usage_error) -> None:
    assert "argument --all2all-backend: invalid choice: 'magic'" in usage_error("--all2all-backend", "magic")


@pytest.mark.parametrize(
    "argv",
    [
        ["--moe-backend", "triton"],
        ["--enable-return-routed-experts"],
    ],
)
def test_moe_kernel_choices_are_refused(usage_error, argv: list[str]) -> None:
    """Sonar serves MoE models (tensor- or expert-parallel experts, its own kernels): what would
    change that is refused by name, not accepted and ignored."""
    assert f"{argv[0]} is not supported yet" in usage_error(*argv)


def test_expert_load_balancing_reaches_the_engine() -> None:
    argv = ["-tp", "2", "-ep", "--enable-eplb", "--eplb-config.window_size", "500"]
    engine = parse_serve_args([*argv, "--eplb-config.num_redundant_experts", "2"]).engine
    assert engine.enable_eplb and engine.eplb_config == {"window_size": 500, "num_redundant_experts": 2}
    assert engine.eplb().step_interval == 3000  # the reference's default


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--enable-eplb"], "enable_eplb needs enable_expert_parallel (--enable-expert-parallel)"),
        (["-ep", "--enable-eplb"], "enable_eplb with tensor_parallel_size 1 is not supported"),
        (["--eplb-config.window_size", "500"], "eplb_config (window_size) is set but expert load balancing is off"),
        (["-tp", "2", "-ep", "--enable-eplb", "--eplb-config.use_async", "true"], "use_async true is not supported"),
        (["-tp", "2", "-ep", "--enable-eplb", "--eplb-config.policy", "x"], "policy 'x' is not supported"),
        (["-tp", "2", "-ep", "--enable-eplb", "--eplb-config.step_interval", "0"], "step_interval must be at least 1"),
    ],
)
def test_expert_load_balancing_settings_that_cannot_work_are_refused(
    usage_error, argv: list[str], expected: str
) -> None:
    assert expected in usage_error(*argv)


@pytest.mark.parametrize("flag", ["--enable-expert-parallel", "-ep"])
def test_expert_parallel_flags_reach_the_engine(flag: str) -> None:
    config = parse_serve_args(["-tp", "2", flag, "--expert-placement-strategy", "round_robin"])
    engine = config.engine
    assert (engine.enable_expert_parallel, engine.expert_placement_strategy) == (True, "round_robin")
    assert parse_serve_args([]).engine.enable_expert_parallel is False


def test_expert_parallel_over_data_parallel_replicas_alone_is_refused(usage_error) -> None:
    message = usage_error("-ep", "--data-parallel-size", "2")
    assert "data_parallel_size 2 and tensor_parallel_size 1 is not supported" in message


def test_the_expert_weight_filter_reaches_the_engine() -> None:
    config = parse_serve_args(["-tp", "2", "-ep", "--enable-ep-weight-filter"])
    assert config.engine.enable_ep_weight_filter


def test_status_counts_are_stable() -> None:
    counts = {status: sum(f.status is status for f in FLAGS.values()) for status in Status}
    assert counts[Status.IMPLEMENTED] >= 60
    assert sum(counts.values()) == len(FLAGS)


def test_lora_flags_reach_the_engine() -> None:
    config = parse_serve_args(
        [
            "--enable-lora",
            "--max-loras",
            "4",
            "--max-lora-rank",
            "32",
            "--max-cpu-loras",
            "8",
            "--lora-dtype",
            "float16",
            "--lora-target-modules",
            "qkv_proj",
            "down_proj",
            "--lora-modules",
            "a=/x",
            '{"name": "b", "path": "/y", "base_model_name": "m"}',
        ]
    )
    engine = config.engine
    assert (engine.enable_lora, engine.max_loras, engine.max_lora_rank, engine.max_cpu_loras) == (True, 4, 32, 8)
    assert engine.lora_dtype == "float16"
    assert engine.lora_target_modules == ["qkv_proj", "down_proj"]
    assert engine.lora_modules == ["a=/x", '{"name": "b", "path": "/y", "base_model_name": "m"}']
    limits = engine.lora_limits()
    assert limits.targets("q_proj") and limits.targets("down_proj") and not limits.targets("up_proj")
