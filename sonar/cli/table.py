"""Every documented `serve` flag: name, aliases, group, kind, default, choices, help, and what Sonar
does with it (see `sonar.cli.flags` for the three statuses).

Facts (names, groups, choices, defaults) follow the server-argument reference; help texts are
Sonar's own. `target` marks an implemented flag: E (engine) puts the value in `EngineConfig`,
S (serve) in `ServeConfig`, under the flag's name with underscores.
"""

from __future__ import annotations

from typing import Any

from sonar.cli.flags import Flag, Group, Kind
from sonar.cli.values import (
    eplb_config,
    fraction,
    logprobs_cap,
    non_negative,
    otlp_endpoint,
    port_number,
    positive,
    power_of_two,
    profiler_config,
    structured_outputs_config,
    watermark,
    weight_transfer_config,
)

B, I, F, S_, H, L, J = Kind.BOOL, Kind.INT, Kind.FLOAT, Kind.STR, Kind.HUMAN_INT, Kind.LIST, Kind.JSON
E, S = "engine", "serve"

#: --tool-call-parser's documented names (Sonar implements some; see `sonar.parsers.tools`).
TOOL_CALL_PARSER_NAMES = (
    "apertus", "cohere_command3", "cohere_command4", "deepseek_v3", "deepseek_v31", "deepseek_v32",
    "deepseek_v4", "ernie45", "functiongemma", "gemma4", "gigachat3", "glm45", "glm47", "granite",
    "granite-20b-fc", "granite4", "hermes", "hunyuan_a13b", "hy_v3", "inkling", "internlm", "jamba",
    "kimi_k2", "lfm2", "llama3_json", "llama4_json", "llama4_pythonic", "longcat", "mimo", "minicpm5",
    "minimax_m2", "minimax_m3", "mistral", "olmo3", "openai", "phi4_mini_json", "poolside_v1",
    "pythonic", "qwen3_coder", "qwen3_xml", "seed_oss", "step3", "step3p5", "xlam",
)  # fmt: skip

# Why Sonar refuses the other values of a default-only flag (the error and --help show it).
MULTI_PORT = "multi-port external load balancing is not supported yet"
NO_DCP = "decode context parallelism (--decode-context-parallel-size > 1) is not supported yet"
NO_ALL2ALL = (
    "Sonar's expert parallelism exchanges no tokens: every rank has every token (tensor parallelism "
    "replicates them) and the all-reduce that ends each MoE layer sums the ranks' experts"
)
NO_MOE_LORA = "LoRA adapters on mixture-of-experts models are not supported yet"
NO_DBO = "dual batch overlap (--enable-dbo) is not supported yet"
NO_MAMBA = "Sonar serves no Mamba, state-space or gated delta-net models yet"
NO_MM = (
    "Sonar preprocesses images in the API server (with one LRU cache, --mm-processor-cache-gb), with no "
    "shared-memory cache, no separate encoder process and no video or audio; this setting is not supported yet"
)
NO_POOLING = "late-interaction (multi-vector, ColBERT-style) models are not supported yet"
NO_PREFETCH = "Sonar does not prefetch checkpoint files (--safetensors-load-strategy prefetch is not supported yet)"
NO_WEIGHT_OFFLOAD = "weight offloading (--cpu-offload-gb / --offload-group-size) is not supported yet"


def _f(names: str, kind: Kind, default: Any, help: str, **kw: Any) -> dict[str, Any]:
    name, *aliases = names.split()
    target = kw.pop("to", kw.pop("target", None))
    if target in (E, S):
        target = f"{target}.{name.lstrip('-').replace('-', '_')}"
    if "choices" in kw and kw["choices"] is not None:
        kw["choices"] = tuple(kw["choices"])
    return dict(name=name, aliases=tuple(aliases), kind=kind, default=default, help=help, target=target, **kw)


def _group(name: str, description: str, *specs: dict[str, Any]) -> Group:
    return Group(name, description, tuple(Flag(group=name, **spec) for spec in specs))


# The rows are laid out by hand, one flag per call, so the table stays a thousand readable lines.
# fmt: off
GROUPS: tuple[Group, ...] = (
    _group(
        "options", "Top-level options of `sonar serve`.",
        _f("--help -h", Kind.HELP, None,
           "Print help and exit. --help lists the groups; --help=NAME shows the flags and groups whose "
           "name contains NAME (e.g. --help=max-model-len, --help=CacheConfig, --help=prefix); "
           "--help=all prints every flag.", target="help", metavar="[=NAME]"),
        _f("--headless", B, False,
           "Run no API server: this node only runs its share of the tensor-parallel ranks (--node-rank "
           "1 .. --nnodes - 1) or of the data-parallel replicas (--data-parallel-start-rank 1 or more), which "
           "the head starts and supervises.", negatable=False, to=S),
        _f("--api-server-count -asc", I, None,
           "How many API server processes to run over the one engine, sharing the listening port "
           "(sonar.http.api_servers); unset means one.", to=S, check=positive),
        _f("--config", S_, None,
           "Read flag values from a YAML file whose keys are flag names (dashes or underscores, e.g. "
           "max-num-seqs: 64). Flags on the command line take precedence over the file.",
           target="config", metavar="FILE"),
        _f("--grpc", B, False, "Serve a gRPC API instead of the OpenAI-compatible HTTP API.", negatable=False),
        _f("--disable-log-stats", B, False, "Stop the periodic engine statistics log lines.",
           negatable=False, to=S),
        _f("--aggregate-engine-logging", B, False,
           "With data parallelism, log statistics summed over all engines rather than per engine.",
           negatable=False, accepts=(True,),
           why="Sonar logs one statistics line summed over its data-parallel replicas, never one per replica"),
        _f("--fail-on-environ-validation", B, False,
           "Refuse to start, instead of warning, when a SONAR_ environment variable is set that Sonar "
           "does not read (most likely a misspelling).", to=S),
        _f("--shutdown-timeout", F, 0.0,
           "On shutdown, seconds to let in-flight requests finish; 0 aborts them right away.",
           to=S, check=non_negative),
        _f("--gdn-prefill-backend", S_, None, "Kernels used for the prefill of gated delta-net layers.",
           choices=("flashinfer", "triton", "cutedsl"), why=NO_MAMBA),
        _f("--enable-log-requests", B, False,
           "Log every incoming request: its id and sampling settings, and at debug level its prompt too.",
           to=S),
    ),
    _group(
        "Frontend", "The OpenAI-compatible HTTP server: address, TLS, CORS, auth, logging and response extras.",
        _f("--lora-modules", L, None,
           "LoRA adapters to serve, each as name=path or as a JSON object with name, path and "
           "base_model_name (needs --enable-lora).", extend=True, to=E),
        _f("--chat-template", S_, None,
           "Chat template to render conversations with: a file path, or the template itself on one "
           "line. Unset: the tokenizer's own template.", to=S),
        _f("--chat-template-content-format", S_, "auto",
           "How message content reaches the chat template: 'string' flattens it to text, 'openai' passes "
           "the list of typed parts, 'auto' detects what the template expects.",
           choices=("auto", "openai", "string"), to=S),
        _f("--trust-request-chat-template", B, False,
           "Let a request supply its own chat template; otherwise only the server's template is used."),
        _f("--default-chat-template-kwargs", J, None,
           "Extra variables handed to the chat template on every request: a JSON object, or one key at "
           "a time as --default-chat-template-kwargs.KEY VALUE. A request's chat_template_kwargs win.",
           dotted=True, to=S),
        _f("--response-role", S_, "assistant",
           "Role name of the generated message when a chat request asks for the generation prompt.", to=S),
        _f("--return-tokens-as-token-ids", B, False,
           "Write logprob tokens as 'token_id:<id>' instead of their text, so that tokens which are not "
           "valid text stay distinguishable.", to=S),
        _f("--enable-auto-tool-choice", B, False,
           "Let the model decide by itself to call tools (tool_choice 'auto', the default when a request "
           "has tools): its output is parsed with --tool-call-parser, which is required.", to=S),
        _f("--exclude-tools-when-tool-choice-none", B, False,
           "Leave the tool definitions out of the prompt when a request sets tool_choice to 'none'.", to=S),
        _f("--tool-call-parser", S_, None,
           "Parser that turns the model's tool-call text into OpenAI tool calls (with "
           "--enable-auto-tool-choice); choose the one made for the model family. Sonar implements "
           "hermes (Qwen2.5, Qwen3, Hermes), llama3_json (Llama 3.x), mistral, pythonic (Llama 3.2, "
           "Llama 4) and qwen3_xml (Qwen3-Coder), or a name a --tool-parser-plugin registers.",
           metavar="NAME", to=S),
        _f("--tool-parser-plugin", S_, "",
           "Python file that registers additional tool-call parsers by name. It is the operator's own "
           "code: it runs at startup with the server's rights.", metavar="FILE", to=S),
        _f("--tool-server", S_, None,
           "Tool servers the model may use while generating: comma-separated host:port addresses, or "
           "'demo' for the built-in demo tools."),
        _f("--log-config-file", S_, None,
           "A JSON file in Python's logging dictConfig format, applied to Sonar's loggers ('sonar', "
           "'sonar.http', 'sonar.scheduler', ...) and uvicorn's ('uvicorn', 'uvicorn.access', "
           "'uvicorn.error'), in the server and in its worker processes.",
           metavar="FILE", to=S),
        _f("--max-log-len", I, None,
           "Truncate logged prompts to this many characters or token ids; unset logs them whole.",
           to=S, check=non_negative),
        _f("--enable-prompt-tokens-details", B, False,
           "Include prompt_tokens_details (such as cached prompt tokens) in the usage block.", to=S),
        _f("--enable-per-request-metrics", B, False,
           "Add a 'metrics' object to single-prompt, single-choice completion and chat responses (on a "
           "stream: the final usage chunk): queue time, time to first token, generation time, mean "
           "inter-token latency and tokens per second.", to=S),
        _f("--enable-server-load-tracking", B, True,
           "Count the requests to the generation routes in flight and report them at GET /load, for "
           "load-aware routing; --no-enable-server-load-tracking drops the counter and the route.",
           to=S, reference_default=False,
           default_note="True (the reference server's is False; the count costs nothing measurable)"),
        _f("--enable-force-include-usage", B, False,
           "Report token usage on every response, also on streams that did not ask for it.", to=S),
        _f("--enable-tokenizer-info-endpoint", B, False,
           "Serve /tokenizer_info. It reveals the tokenizer configuration, chat template included.", to=S),
        _f("--enable-log-outputs", B, False,
           "Also log what the model generated; only has an effect together with --enable-log-requests.",
           to=S),
        _f("--enable-log-deltas", B, True,
           "When outputs are logged, log each streamed piece as well; switch off to log only final outputs.",
           to=S),
        _f("--log-error-stack", B, False,
           "Log the traceback behind each error response (a 4xx refusal too), as a request.error line.",
           to=S),
        _f("--tokens-only", B, False,
           "Serve only the token-in/token-out endpoint (for fully disaggregated deployments)."),
        _f("--fingerprint-mode", S_, "full",
           "What responses put in system_fingerprint: 'full' (version, parallelism and a config hash), "
           "'hash' (version and hash), 'custom' (the text of --fingerprint-value) or 'none' (null).",
           choices=("custom", "full", "hash", "none"), to=S),
        _f("--fingerprint-value", S_, None, "The system_fingerprint text used with --fingerprint-mode custom.",
           to=S),
        _f("--host", S_, None, "Address to listen on; unset listens on all interfaces.", to=S),
        _f("--port", I, 2242, "TCP port to listen on.", to=S, check=port_number),
        _f("--data-parallel-supervisor-port", I, 9256,
           "Port of the combined health endpoint in multi-port external load balancing.", why=MULTI_PORT),
        _f("--dp-supervisor-probe-interval-s", F, 5.0,
           "Seconds between health probes of the per-rank servers (multi-port external load balancing).",
           why=MULTI_PORT),
        _f("--dp-supervisor-probe-timeout-s", F, 5.0,
           "Seconds before retrying a health probe that could not connect (multi-port external load "
           "balancing).", why=MULTI_PORT),
        _f("--dp-supervisor-probe-failure-threshold", I, 3,
           "Connection failures in a row after which a per-rank server counts as down (multi-port "
           "external load balancing).", why=MULTI_PORT),
        _f("--uds", S_, None, "Listen on this Unix domain socket; --host and --port are then ignored.", to=S),
        _f("--uvicorn-log-level", S_, "info", "Log level of the uvicorn HTTP server.",
           choices=("critical", "debug", "error", "info", "trace", "warning"), to=S),
        _f("--disable-uvicorn-access-log", B, False, "Turn off uvicorn's per-request access log.", to=S),
        _f("--disable-access-log-for-endpoints", S_, None,
           "Comma-separated request paths kept out of the access log, e.g. /health,/metrics.", to=S),
        _f("--allow-credentials", B, False,
           "CORS: allow credentials (cookies, authorization headers) on cross-origin requests.", to=S),
        _f("--allowed-origins", L, ("*",), "CORS: origins that may call the API.", to=S),
        _f("--allowed-methods", L, ("*",), "CORS: HTTP methods allowed on cross-origin requests.", to=S),
        _f("--allowed-headers", L, ("*",), "CORS: request headers allowed on cross-origin requests.", to=S),
        _f("--api-key", L, None,
           "Only answer clients that send one of these keys as a bearer token.", to=S),
        _f("--ssl-keyfile", S_, None, "Private key file for HTTPS.", to=S),
        _f("--ssl-certfile", S_, None, "Certificate file for HTTPS.", to=S),
        _f("--ssl-ca-certs", S_, None, "CA certificates used to verify client certificates.", to=S),
        _f("--enable-ssl-refresh", B, False,
           "Reload the TLS certificate and key (and CA certificates) when their files change; new "
           "connections get the new ones (needs --ssl-keyfile and --ssl-certfile).", to=S),
        _f("--ssl-cert-reqs", I, 0,
           "Whether clients must show a certificate, as Python's ssl.CERT_* number: 0 no, 1 optional, "
           "2 required.", choices=(0, 1, 2), to=S),
        _f("--ssl-ciphers", S_, None, "TLS cipher suites to allow (OpenSSL list syntax; TLS 1.2 and older)."),
        _f("--root-path", S_, None, "Path prefix under which a path-routing proxy exposes this server.", to=S),
        _f("--middleware", L, (),
           "Import path (module:attr or module.attr) of an extra ASGI middleware: a class is added "
           "with app.add_middleware, a function as an HTTP middleware (async (request, call_next)); "
           "repeat the flag to add several.", extend=True, to=S),
        _f("--enable-request-id-headers", B, False, "Add an X-Request-Id header to every response.", to=S),
        _f("--disable-fastapi-docs", B, False,
           "Turn off the OpenAPI schema (/openapi.json). Sonar serves no interactive documentation pages.",
           to=S),
        _f("--h11-max-incomplete-event-size", I, 4194304,
           "Most bytes of an unfinished HTTP event (headers or body part) the h11 parser buffers; "
           "guards against oversized headers.", to=S, check=positive),
        _f("--h11-max-header-count", I, 256,
           "Most headers a request may carry; a request with more gets 431.", to=S, check=positive),
        _f("--enable-offline-docs", B, False,
           "Serve the API documentation pages from bundled files, for machines without internet access.",
           why="Sonar serves no documentation pages, only /openapi.json"),
        _f("--enable-flash-late-interaction", B, True,
           "Compute late-interaction (MaxSim) scores of pooling models on the GPU in the API server.",
           why=NO_POOLING),
    ),
    _group(
        "ModelConfig", "Which model to serve and how to read it: tokenizer, dtype, context length, names.",
        _f("--model", S_, None,
           "Model to serve: a Hugging Face repo id or a local path (a directory with config.json and "
           "safetensors, or a .gguf file). May also be given as the first positional argument.",
           target="model", reference_default="Qwen/Qwen3-0.6B",
           default_note="the embedded SmolLM2-135M-Instruct, so Sonar serves without hub access"),
        _f("--runner", S_, "auto",
           "Kind of model runner: 'generate' (text generation), 'pooling' (embeddings, scores), 'draft' "
           "(a speculative draft model), or 'auto' to decide from the model.",
           choices=("auto", "draft", "generate", "pooling"), to=E),
        _f("--convert", S_, "auto",
           "Adapt the model to another task, e.g. serve a generative model as an embedding ('embed'), "
           "classification ('classify') or per-token reward ('reward') model; 'none' keeps it as is.",
           # reward: vLLM's, which the reference's choices lack (docs/pooling.md)
           choices=("auto", "classify", "embed", "none", "reward"), to=E),
        _f("--tokenizer", S_, None, "Tokenizer to use (repo id or path); unset uses the model's own.", to=E),
        _f("--tokenizer-mode", S_, "auto",
           "Tokenizer implementation: 'hf' (fast Hugging Face tokenizer), 'slow', 'mistral' "
           "(mistral_common), a model-specific one, or 'auto' to pick per model. Sonar always uses the fast "
           "Hugging Face tokenizer.",
           choices=("auto", "deepseek_v32", "deepseek_v4", "hf", "inkling", "mistral", "slow"),
           accepts=("hf",), metavar="{auto,deepseek_v32,deepseek_v4,hf,inkling,mistral,slow}"),
        _f("--trust-remote-code", B, False,
           "Allow running Python code that ships inside a model or tokenizer repository.",
           accepts=(True,),
           why="Sonar runs only its own model code: it never imports the Python files of a model repository "
                "(a config's auto_map is not followed), so the permission is never used"),
        _f("--dtype", S_, "auto",
           "Precision of weights and activations. 'auto' keeps a bfloat16 checkpoint in bfloat16 and "
           "runs others in float16 (bfloat16 on CPU; float32 on a CPU without bfloat16 instructions, where "
           "bfloat16 is emulated); 'half' is float16 and 'float' is float32.",
           choices=("auto", "bfloat16", "float", "float16", "float32", "half"),
           value_aliases={"half": "float16", "float": "float32"}, to=E),
        _f("--seed", I, 0, "Seed for the random number generators, for reproducible sampling.", to=E),
        _f("--hf-config-path", S_, None, "Read the model config from this repo id or path instead."),
        _f("--allowed-local-media-path", S_, "",
           "Directory under which requests may read local images with file:// URLs (a risk on shared "
           "machines); empty: no file:// URLs.", to=S),
        _f("--allowed-media-domains", L, None,
           "Hosts from which http(s) image URLs are fetched; unset: Sonar fetches no image URLs at all "
           "(data: URLs always work).", to=S),
        _f("--revision", S_, None, "Branch, tag or commit of the model repository to load.", to=E),
        _f("--code-revision", S_, None, "Revision of the Python code inside the model repository.",
           why="Sonar never runs code from model repositories"),
        _f("--tokenizer-revision", S_, None,
           "Branch, tag or commit of the tokenizer repository (--tokenizer, else the model's), downloaded with "
           "its tokenizer files only.", to=E),
        _f("--max-model-len", Kind.MODEL_LEN, None,
           "Longest context (prompt plus output) in tokens. Takes 4096, 32k (32000), 32K (32768) or 25.6k; "
           "'auto' or -1 picks the model's own limit when its KV cache fits in memory, else the longest "
           "length that fits.", to=E, default_note="the model's own context length"),
        _f("--quantization -q", S_, None,
           "Quantization method of the weights; unset reads it from the model's config (a GGUF file is "
           "'gguf'). 'fp8' on an unquantized checkpoint quantizes its linear weights to FP8 per output "
           "channel at load.", to=E,
           supported=("gguf", "fp8", "gptq", "awq", "compressed-tensors", "mxfp4")),
        _f("--dequantize-weights", B, False,
           "Sonar's addition: serve a quantized checkpoint (GGUF, GPTQ, AWQ, FP8, compressed-tensors, MXFP4) "
           "dequantized to --dtype: the reference path, with more memory and a slower decode.", to=E),
        _f("--quantization-config", J, None,
           "Detailed quantization settings (per kind of layer, ignore patterns).", dotted=True),
        _f("--allow-deprecated-quantization", B, False, "Permit quantization methods that are deprecated.",
           accepts=(True,), why="none of the quantization methods Sonar implements is deprecated, so the permission is never needed"),
        _f("--enforce-eager", B, False,
           "Always run the model as plain eager PyTorch, without CUDA graphs and (on CPU) without prepacking "
           "the linear weights for oneDNN: faster startup, slower decode.", to=E),
        _f("--enable-return-routed-experts", B, False,
           "Return which experts each token was routed to in MoE models."),
        _f("--max-logprobs", I, 20,
           "Most logprobs a request may ask for per token (20, as in the OpenAI API); -1 lifts the cap "
           "(up to the vocabulary size), which can run out of memory.", to=E, check=logprobs_cap),
        _f("--logprobs-mode", S_, "raw_logprobs",
           "What logprobs contain: log-probabilities or logits, either raw (as the model produced them) or "
           "processed (after penalties, temperature, top-k/top-p). Sonar returns raw log-probabilities.",
           choices=("processed_logits", "processed_logprobs", "raw_logits", "raw_logprobs")),
        _f("--use-fp64-gumbel", B, False,
           "Draw the sampling noise in float64 instead of float32, so very unlikely tokens stay reachable; "
           "costs throughput."),
        _f("--disable-sliding-window", B, False,
           "Ignore the model's sliding-window attention and cap the context at the window size."),
        _f("--disable-cascade-attn", B, True,
           "Keep cascade attention (a shared-prefix optimisation) off; --no-disable-cascade-attn lets the "
           "engine use it where it expects a gain.",
           accepts=(False,), why="Sonar has no cascade attention, so it stays off, which either value allows"),
        _f("--skip-tokenizer-init", B, False,
           "Load no tokenizer or detokenizer; requests then send token ids and get token ids back."),
        _f("--enable-prompt-embeds", B, False,
           "Accept completion prompts as their input embeddings (prompt_embeds: base64 of a torch-saved "
           "float tensor [tokens, hidden size], read with weights_only and checked for shape, dtype and "
           "finite values).", to=E),
        _f("--served-model-name", L, None,
           "Names under which clients address the model; the first is the one reported in responses and "
           "metrics.", to=S, default_note="the --model value"),
        _f("--config-format", S_, "auto",
           "Format of the model config: 'hf' (config.json), 'mistral' (params.json) or 'auto'.",
           choices=("auto", "hf", "mistral"), accepts=("hf",), metavar="{auto,hf,mistral}"),
        _f("--hf-token", S_, None,
           "Token for downloads from the Hugging Face Hub (gated or private models); unset: HF_TOKEN, else "
           "the token of 'hf auth login'.", to=E),
        _f("--hf-overrides", J, {}, "JSON object of values that replace fields of the model's Hugging Face config.",
           to=E),
        _f("--model-class-overrides", J, {},
           "Map architecture names to 'module:Class' implementations to use instead (for development).",
           dotted=True),
        _f("--pooler-config", J, None,
           "How a pooling model pools: JSON with pooling_type (LAST, MEAN, CLS, ALL), normalize, dimensions "
           "(the default of embedding requests) and use_activation (softmax / sigmoid of classifiers).",
           dotted=True, to=E),
        _f("--generation-config", S_, "auto",
           "Where default sampling settings come from: 'auto' reads generation_config.json of the model, a "
           "folder path reads it from there, 'sonar' (also spelled 'aphrodite') uses none. A max_new_tokens "
           "found there caps the output of every request.",
           value_aliases={"aphrodite": "sonar"}, to=S),
        _f("--override-generation-config", J, {},
           "Sampling defaults to set, as JSON ('{\"temperature\": 0.5}') or one key at a time "
           "(--override-generation-config.temperature 0.5). With --generation-config auto they are merged "
           "over the model's; with 'sonar' they are used alone.", dotted=True, to=S),
        _f("--enable-sleep-mode", B, False,
           "Allow putting the engine to sleep and waking it again (POST /sleep?level=1|2, /wake_up, GET "
           "/is_sleeping): level 1 frees the KV cache and moves the weights to host memory (on the CPU they "
           "stay), level 2 drops the weights too, to be read again from the checkpoint on wake-up.", to=E),
        _f("--enable-cumem-allocator", B, False,
           "Allocate GPU memory through the cumem allocator (sleep mode needs it; enables multi-node NVLink)."),
        _f("--model-impl", S_, "auto",
           "Whose model code to run: the server's own ('aphrodite' in the reference, Sonar's native models "
           "here), Transformers', TerraTorch's, or 'auto' (native when there is one).",
           choices=("aphrodite", "auto", "terratorch", "transformers"), accepts=("aphrodite",),
           metavar="{aphrodite,auto,terratorch,transformers}"),
        _f("--override-attention-dtype", S_, None, "Run attention in this dtype instead of the model's."),
        _f("--logits-processors", L, None,
           "Logits processor classes to load in the worker, by fully qualified name (module.Class or "
           "module:Class); each sees every step's logits before sampling, and a request's vllm_xargs "
           "as its SamplingParams.extra_args (`sonar.engine.logits_processors`).", to=E),
        _f("--io-processor-plugin", S_, None, "Name of an IOProcessor plugin to load at startup."),
        _f("--renderer-num-workers", I, 1,
           "Threads that tokenize prompts and render chat templates for the API server."),
    ),
    _group(
        "LoadConfig", "How model weights are found, downloaded and read.",
        _f("--load-format", S_, "auto",
           "Weight format: 'auto' (safetensors, else PyTorch .bin, else what the model directory holds), "
           "'safetensors', 'pt' (PyTorch .bin, read with torch.load(weights_only=True)), 'gguf', 'dummy' "
           "(random weights from the config alone, for profiling) or 'runai_streamer' (safetensors shards "
           "read by a pool of threads; --model-loader-extra-config '{\"concurrency\": N}', default 8). A hub "
           "model downloads only its format's weights. The other documented formats are known but not "
           "supported yet.",
           choices=("auto", "pt", "safetensors", "instanttensor", "npcache", "dummy", "tensorizer",
                    "runai_streamer", "runai_streamer_sharded", "bitsandbytes", "sharded_state", "mistral",
                    "modelexpress", "gguf"),
           supported=("auto", "safetensors", "pt", "gguf", "dummy", "runai_streamer"), to=E),
        _f("--download-dir", S_, None,
           "The Hugging Face cache a hub model is looked for in and downloaded to; unset: HF_HUB_CACHE "
           "(~/.cache/huggingface/hub). HF_HUB_OFFLINE=1 forbids downloading.", to=E),
        _f("--safetensors-load-strategy", S_, None,
           "How safetensors files are read: memory-mapped on demand ('lazy'), read whole up front ('eager', "
           "good on network file systems), pulled into the page cache first ('prefetch'), or rebuilt as "
           "torchao tensors ('torchao'). Unset: memory-mapped, prefetching on NFS when it fits in RAM.",
           choices=("eager", "lazy", "prefetch", "torchao", None), supported=("eager", "lazy"), to=E),
        _f("--safetensors-prefetch-num-threads", I, 8,
           "Threads that prefetch safetensors files into the page cache.", why=NO_PREFETCH),
        _f("--safetensors-prefetch-block-size", H, 16777216,
           "Bytes read per prefetch request; takes 16M, 16m and the like.", why=NO_PREFETCH),
        _f("--model-loader-extra-config", J, {},
           "Extra settings for the loader of the chosen --load-format: 'concurrency' (reader threads) for "
           "runai_streamer; any other setting is refused.", to=E),
        _f("--ignore-patterns", L, ("original/**/*",),
           "File patterns (globs relative to the model folder) neither downloaded from the hub nor read as "
           "weights.", to=E),
        _f("--use-tqdm-on-load", B, True, "Show a progress bar while weights load.",
           accepts=(False,), why="Sonar shows no progress bar while loading; it logs one line per phase"),
        _f("--pt-load-map-location", S_, "cpu",
           "Device mapping for reading PyTorch checkpoints, e.g. 'cuda' or a JSON object such as "
           "'{\"cuda:1\": \"cuda:0\"}'."),
    ),
    _group(
        "AttentionConfig", "Choice of attention kernels.",
        _f("--attention-backend", S_, None, "Attention kernel backend; unset or 'auto' chooses automatically.",
           accepts=("auto",)),
    ),
    _group(
        "MambaConfig", "Kernels and numerics of Mamba (state-space) layers.",
        _f("--mamba-backend", S_, "triton", "Kernel backend for Mamba state-space layers.", why=NO_MAMBA,
           reference_default="MambaBackendEnum.TRITON"),
        _f("--enable-mamba-cache-stochastic-rounding", B, False,
           "Round SSM state stochastically when storing it in a float16 cache, removing the rounding bias "
           "over long sequences.", why=NO_MAMBA),
        _f("--mamba-cache-philox-rounds", I, 0,
           "Philox rounds for the random bits of stochastic rounding; 0 keeps Triton's default.",
           why=NO_MAMBA),
    ),
    _group(
        "StructuredOutputsConfig", "Structured outputs and reasoning parsers.",
        _f("--reasoning-parser", S_, "",
           "Parser that separates a reasoning model's thinking (reasoning_content) from its answer: "
           "deepseek_r1, qwen3, granite, or a name a --reasoning-parser-plugin registers. Structured "
           "outputs (and tool_choice required or named) then constrain only the answer, after the "
           "thinking ends (see --structured-outputs-config.enable_in_reasoning).",
           metavar="NAME", to=S),
        _f("--reasoning-parser-plugin", S_, "",
           "Python file that registers additional reasoning parsers. It is the operator's own code: it "
           "runs at startup with the server's rights.", metavar="FILE", to=S),
    ),
    _group(
        "ParallelConfig", "Spreading one model over several devices, processes or nodes.",
        _f("--distributed-executor-backend", S_, None,
           "How model workers are started: 'uni' (one worker, placed by --placement), 'mp' (one process "
           "per rank on this machine), 'ray' (each rank's process kept by a Ray actor in one placement "
           "group, a CPU or GPU bundle per rank, on RAY_ADDRESS's cluster, else the one `ray start` "
           "began here, else a local Ray runtime; needs pip install sonar[ray]) or 'external_launcher' "
           "(torchrun starts the ranks, each running the library, sonar.open, in its script: refused by sonar serve).",
           choices=("external_launcher", "mp", "ray", "uni"), to=E, default_note="'uni' for one rank, 'mp' for several",
           metavar="{external_launcher,mp,ray,uni}"),
        _f("--pipeline-parallel-size -pp", I, 1,
           "Number of pipeline stages the layers are split into: consecutive layers per stage (an even "
           "split; SONAR_PP_LAYER_PARTITION=8,8,7,7 sets the counts), each stage its own worker processes "
           "(--tensor-parallel-size of them), hidden states passed on point to point.", to=E),
        _f("--master-addr", S_, "127.0.0.1",
           "Address of the first node (the head) in a multi-node 'mp' deployment: torch's rendezvous store "
           "listens there, where the other nodes report.", to=E),
        _f("--master-port", I, 29501,
           "Port of the head's rendezvous store; a headless node's rank R listens on --master-port + R "
           "(its actor host, authenticated with --actor-keys).", to=E),
        _f("--nnodes -n", I, 1,
           "Number of nodes the tensor-parallel ranks are split over, evenly and in order (--actor-keys "
           "on every node; the others run --headless).", to=E),
        _f("--node-rank -r", I, 0,
           "Rank of this node: 0 is the head (API server, scheduler, rank 0), the others run --headless.",
           to=E),
        _f("--distributed-timeout-seconds", I, None,
           "Timeout of torch.distributed operations such as creating the process groups (the "
           "tensor-parallel group's rendezvous and collectives).", to=E, default_note="torch's default"),
        _f("--cpu-distributed-timeout-seconds", I, None,
           "Timeout of the CPU (gloo) process groups; unset: --distributed-timeout-seconds.", to=E,
           default_note="torch's default"),
        _f("--numa-bind", B, False, "Pin each GPU worker to the CPUs and memory of its GPU's NUMA node."),
        _f("--numa-bind-nodes", Kind.INT_LIST, None, "NUMA node for each visible GPU, e.g. 0 0 1 1.",
           why="only used with --numa-bind, which Sonar does not support yet"),
        _f("--numa-bind-cpus", L, None, "CPU list for each visible GPU (numactl syntax such as 0-3).",
           why="only used with --numa-bind, which Sonar does not support yet"),
        _f("--device-ids", S_, None,
           "Comma-separated GPU indices or UUIDs to use, instead of setting CUDA_VISIBLE_DEVICES. Sonar "
           "serves from one device: it takes one index (SONAR_DEVICE=cpu|cuda|cuda:N overrides the choice).",
           to=E, default_note="CUDA device 0 when torch sees one, else the CPU"),
        _f("--tensor-parallel-size -tp", I, 1,
           "Number of ranks each layer's weights are split across: one worker process per rank (a GPU "
           "each, or on the CPU a share of the cores), in a torch.distributed group (NCCL, gloo on the CPU). "
           "Attention heads, the intermediate size and KV heads (or ranks, when there are fewer KV heads) "
           "must divide evenly; quantized weights split as they are (act-order GPTQ needs --dequantize-weights).",
           to=E),
        _f("--decode-context-parallel-size -dcp", I, 1,
           "Number of ranks sharing the decode KV cache (reusing tensor-parallel ranks)."),
        _f("--dcp-comm-backend", S_, "ag_rs",
           "Collectives of decode context parallelism: all-gather plus reduce-scatter ('ag_rs') or "
           "all-to-all ('a2a').", choices=("a2a", "ag_rs"), why=NO_DCP),
        _f("--dcp-kv-cache-interleave-size", I, 1, "Former name of --cp-kv-cache-interleave-size.",
           why=NO_DCP),
        _f("--cp-kv-cache-interleave-size", I, 1,
           "Tokens stored on one context-parallel rank before moving to the next (1: token by token; the "
           "block size: block by block).", why=NO_DCP),
        _f("--prefill-context-parallel-size -pcp", I, 1, "Number of ranks that split the work of one prefill."),
        _f("--data-parallel-size -dp", I, 1,
           "Number of engine replicas (data-parallel ranks), each with its own worker process, "
           "scheduler and KV cache; a request goes to the replica holding the longest cached prefix of its "
           "prompt, else the least loaded (see --data-parallel-routing). On a CPU each replica computes on its "
           "share of the cores. The replicas share the KV memory budget (--kv-cache-memory-bytes, "
           "--gpu-memory-utilization, or the CPU default), so N replicas use no more KV memory than one.",
           to=E, check=positive),
        _f("--data-parallel-rank -dpn", I, None,
           "This instance's data-parallel rank; setting it selects external load balancing."),
        _f("--data-parallel-start-rank -dpr", I, None,
           "First data-parallel replica of this node: 0 on the head, the first of its own on a --headless "
           "node (which runs --data-parallel-start-rank .. + --data-parallel-size-local - 1).",
           to=E, default_note="0", check=non_negative),
        _f("--data-parallel-size-local -dpl", I, None,
           "Data-parallel replicas on this node. Fewer than --data-parallel-size puts the others on --headless "
           "nodes, which meet the head at --data-parallel-address:--data-parallel-rpc-port (--actor-keys on "
           "every node).", to=E, default_note="--data-parallel-size", check=positive),
        _f("--data-parallel-address -dpa", S_, None,
           "Address of the head node when the replicas span several nodes: its rendezvous store listens "
           "there, where the headless nodes report.", to=E),
        _f("--data-parallel-rpc-port -dpp", I, None,
           "Port of the head's rendezvous store when the replicas span several nodes; rank K of a headless "
           "node's replica R listens on --data-parallel-rpc-port + R x (--tensor-parallel-size x "
           "--pipeline-parallel-size) + K (that rank's actor host, authenticated with --actor-keys; one rank: "
           "+ R), up to 65535.", to=E, check=port_number),
        _f("--data-parallel-backend -dpb", S_, "mp",
           "How data-parallel replicas' workers are started: 'mp' (processes of this machine and, with "
           "--data-parallel-size-local, the actor hosts of `sonar serve --headless` nodes) or 'ray' (Ray places "
           "each replica's worker, or each of its ranks, over the cluster's nodes, as --distributed-executor-backend "
           "ray does for one replica; a replica on another Ray node reaches this server's scheduler over tcp with "
           "--actor-keys, copied to every node; no --headless nodes; needs pip install sonar[ray]).",
           choices=("mp", "ray"), to=E),
        _f("--data-parallel-hybrid-lb -dph", B, False,
           "Hybrid load balancing: the server balances the ranks of its node, an outside balancer the nodes."),
        _f("--data-parallel-external-lb -dpe", B, False,
           "External load balancing: one API server per data-parallel rank, balanced from outside."),
        _f("--data-parallel-multi-port-external-lb -dpm", B, False,
           "Start one externally balanced API server per local rank, under a supervisor that reports "
           "their combined health.", negatable=False),
        _f("--enable-expert-parallel -ep", B, False,
           "Deal each MoE layer's experts, whole, over the tensor-parallel ranks (E / --tensor-parallel-size "
           "each, see --expert-placement-strategy) instead of slicing every expert; attention and shared "
           "experts stay tensor-parallel. The expert-parallel size is --tensor-parallel-size: data-parallel "
           "replicas are independent engines holding every expert (with --data-parallel-size > 1 and "
           "--tensor-parallel-size 1 it is refused). No effect on dense models.", to=E),
        _f("--enable-ep-weight-filter", B, False,
           "With expert parallelism, do not read other ranks' per-expert tensors from safetensors files "
           "(memory-mapped reads, --safetensors-load-strategy lazy; a checkpoint of stacked experts is read "
           "whole). Without it each rank still copies only its own experts.", to=E),
        _f("--all2all-backend", S_, "allgather_reducescatter",
           "All-to-all implementation for expert-parallel MoE communication.",
           choices=("allgather_reducescatter", "deepep_high_throughput", "deepep_low_latency", "deepep_v2",
                    "flashinfer_all2allv", "flashinfer_nvlink_one_sided", "flashinfer_nvlink_two_sided",
                    "mori_high_throughput", "mori_low_latency", "naive", "nixl_ep", "pplx"),
           why=NO_ALL2ALL),
        _f("--enable-dbo", B, False,
           "Dual batch overlap: run a batch as two micro-batches so compute overlaps communication."),
        _f("--ubatch-size", I, 0, "Micro-batch size for dual batch overlap.", why=NO_DBO),
        _f("--enable-elastic-ep", B, False,
           "Elastic expert parallelism whose data/expert-parallel groups can grow and shrink."),
        _f("--dbo-decode-token-threshold", I, 32,
           "Decode-only batches above this many tokens are split into micro-batches.", why=NO_DBO),
        _f("--dbo-prefill-token-threshold", I, 512,
           "Batches with prefills above this many tokens are split into micro-batches.", why=NO_DBO),
        _f("--disable-nccl-for-dp-synchronization", B, None,
           "Synchronize data-parallel ranks over Gloo rather than NCCL (unset: on with async scheduling).",
           why="Sonar's data-parallel replicas step on their own and never synchronize, so there is no backend "
               "to choose"),
        _f("--enable-eplb", B, False,
           "Expert load balancing: count the tokens routed to each expert of every MoE layer and, every "
           "step_interval steps, re-place the experts over the expert-parallel ranks (with replicas of the "
           "hottest) so each rank computes about as much; the outputs do not change. Needs "
           "--enable-expert-parallel and --tensor-parallel-size > 1.", to=E),
        _f("--eplb-config", J, {},
           "Settings of expert load balancing, as JSON or one key at a time (--eplb-config.window_size 500): "
           "window_size (steps of load counted, 1000), step_interval (steps between rebalances, 3000), "
           "num_redundant_experts (replica slots per layer over all ranks, 0; experts plus these must divide "
           "over the ranks), log_balancedness (false), log_balancedness_interval (1), policy ('default' only), "
           "use_async (false: the weights move between two steps; true is refused), communicator (unset: "
           "torch.distributed over the tensor-parallel group). Needs --enable-eplb.",
           dotted=True, to=E, check=eplb_config,
           reference_default="EPLBConfig(...) with every field at its default"),
        _f("--expert-placement-strategy", S_, "linear",
           "How experts are dealt to ranks: in contiguous ranges ('linear') or in turn ('round_robin').",
           choices=("linear", "round_robin"), to=E),
        _f("--max-parallel-loading-workers", I, None,
           "Load weights in rounds of at most this many workers, to limit host memory.",
           why="each tensor-parallel rank reads only its own shards, all ranks at once; loading in rounds is not supported yet"),
        _f("--ray-workers-use-nsight", B, False, "Profile Ray workers with Nsight.",
           why="only used with the Ray executor, which Sonar does not support"),
        _f("--disable-custom-all-reduce", B, False, "Use NCCL's all-reduce instead of the custom kernel.",
           accepts=(True,), why="Sonar's all-reduce is always torch.distributed's (NCCL on GPUs): there is no custom kernel"),
        _f("--worker-cls", S_, "auto", "Fully qualified worker class; 'auto' picks the platform's."),
        _f("--worker-extension-cls", S_, "",
           "Class mixed into the worker class to add methods callable through collective RPC."),
        _f("--enable-fault-tolerance", B, False,
           "Recover from a failed data-parallel engine by scaling down instead of stopping."),
        _f("--fault-tolerance-config", J, {}, "Fault-tolerance settings such as the engine recovery timeout.",
           dotted=True, why="only used with --enable-fault-tolerance, which Sonar does not support yet",
           reference_default="FaultToleranceConfig(...) with every field at its default"),
    ),
    _group(
        "CacheConfig", "The paged KV cache: block size, memory budget, dtype, prefix caching, offloading.",
        _f("--block-size", I, None, "Tokens per KV cache block, a power of two.", to=E, check=power_of_two,
           default_note="16"),
        _f("--gpu-memory-utilization -gmu", F, 0.92,
           "Share of the GPU's total memory this server instance may use for weights, activations and KV "
           "cache, between 0 and 1; startup fails if that much is not free (it is never applied to the free "
           "memory instead). Unused on CPU.", to=E, check=fraction),
        _f("--kv-cache-memory-bytes", Kind.BYTES, None,
           "KV cache size per GPU in bytes, e.g. 2G (2 GiB), 2g (2*10^9) or 1.5GiB. When set, it sizes the "
           "cache instead of --gpu-memory-utilization and memory profiling is skipped.", to=E,
           check=positive),
        _f("--kv-cache-dtype", S_, "auto",
           "Storage type of the KV cache; 'auto' uses the model's dtype. fp8 (= fp8_e4m3) stores keys and "
           "values as float8 e4m3 with the scale 1.0, half the bytes of bfloat16 per block.",
           to=E, supported=("auto", "bfloat16", "float16", "fp8", "fp8_e4m3"),
           choices=("auto", "bfloat16", "float16", "fp8", "fp8_ds_mla", "fp8_e4m3", "fp8_e5m2", "fp8_inc",
                    "fp8_per_token_head", "int4_per_token_head", "int8_per_token_head", "nvfp4",
                    "turboquant_3bit_nc", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_k8v4")),
        _f("--num-gpu-blocks-override", I, None,
           "Use exactly this many KV cache blocks instead of the measured number (for testing preemption).",
           to=E, check=positive),
        _f("--enable-prefix-caching", B, None,
           "Reuse the KV cache blocks of identical prompt prefixes across requests.", to=E, default_note="on"),
        _f("--prefix-caching-hash-algo", S_, "sha256",
           "Hash of prefix-cache block keys: 'sha256' (pickle, then SHA-256), 'sha256_cbor' (canonical CBOR, "
           "reproducible across processes), 'xxhash' / 'xxhash_cbor' (128-bit xxHash: faster, but not "
           "cryptographic, so think about multi-tenant risk first).",
           choices=("sha256", "sha256_cbor", "xxhash", "xxhash_cbor"), to=E),
        _f("--calculate-kv-scales", B, False,
           "Deprecated: compute fp8 KV cache scales at run time instead of loading them."),
        _f("--kv-cache-dtype-skip-layers", L, (),
           "Layers (by index, or by attention kind such as sliding_window) whose KV cache is not quantized."),
        _f("--kv-sharing-fast-prefill", B, False,
           "In models whose layers share KV cache (YOCO style), let eligible layers skip prefill tokens."),
        _f("--mamba-cache-dtype", S_, "auto", "Dtype of the Mamba conv and SSM state cache.",
           choices=("auto", "bfloat16", "float16", "float32"), why=NO_MAMBA),
        _f("--mamba-ssm-cache-dtype", S_, "auto",
           "Dtype of the Mamba SSM state alone ('auto': as --mamba-cache-dtype).",
           choices=("auto", "bfloat16", "float16", "float32"), why=NO_MAMBA),
        _f("--mamba-block-size", I, None, "Block size of the Mamba cache under prefix caching (a multiple of 8).",
           why=NO_MAMBA),
        _f("--prefix-match-unit", I, None,
           "Granularity in tokens at which a prefix-cache hit may end; must divide every block size."),
        _f("--mamba-cache-mode", S_, "none",
           "Which Mamba states prefix caching keeps: 'none', 'all' (at every block boundary) or 'align' "
           "(the last token of a step, when on a block boundary).",
           choices=("align", "all", "none"), why=NO_MAMBA),
        _f("--replayssm-buffer-len", I, 16, "Ring-buffer length of the ReplaySSM decode kernel.", why=NO_MAMBA),
        _f("--use-replayssm", B, False, "Use the ReplaySSM decode kernel for Mamba2 layers.", why=NO_MAMBA),
        _f("--kv-offloading-size", F, None,
           "GiB of CPU memory to offload KV cache blocks into (summed over tensor-parallel ranks); unset: "
           "no offloading. Exclusive with --kv-transfer-config.", to=E, check=positive),
        _f("--kv-offloading-backend", S_, "native", "KV offloading implementation: 'native' or 'lmcache'.",
           choices=("lmcache", "native"), to=E, supported=("native",)),
    ),
    _group(
        "OffloadConfig", "Keeping part of the model weights in CPU memory.",
        _f("--offload-backend", S_, "auto",
           "Weight offloading method: 'uva' (zero-copy), 'prefetch' (layer groups fetched ahead) or 'auto' "
           "(by which settings are given).", choices=("auto", "prefetch", "uva"), why=NO_WEIGHT_OFFLOAD),
        _f("--cpu-offload-gb", F, 0,
           "GiB of weights per GPU kept in CPU memory and read over the interconnect on every forward pass."),
        _f("--cpu-offload-params", L, (),
           "Parameter name segments that --cpu-offload-gb may offload; empty: any.", why=NO_WEIGHT_OFFLOAD,
           reference_default="set()"),
        _f("--offload-group-size", I, 0,
           "Group every N layers and offload the last --offload-num-in-group of each group, prefetching "
           "them asynchronously; 0 turns it off."),
        _f("--offload-num-in-group", I, 1, "Layers offloaded in each group.", why=NO_WEIGHT_OFFLOAD),
        _f("--offload-prefetch-step", I, 1, "How many layers ahead to prefetch.", why=NO_WEIGHT_OFFLOAD),
        _f("--offload-params", L, (),
           "Parameter name segments offloaded by group offloading; empty: whole layers.",
           why=NO_WEIGHT_OFFLOAD, reference_default="set()"),
    ),
    _group(
        "MultiModalConfig", "Images, audio and video inputs of multimodal models.",
        _f("--language-model-only", B, False, "Accept no multimodal inputs at all (every modality limited to 0; the vision tower is not loaded).",
           to=E),
        _f("--limit-mm-per-prompt", J, {},
           "Most items per prompt for each modality, e.g. '{\"image\": 4}' (999 for a modality not named; "
           "per-item size options are not supported yet). With images limited to 0 the vision tower is not loaded.",
           dotted=True, to=E),
        _f("--enable-mm-embeds", B, False,
           "Accept images given as their precomputed feature rows: chat content parts of type "
           "\"image_embeds\" (base64 of a torch.save tensor, read without running pickled code, shape "
           "checked) and tensors among the library's images. With an image limit of 0 they do not count "
           "against --limit-mm-per-prompt.", to=E),
        _f("--media-io-kwargs", J, {},
           "Settings for loading media, per modality: images take image_mode (the PIL mode a decoded image "
           "is converted to, RGB by default) and rgba_background_color (what an RGBA image is laid over when "
           "made RGB, white by default), e.g. '{\"image\": {\"image_mode\": \"L\"}}'; video and audio "
           "settings are refused (Sonar serves neither).",
           dotted=True, to=E),
        _f("--mm-processor-kwargs", J, None,
           "Overrides for the image processor's settings (resize, crop, normalization), e.g. "
           "'{\"do_normalize\": false}'.", dotted=True, to=E),
        _f("--mm-processor-cache-gb", F, 4,
           "GiB of processed images (pixels, by the SHA-256 of the image's bytes) the API server keeps, "
           "least recently used out first, so a picture sent again is neither decoded nor preprocessed "
           "again; 0 turns it off.", to=E),
        _f("--mm-processor-cache-type", S_, "lru",
           "Cache of processed multimodal inputs: mirrored LRU ('lru') or shared-memory FIFO ('shm').",
           choices=("lru", "shm"), why=NO_MM),
        _f("--mm-shm-cache-max-object-size-mb", I, 128,
           "Largest object, in MiB, in the shared-memory multimodal cache.", why=NO_MM),
        _f("--mm-encoder-only", B, False,
           "Run only the multimodal encoder, without the language model (disaggregated encoders)."),
        _f("--mm-encoder-tp-mode", S_, "weights",
           "How tensor parallelism applies to the multimodal encoder: split its weights or its batch ('data').",
           choices=("data", "weights"), why=NO_MM),
        _f("--mm-encoder-attn-backend", S_, None, "Attention backend for vision encoders.", why=NO_MM),
        _f("--mm-encoder-attn-dtype", S_, None, "Run vision-encoder attention in fp8.", choices=("fp8", None),
           why=NO_MM),
        _f("--mm-encoder-fp8-scale-path", S_, None, "JSON file of per-layer fp8 scales for vision-encoder attention.",
           why=NO_MM),
        _f("--mm-encoder-fp8-scale-save-path", S_, None, "Where to save calibrated vision-encoder fp8 scales.",
           why=NO_MM),
        _f("--mm-encoder-fp8-scale-save-margin", F, 1.5, "Headroom factor applied to saved fp8 scales.",
           why=NO_MM),
        _f("--interleave-mm-strings", B, False,
           "Let text and media interleave freely in string-format chat prompts.", why=NO_MM),
        _f("--skip-mm-profiling", B, False,
           "Leave the vision tower out of the startup memory profile (CUDA): without it, the profile also "
           "runs the tower on the largest image a request can bring.", to=E),
        _f("--video-pruning-rate", F, None, "Share of video tokens to drop, from 0 up to but excluding 1.",
           why=NO_MM),
        _f("--video-pruning-method", S_, "evs", "Algorithm that prunes video tokens.", choices=("evs", "vidcom2"),
           why=NO_MM),
        _f("--mm-tensor-ipc", S_, "direct_rpc", "How multimodal tensors travel between processes.",
           choices=("direct_rpc", "torch_shm"), why=NO_MM),
        _f("--mm-ipc-gpu-memory-gb", F, 0,
           "GiB of GPU memory taken from the KV cache budget for multimodal work in the API server."),
    ),
    _group(
        "LoRAConfig", "Serving LoRA adapters.",
        _f("--enable-lora", B, None, "Serve LoRA adapters (docs/lora.md).", to=E),
        _f("--max-loras", I, 1, "Most distinct LoRA adapters used in one batch (device slots).", to=E,
           check=positive),
        _f("--max-lora-rank", I, 16, "Highest LoRA rank served; adapters of a higher rank are refused.",
           choices=(1, 8, 16, 32, 64, 128, 256, 320, 512), to=E),
        _f("--lora-dtype", S_, "auto", "Dtype of LoRA weights ('auto': the model's).",
           choices=("auto", "bfloat16", "float16"), to=E),
        _f("--enable-tower-connector-lora", B, False,
           "Also apply LoRA to a multimodal model's vision tower and connector.", why=NO_MM),
        _f("--max-cpu-loras", I, None,
           "Most LoRA adapters kept in host memory (at least --max-loras; unset: --max-loras).", to=E,
           check=positive),
        _f("--fully-sharded-loras", B, False,
           "Shard all of the LoRA computation over tensor-parallel ranks, not only half of it (the "
           "adapters' rank in column-parallel layers, their output rows in row-parallel ones).", to=E),
        _f("--lora-target-modules", L, None,
           "Apply LoRA only to these projections (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, "
           "down_proj, or qkv_proj / gate_up_proj for all of theirs); unset: all of them. Adapters with "
           "factors for other projections are refused.", to=E),
        _f("--default-mm-loras", J, None, "LoRA adapter to use whenever a request contains a given modality.",
           dotted=True, why=NO_MM),
        _f("--specialize-active-lora", B, False,
           "Capture separate CUDA graphs for each number of active LoRA adapters.",
           why="Sonar captures no CUDA graphs while LoRA adapters are enabled (their steps run eagerly)"),
        _f("--enable-mixed-moe-lora-format", B, False,
           "Serve 2D-format and 3D-format MoE LoRA adapters side by side.", why=NO_MOE_LORA),
        _f("--enable-moe-shared-loras", B, False,
           "Load MoE LoRA adapters whose factors are shared by all experts.", why=NO_MOE_LORA),
    ),
    _group(
        "ObservabilityConfig", "Metrics, tracing and diagnostic logging.",
        _f("--show-hidden-metrics-for-version", S_, None,
           "Bring back the metrics hidden since this version, while dashboards migrate."),
        _f("--otlp-traces-endpoint", S_, None,
           "Export one OpenTelemetry span per finished generation request (request id, model, sampling "
           "parameters, token counts, queue / prefill / decode / end-to-end times) to this OTLP/HTTP "
           "collector URL (http://host:4318 posts to /v1/traces); a client's traceparent header makes it "
           "the parent.", to=S, check=otlp_endpoint, metavar="URL"),
        _f("--collect-detailed-traces", S_, None,
           "Add each request's worker time to its span and export a span per engine step, linked from "
           "the requests' spans (needs --otlp-traces-endpoint): 'worker' the worker's time on the steps "
           "(worker.execute, worker.sample), 'model' their forward passes' (model.forward, timed with a "
           "device synchronization: costly), 'all' both; or two of them comma-separated.",
           choices=("all", "model", "worker", None, "model,worker", "model,all", "worker,model", "worker,all",
                    "all,model", "all,worker"),
           to=E, metavar="{all,model,worker,None}"),
        _f("--kv-cache-metrics", B, False,
           "Sample KV cache blocks and report their lifetimes, idle times before eviction and reuse gaps "
           "as /metrics histograms.", to=E),
        _f("--kv-cache-metrics-sample", F, 0.01,
           "Fraction of allocated KV blocks --kv-cache-metrics follows, in (0, 1].", to=E, check=fraction),
        _f("--cudagraph-metrics", B, False, "Report CUDA graph padding and dispatch statistics."),
        _f("--enable-layerwise-nvtx-tracing", B, False, "Mark each layer's execution with NVTX ranges."),
        _f("--enable-mfu-metrics", B, False,
           "Report each step's estimated model FLOPs and bytes read (from the model's shape and the "
           "step's tokens), the time the worker spent, and the device's peak FLOP/s where Sonar knows it, "
           "as /metrics counters.", to=E),
        _f("--enable-logging-iteration-details", B, False,
           "Log every engine step: its context (prefill) and generation requests and tokens, and its "
           "elapsed time, as a scheduler.iteration line.", to=E),
        _f("--jit-monitor-mode", S_, "warn", "What to do about JIT compilation after warmup: 'warn' or 'error'.",
           choices=("error", "warn")),
        _f("--jit-monitor-verbose", B, False, "Log every JIT compilation after warmup in detail."),
    ),
    _group(
        "SchedulerConfig", "How the scheduler fills each step: budgets, chunked prefill, policy, streaming.",
        _f("--max-num-batched-tokens", H, None,
           "Token budget of one scheduler step, shared by decodes and prefill chunks; takes 8192, 8k or 8K.",
           to=E, check=positive,
           default_note="512, or --max-num-seqs where that is larger: on CPU, small steps let prefills "
                        "interleave with decodes (half the time to first token at the same prefill "
                        "throughput); below --max-num-seqs it is refused"),
        _f("--max-num-scheduled-tokens", H, None,
           "Tokens the scheduler itself may schedule per step when the model appends more (speculative "
           "decoding); unset: the batched-token budget."),
        _f("--max-num-seqs", I, None, "Most requests running together in one step.", to=E, check=positive,
           default_note="256"),
        _f("--max-waiting-seqs", I, 4096,
           "Sonar's own: most sequences waiting to be scheduled (a request with n completions counts n); "
           "a request beyond it is refused with 429 and a Retry-After header instead of queueing without "
           "end.", to=E, check=positive),
        _f("--long-prefill-token-threshold", I, 0,
           "Prompts longer than this many tokens count as long for chunked prefill; 0: no threshold.",
           to=E, check=non_negative),
        _f("--scheduling-policy", S_, "fcfs",
           "Admission order: 'fcfs' by arrival, or 'priority' by the request's priority (lower first), "
           "then by arrival.", choices=("fcfs", "priority"), to=E),
        _f("--enable-chunked-prefill", B, None,
           "Split long prompts into chunks that fit the remaining token budget of a step.", to=E,
           default_note="on"),
        _f("--disable-chunked-mm-input", B, False, "Never split one multimodal item across steps.", why=NO_MM),
        _f("--scheduler-cls", S_, None, "Scheduler class to use, as module.Class."),
        _f("--scheduler-reserve-full-isl", B, True,
           "Admit a request only when its whole prompt fits in the KV cache, not just its first chunk.", to=E),
        _f("--watermark", F, 0.0,
           "Share of KV cache blocks kept free when admitting requests, to avoid preemption; 0 turns it off, "
           "must stay below 1.", to=E, check=watermark),
        _f("--prefill-schedule-interval", I, 1, "Admit new prefills only every N steps (aligned across ranks)."),
        _f("--disable-hybrid-kv-cache-manager", B, None,
           "Give all attention layers the same KV cache layout even when a model mixes attention kinds.",
           accepts=(True,)),
        _f("--async-scheduling", B, None,
           "Schedule and send the next step while the current one runs, so the device never waits for "
           "the scheduler; a request that stops on a token computes one token more, which is dropped.",
           to=E, default_note="on for a CUDA device, off on the CPU (measured slower there on 2 cores), "
                              "with KV offloading and with a draft model or head (refused with them "
                              "when given; ngram and suffix drafts are then made by the worker)"),
        _f("--stream-interval", I, 1,
           "Tokens collected before a streaming chunk is sent; 1 sends every token at once, larger values "
           "save overhead: the engine then decodes up to that many tokens per trip through its scheduler "
           "while nothing waits (multi-step decode) and hands a stream's tokens over with the trip's "
           "answer, not one by one as it does at 1 (with up to 8 per trip).", to=S, check=positive),
    ),
    _group(
        "CompilationConfig", "torch.compile and CUDA graph capture.",
        _f("--cudagraph-capture-sizes", Kind.INT_LIST, None,
           "Decode batch sizes to capture as CUDA graphs (positive; sorted and deduplicated); unset: 1, 2, 4, "
           "then every 8 up to 248, then every 16 up to --max-cudagraph-capture-size.", to=E),
        _f("--max-cudagraph-capture-size", I, None,
           "Largest decode batch size captured as a CUDA graph; with --cudagraph-capture-sizes it must be that "
           "list's largest.", to=E, check=positive,
           default_note="min(2 * --max-num-seqs, 512)"),
    ),
    _group(
        "KernelConfig", "Kernel selection and warmup.",
        _f("--ir-op-priority", J, {}, "Preferred implementations of IR ops such as rms_norm.", dotted=True,
           reference_default="IrOpPriorityConfig(...) with every field at its default"),
        _f("--enable-flashinfer-autotune", B, None, "Autotune FlashInfer kernels during warmup.",
           accepts=(False,), why="Sonar uses no FlashInfer kernels"),
        _f("--enable-bf16x3-router-gemm", B, False, "Use the experimental BF16x3 MoE router GEMM (SM100)."),
        _f("--moe-backend", S_, "auto", "Kernels for MoE expert computation.",
           choices=("aiter", "auto", "batched_triton", "cutlass", "deep_gemm", "deep_gemm_mega_moe", "emulation",
                    "flashinfer_b12x", "flashinfer_cutedsl", "flashinfer_cutlass", "flashinfer_trtllm", "flydsl",
                    "hpc", "humming", "marlin", "triton", "triton_unfused")),
        _f("--linear-backend", S_, "auto", "Kernels for quantized linear layers.",
           choices=("aiter", "auto", "conch", "cutlass", "deep_gemm", "emulation", "exllama", "fbgemm",
                    "flashinfer_b12x", "flashinfer_cudnn", "flashinfer_cutedsl", "flashinfer_cutlass",
                    "flashinfer_trtllm", "humming", "machete", "marlin", "swordfish", "torch", "triton", "xpu",
                    "xpu_woq"),
           why="Sonar picks the quantized layers' kernels by device: its native kernels on the CPU, its Triton "
           "kernels on CUDA, the torch reference where neither serves a weight (docs/quantization.md)"),
    ),
    _group(
        "Sonar configuration", "Whole-server settings given as JSON objects (or one key at a time with "
        "--FLAG.KEY VALUE): speculative decoding, compilation, KV transfer and events, profiling.",
        _f("--speculative-config -sc", J, None,
           "Speculative decoding settings: method ngram (prompt_lookup_min/max), suffix (suffix_decoding_*), "
           "draft_model (model, quantization, revision, draft_tensor_parallel_size: 1 or the target's tensor-"
           "parallel size, the latter by default), eagle or eagle3 (model: the head), mtp (DeepSeek-V3's own "
           "MTP layer), num_speculative_tokens, disable_by_batch_size; "
           "see docs/speculative.md.",
           dotted=True, to=E),
        _f("--spec-method", S_, None, "Speculative decoding method.",
           choices=("bailing_hybrid_mtp", "custom_class", "deepseek_mtp", "dflash", "draft_model", "dspark",
                    "eagle", "eagle3", "ernie_mtp", "exaone4_5_mtp", "exaone_moe_mtp", "extract_hidden_states",
                    "gemma4_mtp", "glm4_moe_lite_mtp", "glm4_moe_mtp", "glm_ocr_mtp", "hy_v3_mtp", "inkling_mtp",
                    "longcat_flash_mtp", "medusa", "mimo_mtp", "mimo_v2_mtp", "minimax_m3_mtp", "mlp_speculator",
                    "mtp", "nemotron_h_mtp", "ngram", "ngram_gpu", "pangu_ultra_moe_mtp", "qwen3_5_mtp",
                    "qwen3_next_mtp", "step3p5_mtp", "suffix", None), to=E),
        _f("--spec-model", S_, None, "Draft model (method draft_model) or EAGLE / EAGLE-3 head directory (eagle, eagle3) "
           "for speculative decoding.", to=E),
        _f("--spec-tokens", I, None, "Tokens proposed per speculative step.", to=E),
        _f("--diffusion-config -dc", J, None, "Settings for diffusion language models.", dotted=True),
        _f("--kv-transfer-config", J, None,
           "Settings for moving KV cache between instances and tiers. Sonar implements the OffloadingConnector "
           "(kv_role kv_both) with spec_name CPUOffloadingSpec or TieringOffloadingSpec (CPU, then a disk "
           "directory); see docs/kv_offload.md.", dotted=True, to=E),
        _f("--kv-events-config", J, None,
           "Settings for publishing KV cache events (BlockStored, BlockRemoved, AllBlocksCleared) over ZMQ, "
           "with a replay endpoint. They carry prompt token ids: the default endpoint is loopback "
           "(tcp://127.0.0.1:5557); see docs/kv_offload.md for CURVE keys.", dotted=True, to=E),
        _f("--ec-transfer-config", J, None, "Settings for moving encoder caches between instances.", dotted=True),
        _f("--compilation-config -cc", J, {},
           "torch.compile and CUDA graph settings, as JSON or one key at a time (-cc.mode=3).", dotted=True,
           reference_default="CompilationConfig(...) with every field at its default"),
        _f("--attention-config -ac", J, {}, "Attention backend settings.", dotted=True,
           reference_default="AttentionConfig(...) with every field at its default"),
        _f("--reasoning-config", J, None, "Settings for reasoning models.", dotted=True),
        _f("--kernel-config", J, {}, "Kernel selection and warmup settings.", dotted=True,
           reference_default="KernelConfig(...) with every field at its default"),
        _f("--additional-config", J, {}, "Platform-specific extra settings."),
        _f("--structured-outputs-config", J, {},
           "Structured output settings: backend (auto: xgrammar, and llguidance for what xgrammar cannot "
           "express; xgrammar; guidance), disable_any_whitespace, disable_additional_properties, "
           "reasoning_parser and reasoning_parser_plugin (the same setting as --reasoning-parser and "
           "--reasoning-parser-plugin: a request's grammar applies after the thinking ends), "
           "enable_in_reasoning (apply it from the first token).",
           dotted=True, to=E, check=structured_outputs_config,
           reference_default="StructuredOutputsConfig(...) with every field at its default"),
        _f("--profiler-config", J, {},
           "Profiler settings: with profiler torch and torch_profiler_dir DIR, POST /start_profile and "
           "/stop_profile run torch's profiler in the workers and write Chrome/Perfetto traces into DIR "
           "(torch_profiler_with_stack, _with_flops, _use_gzip, _dump_cuda_time_total, _record_shapes, "
           "_with_memory, delay_iterations, max_iterations).", dotted=True, to=E, check=profiler_config,
           reference_default="ProfilerConfig(...) with every field at its default"),
        _f("--optimization-level -O", I, 2,
           "Trade startup time for speed: -O0 starts fastest (no torch.compile, no CUDA graphs); -O1 captures "
           "CUDA graphs; -O2 also compiles the model on GPUs; -O3 compiles on the CPU too (a few percent "
           "faster per step there, for a longer start). Compiled code is cached under SONAR_CACHE_ROOT.",
           choices=(0, 1, 2, 3), to=E),
        _f("--performance-mode", S_, "balanced",
           "Tune for 'interactivity' (low latency at small batches), 'throughput' (many concurrent requests) "
           "or 'balanced'.", choices=("balanced", "interactivity", "throughput")),
        _f("--weight-transfer-config", J, None,
           "Take weight updates while serving (RL training loops): backend sonar writes a safetensors "
           "checkpoint folder (POST /update_weights {\"path\": DIR}) or tensors sent over Sonar's transport "
           "(LLM.update_weights(tensors=...), or a safetensors body) into the running model, between steps; "
           "max_update_bytes bounds one update. Backends nccl and ipc are refused.",
           dotted=True, to=E, check=weight_transfer_config),
    ),
    _group(
        "Limits", "Sonar's own flags: what one connection and one request may use. Going over a limit is "
        "refused with an error that names its flag; the defaults stay out of the way of normal use.",
        _f("--metrics-public", B, False,
           "Serve /metrics without the API key (for a Prometheus scraper that sends none). Every other "
           "route but /health and /ping needs the key when --api-key is set.", to=S),
        _f("--max-request-body-bytes", Kind.BYTES, 8 * 2**20,
           "Largest request body, in bytes (takes 8M, 8MiB): a bigger one gets 413 before it is read, from "
           "its Content-Length or, streamed, as soon as it passes the limit.", to=S, check=positive),
        _f("--header-read-timeout", F, 10.0,
           "Seconds a connection may take to send a request's headers; then it gets 408 and is closed "
           "(a client trickling partial headers holds no connection for longer).", to=S, check=positive),
        _f("--body-read-timeout", F, 60.0,
           "Seconds from a request's headers to the end of its body; a slower body gets 408 and the "
           "connection is closed.", to=S, check=positive),
        _f("--max-connections", I, 2048,
           "Most HTTP connections open at once; a request on a connection beyond them gets 503 and the "
           "connection is closed.", to=S, check=positive),
        _f("--max-prompt-chars", H, 1_000_000,
           "Most characters in one text prompt (for a chat, in the rendered conversation), checked before "
           "tokenization; a longer one gets 400.", to=E, check=positive),
        _f("--max-stop-strings", I, 64, "Most stop strings in one request.", to=E, check=positive),
        _f("--max-stop-string-chars", I, 1024, "Most characters in one stop string.", to=E, check=positive),
        _f("--max-stop-token-ids", I, 1024, "Most stop_token_ids in one request.", to=E, check=positive),
        _f("--max-logit-bias", I, 1024, "Most logit_bias entries in one request.", to=E, check=positive),
        _f("--max-chat-messages", I, 1024, "Most messages in one chat request.", to=E, check=positive),
        _f("--max-completions-per-request", I, 256,
           "Most completions one request asks for: n times its number of prompts.", to=E, check=positive),
        _f("--max-stored-responses", I, 1024,
           "Most responses of the Responses API kept in memory for previous_response_id and GET "
           "/v1/responses/{id}; the oldest are evicted first (0: none is kept).", to=S, check=non_negative),
        _f("--max-stored-response-bytes", Kind.BYTES, 64 * 2**20,
           "Most bytes the kept responses (with their conversations) may hold together (takes 64M, 64MiB); "
           "the oldest are evicted first, and a response bigger than this alone is not kept.",
           to=S, check=non_negative),
        _f("--max-structured-output-chars", I, 65536,
           "Most characters in one request's structured output spec (JSON schema, regex, grammar, choices).",
           to=E, check=positive),
        _f("--structured-outputs-compile-timeout", F, 10.0,
           "Seconds a request waits for its structured output grammar to compile; a slower one gets 400 "
           "(compiled grammars are cached, so a spec pays this once).", to=E, check=positive),
    ),
    _group(
        "ActorConfig", "Sonar's own flags: where the engine's actors run and how long they may take.",
        _f("--placement", Kind.PLACEMENT, None,
           "Where each engine actor runs, as comma-separated actor=where pairs: actor is worker, "
           "detokenizer or scheduler; where is inprocess, process or tcp://host:port. Unset: all in this "
           "process.", to=E, metavar="ACTOR=WHERE[,...]"),
        _f("--actor-keys", S_, None,
           "Directory of the actor transport's CURVE keys, as `python -m sonar actor keygen DIR` writes them: "
           "needed to place actors on other machines (--placement worker=tcp://...), whose actor hosts "
           "run with the same keys. Unset: $SONAR_ACTOR_KEYS, else keys made for this server and its child "
           "processes only.", to=S, metavar="DIR"),
        _f("--actor-max-frame-bytes", Kind.BYTES, 4294967296,
           "Largest message frame between actor processes, sent or accepted (a bigger one is refused with an "
           "error naming this flag). The largest legitimate frame is a KV offload load of a whole cached "
           "prefix when the worker runs in its own process: raise it for long contexts of large models. "
           "Default: 4 GiB.", to=S, check=positive, metavar="BYTES"),
        _f("--data-parallel-routing", S_, "prefix",
           "How a request picks its data-parallel replica: 'prefix' sends it to the replica that holds the "
           "longest cached prefix of its prompt, unless that one is far busier than the least loaded; "
           "'load' always to the least loaded (fewest requests in flight, then KV usage).",
           choices=("prefix", "load"), to=E),
        _f("--step-timeout", F, 600.0,
           "Seconds the scheduler waits for one model step before it counts the worker as failed.",
           to=E, check=positive),
        _f("--hang-margin", F, 10.0,
           "The worker's liveness deadline: a model step counts as hung when it runs longer than four times "
           "what the steps seen so far predict for its size, plus this many seconds; the worker is then "
           "restarted as if it had crashed (before any step has finished, --step-timeout applies).",
           to=E, check=positive),
        _f("--fault-injection", S_, None,
           "For tests and drills: make the worker fail on purpose. Comma-separated ACTION@step=N (once, on "
           "the N-th model step), ACTION@p=P (each step with probability P) or ACTION@token=ID (each step "
           "whose input holds token ID: a request with ID in its prompt fails every step that computes it, "
           "like a poison request, until it is quarantined); ACTION is raise (an exception in the forward "
           "pass), hang (a step that never returns) or exit (the worker process dies). A trailing @rank=R "
           "makes rank R of a tensor/pipeline group fail instead of rank 0. Steps then decode one token per trip "
           "unless --stream-interval says otherwise, so that N counts tokens and ID is seen. Off by default.",
           to=E, metavar="ACTION@step=N|ACTION@p=P|ACTION@token=ID[,...]"),
    ),
)
# fmt: on

FLAGS: dict[str, Flag] = {flag.name: flag for group in GROUPS for flag in group.flags}
"""Every flag by its long name (``--max-num-seqs``)."""

BY_OPTION: dict[str, Flag] = {opt: flag for flag in FLAGS.values() for opt in flag.option_strings}
"""Every flag by each of its option strings (``--tensor-parallel-size``, ``-tp``)."""

BY_DEST: dict[str, Flag] = {flag.dest: flag for flag in FLAGS.values()}
"""Every flag by its name with underscores (``max_num_seqs``), as config files may spell it."""
