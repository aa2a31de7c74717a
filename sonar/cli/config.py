"""`ServeConfig`: everything `sonar serve` was told, as one typed, immutable value.

The engine's share is an `EngineConfig` (`engine`); the rest are the HTTP frontend's settings.
`parse_serve_args` builds it from the command line, a `--config` YAML file and the defaults.
"""

from __future__ import annotations

from typing import Any

import msgspec

from sonar.engine.config import EngineConfig

DEFAULT_PORT = 2242


class ServeConfig(msgspec.Struct, kw_only=True, frozen=True):
    engine: EngineConfig
    served_model_name: tuple[str, ...]
    """Names clients may use for the model; the first is reported in responses."""

    # Listening.
    host: str | None = None
    port: int = DEFAULT_PORT
    uds: str | None = None
    root_path: str | None = None
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    ssl_ca_certs: str | None = None
    ssl_cert_reqs: int = 0
    enable_ssl_refresh: bool = False
    """Reload the TLS files when they change (`sonar.http.tls`)."""
    middleware: tuple[str, ...] = ()
    """Import paths of the operator's ASGI middleware (`sonar.http.middleware`)."""
    h11_max_incomplete_event_size: int = 4194304
    h11_max_header_count: int = 256
    disable_fastapi_docs: bool = False
    enable_log_deltas: bool = True
    shutdown_timeout: float = 0.0
    max_request_body_bytes: int = 8 * 2**20
    header_read_timeout: float = 10.0
    body_read_timeout: float = 60.0
    max_connections: int = 2048
    max_stored_responses: int = 1024
    max_stored_response_bytes: int = 64 * 2**20

    api_server_count: int | None = None
    """API server processes over the one engine (None: one; `sonar.http.api_servers`)."""
    headless: bool = False
    """Run only this node's ranks, no API server (`sonar.engine.node_agent.run_headless`)."""

    # The actor transport between processes and machines (`sonar.actors.keys`).
    actor_keys: str | None = None
    actor_max_frame_bytes: int = 4 * 2**30

    # Access control and CORS.
    api_key: tuple[str, ...] | None = None
    metrics_public: bool = False
    allowed_origins: tuple[str, ...] = ("*",)
    allowed_local_media_path: str = ""
    allowed_media_domains: tuple[str, ...] | None = None
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False

    # Requests and responses.
    chat_template: str | None = None
    chat_template_content_format: str = "auto"
    """How message content reaches the template (`sonar.http.content_format`)."""
    default_chat_template_kwargs: dict[str, Any] | None = None
    exclude_tools_when_tool_choice_none: bool = False
    response_role: str = "assistant"
    generation_config: str = "auto"
    override_generation_config: dict[str, Any] = {}
    return_tokens_as_token_ids: bool = False
    enable_force_include_usage: bool = False
    enable_prompt_tokens_details: bool = False
    enable_tokenizer_info_endpoint: bool = False
    enable_request_id_headers: bool = False
    fingerprint_mode: str = "full"
    fingerprint_value: str | None = None
    stream_interval: int = 1

    # Tool calls and reasoning (the parsers' names; plugins were loaded while parsing the flags).
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    tool_parser_plugin: str = ""
    reasoning_parser: str = ""
    reasoning_parser_plugin: str = ""

    # Logging.
    enable_log_requests: bool = False
    enable_log_outputs: bool = False
    max_log_len: int | None = None
    disable_log_stats: bool = False
    uvicorn_log_level: str = "info"
    disable_uvicorn_access_log: bool = False
    disable_access_log_for_endpoints: tuple[str, ...] = ()
    fail_on_environ_validation: bool = False
    log_config_file: str | None = None
    """A logging dictConfig JSON file (`sonar.log.apply_config_file`)."""
    log_error_stack: bool = False
    enable_per_request_metrics: bool = False
    otlp_traces_endpoint: str | None = None
    enable_server_load_tracking: bool = True

    @property
    def model(self) -> str | None:
        """The model as given (None: the embedded default model)."""
        return self.engine.model

    @property
    def max_logprobs(self) -> int:
        return self.engine.max_logprobs

    @property
    def gpu_memory_utilization(self) -> float:
        return self.engine.gpu_memory_utilization

    @property
    def enforce_eager(self) -> bool:
        return self.engine.enforce_eager
