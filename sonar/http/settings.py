"""The frontend's settings: the share of `ServeConfig` the app reads (the app does not depend on the CLI)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ServerSettings:
    """The frontend's share of `ServeConfig` (the app does not depend on the CLI)."""

    served_model_names: tuple[str, ...]
    api_keys: tuple[str, ...] = ()
    chat_template: str | None = None
    #: --default-chat-template-kwargs: template variables for every chat request (a request's
    #: chat_template_kwargs win).
    default_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    #: --exclude-tools-when-tool-choice-none: `tool_choice: "none"` keeps the tools out of the prompt.
    exclude_tools_when_tool_choice_none: bool = False
    response_role: str = "assistant"
    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    enable_force_include_usage: bool = False
    #: Add `usage.prompt_tokens_details.cached_tokens` (prompt tokens served from the prefix cache).
    enable_prompt_tokens_details: bool = False
    #: Add an `X-Request-Id` header to every response (the client's own, else a fresh one).
    enable_request_id_headers: bool = False
    #: What responses carry as `system_fingerprint` (None: null).
    system_fingerprint: str | None = None
    #: Streams send a chunk once a choice has this many new tokens (or has finished).
    stream_interval: int = 1
    #: Logprob tokens are written `token_id:<id>` instead of their text.
    return_tokens_as_token_ids: bool = False
    #: Sampling defaults for fields a request leaves out (--generation-config and its override):
    #: SamplingParams names; `max_tokens` (generation_config's max_new_tokens) also caps requests.
    default_sampling: dict[str, Any] = field(default_factory=dict)
    #: Serve GET /tokenizer_info (--enable-tokenizer-info-endpoint).
    enable_tokenizer_info_endpoint: bool = False
    #: --enable-log-requests: one `request.received` log line per request (id, prompt, sampling).
    enable_log_requests: bool = False
    #: --enable-log-outputs (with --enable-log-requests): a `request.output` line with the output.
    enable_log_outputs: bool = False
    #: --enable-log-deltas: with the two above, also a `request.delta` line per streamed piece.
    enable_log_deltas: bool = True
    #: --max-log-len: logged prompts and outputs keep this many characters (token ids: ids).
    max_log_len: int | None = None
    #: Seconds /health waits for the scheduler to answer before it reports 503.
    health_timeout: float = 5.0
    #: Serve GET /openapi.json (off with --disable-fastapi-docs).
    enable_openapi: bool = True
    #: --metrics-public: GET /metrics answers without the API key.
    metrics_public: bool = False
    #: --max-request-body-bytes: a bigger body is refused with 413 before it is read.
    max_request_body_bytes: int = 8 * 2**20
    #: --body-read-timeout: seconds from a request's headers to the end of its body (else 408).
    body_read_timeout: float = 60.0
    #: --max-stored-responses / --max-stored-response-bytes: the bounds of the Responses API's store.
    max_stored_responses: int = 1024
    max_stored_response_bytes: int = 64 * 2**20
    #: --enable-auto-tool-choice: tool_choice "auto" parses the output with `tool_call_parser`.
    enable_auto_tool_choice: bool = False
    #: --tool-call-parser: a name registered in `sonar.parsers.tools` (None: none).
    tool_call_parser: str | None = None
    #: --reasoning-parser: a name registered in `sonar.parsers.reasoning` (None: none).
    reasoning_parser: str | None = None
    #: --log-error-stack: every error response logs the traceback behind it (`request.error`).
    log_error_stack: bool = False
    #: --enable-per-request-metrics: a single-prompt, single-choice completion carries `metrics`
    #: (on a stream: the final usage chunk).
    enable_per_request_metrics: bool = False
    #: --otlp-traces-endpoint: each finished generation request's span is exported there
    #: (`sonar.http.tracing`).
    otlp_traces_endpoint: str | None = None
    #: --enable-server-load-tracking: count generation requests in flight, served at GET /load.
    enable_server_load_tracking: bool = True
    #: --allowed-local-media-path / --allowed-media-domains: where image URLs may point (`sonar.multimodal.media`).
    allowed_local_media_path: str = ""
    allowed_media_domains: tuple[str, ...] | None = None
    #: --middleware: the operator's middleware as starlette `Middleware` entries, outermost first
    #: (`sonar.http.middleware.load_middleware`); they wrap Sonar's own.
    middleware: tuple[Any, ...] = ()
    #: --chat-template-content-format: "auto", "string" or "openai" (`sonar.http.content_format`).
    chat_template_content_format: str = "auto"
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def model_name(self) -> str:
        """The name reported in responses."""
        return self.served_model_names[0]
