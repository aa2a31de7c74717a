"""The in-process library API: `async with sonar.open(...) as llm`.

`open()` starts the engine's supervision tree (`sonar.engine.tree.engine_spec`: worker,
detokenizer, scheduler) inside the caller's event loop; `connect()` adds a small client actor
(`sonar.engine.client_actor`) that receives the detokenizer's outputs and hands each request's
deltas to the task waiting for them, and yields the `LLM` handle (`sonar.engine.llm`).
Everything it started is stopped when the block ends.
"""

from __future__ import annotations

import secrets
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

import anyio
import anyio.to_thread

from sonar.actors import Supervisor, supervise
from sonar.actors.actor import launch
from sonar.engine import tokenizers
from sonar.engine.client_actor import ClientActor, DeltaStream, Failed
from sonar.engine.config import EngineConfig
from sonar.engine.llm import LLM
from sonar.engine.tree import engine_spec, worker_ref
from sonar.errors import InvalidRequestError
from sonar.protocol.engine import DescribeWorker


@asynccontextmanager
async def open(model: str | None = None, **engine_args: Any) -> AsyncIterator[LLM]:
    """Start an engine for `model` (None: the embedded SmolLM2-135M-Instruct) in this event loop.

    `engine_args` are the server's flags with underscores (`max_model_len`, `max_num_seqs`,
    `block_size`, `kv_cache_memory_bytes`, `dtype`, `seed`, `placement`, ...).
    """
    config = EngineConfig.from_args(model, **engine_args)
    tokenizers.prefetch_for(config)
    async with supervise(engine_spec(config)) as sup:
        async with connect(sup, config) as llm:
            yield llm


@asynccontextmanager
async def connect(sup: Supervisor, config: EngineConfig) -> AsyncIterator[LLM]:
    """An `LLM` on the running engine tree `sup` (built from `engine_spec(config)`): starts the
    client actor that receives outputs and loads the tokenizer."""
    streams: dict[str, DeltaStream] = {}
    async with anyio.create_task_group() as tg:
        client_name = f"client-{secrets.token_hex(4)}"
        inc = await launch(tg, ClientActor(streams), client_name, 4096)
        info = await worker_ref(sup).ask(DescribeWorker(), timeout=60)
        tokenizer_path = config.tokenizer or info.tokenizer_path
        if tokenizer_path is None:
            raise InvalidRequestError("the model has no tokenizer; pass tokenizer=...")
        tokenizer = await anyio.to_thread.run_sync(tokenizers.load, tokenizer_path)
        llm = LLM(config, sup, inc.ref, streams, info, tokenizer)

        def fail_all(reason: str) -> None:
            for stream in list(streams.values()):
                stream.send_nowait(Failed(reason))

        def on_event(event: Any) -> None:
            # The worker can be restarted under running requests (the scheduler recomputes
            # them); the scheduler and the detokenizer hold request state that a restart
            # loses, so the requests they held end with an error rather than hang. When the
            # tree gives up, everything in flight ends with an error and new requests fail.
            if event.kind == "crash" and event.child in ("scheduler", "detokenizer"):
                fail_all(f"the {event.child} crashed ({event.detail}); request lost")
            elif event.kind == "give_up":
                llm.dead = f"the engine gave up after repeated crashes ({event.detail})"
                fail_all(llm.dead)

        sup.listeners.append(on_event)
        try:
            yield llm
        finally:
            sup.listeners.remove(on_event)
            llm._closed = True
            fail_all("the engine is shutting down")
            tg.cancel_scope.cancel()
