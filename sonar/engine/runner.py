"""The model runner of one device: the weights, the KV cache tensors, and one step's forward pass.

It keeps, per running request, only what sampling needs (parameters, prompt and output ids); the
scheduler resends that state whenever a request (re)starts, so a new runner can be rebuilt from
the scheduler alone. Everything here is synchronous; the worker actor runs it in a thread.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

import torch

from sonar.engine.config import EngineConfig
from sonar.engine.protocol import ExecuteStep, StepResult, TokenLogprobs, WorkerInfo
from sonar.kernels.attention import AttentionMetadata, allocate_kv_caches
from sonar.kernels.linear import prepack_linears
from sonar.log import get_logger
from sonar.models.loader import LoadedModel, load_model
from sonar.models.sampler import LogprobsTensors, Sampler, SamplingBatch, compute_prompt_logprobs, is_plain_greedy
from sonar.sampling_params import SamplingParams
from sonar.units import format_memory_size

log = get_logger("sonar.runner")

DEFAULT_CPU_KV_BYTES = 2 * 2**30


class UnknownRequestError(RuntimeError):
    """A step names a request this runner was never given (a step meant for a predecessor)."""


@dataclass
class _RequestState:
    params: SamplingParams
    prompt: list[int]
    output: list[int]
    plain_greedy: bool = False
    """`is_plain_greedy(params)`, computed once: such rows skip building a `SamplingBatch`."""


def kv_bytes_per_block(model: Any, block_size: int, dtype: torch.dtype) -> int:
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * model.num_layers * block_size * model.num_kv_heads * model.head_dim * element


def plan_kv_cache(config: EngineConfig, loaded: LoadedModel) -> tuple[int, int]:
    """(number of KV blocks, max model length) from the flags, the model and the memory."""
    per_block = kv_bytes_per_block(loaded.model, config.block_size, loaded.dtype)
    if config.num_gpu_blocks_override is not None:
        num_blocks = config.num_gpu_blocks_override
    elif config.kv_cache_memory_bytes is not None:
        num_blocks = config.kv_cache_memory_bytes // per_block
    else:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        num_blocks = min(DEFAULT_CPU_KV_BYTES, total // 10) // per_block
    if num_blocks < 1:
        raise ValueError(f"the KV cache holds no block of {per_block} bytes; give it more memory")
    capacity = num_blocks * config.block_size
    model_len = loaded.max_model_len
    if config.max_model_len == -1:
        max_model_len = min(model_len, capacity)
        if max_model_len < model_len:
            log.warning("max_model_len reduced to fit the KV cache", max_model_len=max_model_len,
                        model_max=model_len)
    elif config.max_model_len is not None:
        if config.max_model_len > model_len:
            raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's maximum {model_len}")
        max_model_len = config.max_model_len
    else:
        max_model_len = model_len
    if max_model_len > capacity:
        if config.max_model_len is None:
            max_model_len = capacity
            log.warning("max_model_len reduced to fit the KV cache", max_model_len=max_model_len,
                        model_max=model_len)
        else:
            raise ValueError(
                f"max_model_len {max_model_len} needs {-(-max_model_len // config.block_size)} KV blocks but the "
                f"cache holds {num_blocks} ({capacity} tokens): lower max_model_len or give the KV cache more memory"
            )
    return num_blocks, max_model_len


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        """Load the weights and allocate the KV cache (slow: seconds)."""
        self.config = cfg = config
        self.requests: dict[str, _RequestState] = {}
        torch.manual_seed(cfg.seed)
        t0 = time.perf_counter()
        self.loaded = load_model(cfg.model, dtype=cfg.dtype, load_format=cfg.load_format,
                                 revision=cfg.revision, download_dir=cfg.download_dir)
        self.model = self.loaded.model
        t1 = time.perf_counter()
        self.num_blocks, self.max_model_len = plan_kv_cache(cfg, self.loaded)
        self.kv_caches = allocate_kv_caches(self.model.num_layers, self.num_blocks, cfg.block_size,
                                            self.model.num_kv_heads, self.model.head_dim, self.loaded.dtype)
        t2 = time.perf_counter()
        if not cfg.enforce_eager:  # enforce_eager: plain eager torch, the reference path
            prepack_linears(self.model)
        self._warm_up()
        t3 = time.perf_counter()
        kv_bytes = self.num_blocks * kv_bytes_per_block(self.model, cfg.block_size, self.loaded.dtype)
        self.vocab_size = int(self.loaded.config.vocab_size)
        self.eos_token_ids = self.loaded.eos_token_ids
        self.sampler = Sampler()
        tokenizer = cfg.tokenizer or (str(self.loaded.tokenizer_path) if self.loaded.tokenizer_path else None)
        self.info = WorkerInfo(
            model=self.loaded.source, architecture=self.loaded.architecture,
            dtype=str(self.loaded.dtype).removeprefix("torch."), num_blocks=self.num_blocks,
            block_size=cfg.block_size, max_model_len=self.max_model_len, vocab_size=self.vocab_size,
            eos_token_ids=self.eos_token_ids, kv_cache_memory_bytes=kv_bytes, tokenizer_path=tokenizer,
            pid=os.getpid(), startup_seconds={
                "weights": t1 - t0 - self.loaded.convert_seconds, "convert": self.loaded.convert_seconds,
                "kv_cache": t2 - t1, "warmup": t3 - t2,
            },
            num_layers=self.model.num_layers, num_kv_heads=self.model.num_kv_heads, head_dim=self.model.head_dim,
        )
        log.info("kv cache allocated", blocks=self.num_blocks, block_size=cfg.block_size,
                 tokens=self.num_blocks * cfg.block_size, max_model_len=self.max_model_len,
                 reproduce_with=f"--kv-cache-memory-bytes {kv_bytes}", size=format_memory_size(kv_bytes))

    @torch.inference_mode()
    def execute(self, msg: ExecuteStep) -> StepResult:
        started = time.perf_counter()
        out = msg.output
        for rid in out.finished_req_ids:
            self.requests.pop(rid, None)
        for rid in out.preempted_req_ids:
            self.requests.pop(rid, None)
        for new in msg.new_requests:
            self.requests[new.req_id] = _RequestState(new.params, new.prompt_token_ids, list(new.output_token_ids),
                                                      is_plain_greedy(new.params))
        unknown = [s.req_id for s in out.requests if s.req_id not in self.requests]
        if unknown:
            raise UnknownRequestError(f"step {out.step_id} names request(s) this worker does not hold: {unknown[:3]}")
        result = StepResult(step_id=out.step_id, sampled={})
        if not out.requests:
            return result
        ids: list[int] = []
        positions: list[int] = []
        q_lens: list[int] = []
        s_lens: list[int] = []
        tables: list[list[int]] = []
        sample_rows: list[int] = []
        sample_ids: list[str] = []
        prompt_rows: list[tuple[str, int, int, int]] = []  # (req, first row, rows, start position)
        for sched in out.requests:
            n = len(sched.token_ids)
            first = len(ids)
            ids += sched.token_ids
            positions += range(sched.start_pos, sched.start_pos + n)
            q_lens.append(n)
            s_lens.append(sched.start_pos + n)
            tables.append(sched.block_ids)
            state = self.requests[sched.req_id]
            if state.params.prompt_logprobs is not None and sched.start_pos < sched.num_prompt_tokens:
                rows = min(n, sched.num_prompt_tokens - sched.start_pos)
                prompt_rows.append((sched.req_id, first, rows, sched.start_pos))
            if sched.sample:
                sample_rows.append(len(ids) - 1)
                sample_ids.append(sched.req_id)
        meta = AttentionMetadata.build(q_lens, s_lens, tables, self.config.block_size)
        hidden = self.model(torch.tensor(ids), torch.tensor(positions), self.kv_caches, meta)
        for rid, first, rows, start in prompt_rows:
            result.prompt_logprobs[rid] = self._prompt_logprobs(hidden[first:first + rows], rid, start)
        if sample_rows:
            # a pure decode step samples every row: no gather of the rows needed
            rows = hidden if len(sample_rows) == hidden.shape[0] else hidden[torch.tensor(sample_rows)]
            logits = self.model.compute_logits(rows)[:, : self.vocab_size]
            states = [self.requests[rid] for rid in sample_ids]
            if all(s.plain_greedy for s in states):
                sampled = Sampler.greedy(logits)
            else:
                batch = SamplingBatch.build(
                    [s.params for s in states], [s.output for s in states], [s.prompt for s in states],
                    vocab_size=self.vocab_size, eos_token_ids=self.eos_token_ids,
                )
                sampled = self.sampler(logits, batch)
            tokens = sampled.sampled_token_ids.tolist()
            for i, (rid, state, token) in enumerate(zip(sample_ids, states, tokens)):
                state.output.append(token)
                result.sampled[rid] = [token]
                if state.params.logprobs is not None and sampled.logprobs is not None:
                    result.logprobs[rid] = [_row(sampled.logprobs, i, state.params.logprobs)]
        result.seconds = time.perf_counter() - started
        return result

    @torch.inference_mode()
    def _warm_up(self) -> None:
        """One short prefill and one decode step through the model on the first KV block, so
        the first request does not pay one-time costs (oneDNN primitive creation, first touch
        of the weights and of the thread pool). Nothing is cached in block 0 yet: the scheduler
        overwrites whatever this writes before any attention reads it."""
        block = self.config.block_size
        n = min(block, self.max_model_len)
        for q_len, s_len in ((n, n), (1, n)):
            meta = AttentionMetadata.build([q_len], [s_len], [[0]], block)
            ids = torch.zeros(q_len, dtype=torch.int64)
            positions = torch.arange(s_len - q_len, s_len)
            hidden = self.model(ids, positions, self.kv_caches, meta)
            self.model.compute_logits(hidden[-1:]).argmax(dim=-1)

    def _prompt_logprobs(self, hidden: torch.Tensor, rid: str, start: int) -> list[TokenLogprobs | None]:
        """Logprobs of prompt tokens start+1 .. start+rows (row t predicts token t+1)."""
        state = self.requests[rid]
        prompt = state.prompt
        rows = hidden.shape[0]
        last = min(start + rows, len(prompt) - 1)  # the last prompt position predicts no prompt token
        out: list[TokenLogprobs | None] = [None] if start == 0 else []
        if last > start:
            logits = self.model.compute_logits(hidden[: last - start])[:, : self.vocab_size]
            targets = torch.tensor(prompt[start + 1 : last + 1])
            n = state.params.prompt_logprobs or 0
            lp = compute_prompt_logprobs(logits, targets, n)
            out += [_row(lp, i, n) for i in range(last - start)]
        return out


def _row(lp: LogprobsTensors, i: int, n: int) -> TokenLogprobs:
    return TokenLogprobs(
        token_ids=lp.token_ids[i, : 1 + n].tolist(),
        logprobs=lp.logprobs[i, : 1 + n].tolist(),
        rank=int(lp.ranks[i]),
    )
