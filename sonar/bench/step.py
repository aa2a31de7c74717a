"""`python -m sonar.bench.step`: what one model-runner step costs, without actors or HTTP.

Builds a `ModelRunner` and drives `execute` with synthetic scheduler outputs: a prefill of
``--batch`` random prompts of ``--prompt-len`` tokens (``--prefill-chunk`` tokens per step at
most, like the scheduler's token budget; decodes of prefilled requests go first), then
``--decode-steps`` decode steps of the whole batch. Prints the median and mean time per step of each phase, the output tokens/s the decode
steps alone would give, and the physical floor of a decode step on this machine (weights read
once per step at ``--bandwidth`` GB/s (measured here when not given: `sonar.bench.bandwidth`), or the FLOPs at ``--flops`` GFLOP/s, whichever is larger; a
mixture-of-experts model reads only the experts its tokens are routed to: `step_weights`).
``--profile`` adds a torch profiler table of a few decode steps. ``--compare-eager`` times
prefill and decode steps alternating between the prepacked linears and plain ``nn.Linear``
layers on the same weights (what ``--enforce-eager`` serves) and prints both and their ratio.
``--compare-fused`` times decode steps alternating between the native layer loop
(`sonar.models.fused`, the default on CPU) and the per-op path.
``--compare-lora N`` serves with ``--enable-lora --max-loras N`` and times decode steps alternating
between a batch of base-model requests and one whose requests use N random adapters of rank
``--lora-rank`` (every projection; row ``i`` adapter ``i mod N``), each batch its own requests and
KV blocks, and prints both and their ratio (the kernels' share of a step, without the server).
``--compare-compiled`` loads a second copy of the weights, compiles its forward pass with
`sonar.engine.compile.compile_forward` (cache under ``--compile-cache-root``, default
``$SONAR_CACHE_ROOT``), warms it up on decode sizes 1 and ``--batch`` and on a
``--prefill-chunk`` prefill before the timed steps, prints the compile seconds and the cache's
hits and misses, then times prefill and decode steps alternating between the default (prepacked,
eager) model and the compiled one over the same KV cache.

usage: python -m sonar.bench.step [--model PATH [--load-format dummy]] [--batch 16] [--prompt-len 128] [--decode-steps 32]
       [--dtype bfloat16] [--threads 2] [--enforce-eager] [--profile] [--compare-eager] [--compare-fused]
       [--compare-compiled [--compile-cache-root DIR]] [--compare-lora N [--lora-rank 16]]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from sonar.bench.bandwidth import read_bandwidth_gbs
from sonar.core.outputs import ScheduledRequest, SchedulerOutput
from sonar.core.request import LoRARequest
from sonar.engine.config import EngineConfig
from sonar.engine.runner import ModelRunner
from sonar.kernels.linear import PackedLinear, prepack_linears
from sonar.lora.adapter import LoRAWeights
from sonar.models.loader import load_model
from sonar.models.moe import QuantizedExperts, SparseMoeBlock
from sonar.protocol.engine import ExecuteStep, NewRequestData
from sonar.sampling_params import SamplingParams


class StepDriver:
    """Feeds a runner the steps a scheduler would send for one static batch (no preemption)."""

    def __init__(
        self,
        runner: ModelRunner,
        batch: int,
        prompt_len: int,
        seed: int = 0,
        *,
        blocks: list[int] | None = None,
        name: str = "r",
        loras: list[LoRARequest | None] | None = None,
    ) -> None:
        """`blocks`: the KV blocks this driver's requests may use (default: all); `name`: the
        prefix of its request ids; `loras`: each request's adapter (default: none)."""
        self.runner = runner
        self.block_size = runner.config.block_size
        gen = torch.Generator().manual_seed(seed)
        vocab = runner.vocab_size
        self.prompts = [torch.randint(1, vocab, (prompt_len,), generator=gen).tolist() for _ in range(batch)]
        self.computed = [0] * batch
        self.last = [0] * batch
        self.blocks: list[list[int]] = [[] for _ in range(batch)]
        self.free = list(range(runner.num_blocks)) if blocks is None else list(blocks)
        self.name = name
        self.loras = loras or [None] * batch
        self.step_id = 0
        self.params = SamplingParams(max_tokens=1 << 20, temperature=0.0, ignore_eos=True)
        self.elapsed = 0.0
        #: per request, the driver's elapsed seconds when the step that finished its prompt ended
        self.first_token: dict[int, float] = {}

    def _grow(self, i: int, length: int) -> None:
        while len(self.blocks[i]) * self.block_size < length:
            self.blocks[i].append(self.free.pop())

    def step(self, budget: int) -> float:
        """One step of at most `budget` tokens: decodes first, then prefill chunks. Seconds it took."""
        reqs: list[ScheduledRequest] = []
        new: list[NewRequestData] = []
        for i, prompt in enumerate(self.prompts):
            if budget <= 0:
                break
            start = self.computed[i]
            if start < len(prompt):
                tokens = prompt[start : start + budget]
            else:
                tokens = [self.last[i]]
            n = len(tokens)
            self._grow(i, start + n)
            is_new = start == 0
            req_id = f"{self.name}{i}"
            reqs.append(
                ScheduledRequest(
                    req_id, tokens, start, list(self.blocks[i]), start + n >= len(prompt), is_new, len(prompt)
                )
            )
            if is_new:
                new.append(NewRequestData(req_id, self.params, prompt, [], lora=self.loras[i]))
            budget -= n
        out = SchedulerOutput(self.step_id, reqs, sum(len(r.token_ids) for r in reqs), [], [])
        self.step_id += 1
        t = time.perf_counter()
        result = self.runner.execute(ExecuteStep(out, new))
        seconds = time.perf_counter() - t
        self.elapsed += seconds
        for r in reqs:
            i = int(r.req_id[len(self.name) :])
            self.computed[i] = r.start_pos + len(r.token_ids)
            if r.sample and i not in self.first_token:
                self.first_token[i] = self.elapsed
            if r.req_id in result.sampled:
                self.last[i] = result.sampled[r.req_id][-1]
        return seconds

    @property
    def prefilled(self) -> bool:
        return all(c >= len(p) for c, p in zip(self.computed, self.prompts))


def step_weights(model: torch.nn.Module, batch: int) -> tuple[float, float]:
    """The weights a decode step of `batch` tokens reads, and those each token multiplies. A dense
    model: all of them but an untied input embedding (looked up, not read whole), both. A mixture-of-experts layer reads only the experts its tokens are
    routed to — ``E (1 - (1 - k / E) ** batch)`` of them expected under uniform routing — and each
    token multiplies its `k`."""
    read = per_token = float(sum(p.numel() for p in model.parameters()))
    if not getattr(model, "tie_word_embeddings", True):  # a lookup reads one row per token, not the table
        read = per_token = read - model.model.embed_tokens.weight.numel()
    for module in model.modules():
        if isinstance(module, SparseMoeBlock) and not isinstance(module.experts, QuantizedExperts):
            # (quantized experts hold buffers, not parameters: not counted above either)
            experts, k = module.spec.num_experts, module.spec.top_k
            expert = (module.experts.gate_up_proj.numel() + module.experts.down_proj.numel()) / experts
            touched = experts * (1 - (1 - k / experts) ** batch)
            read -= (experts - touched) * expert
            per_token -= (experts - k) * expert
    return read, per_token


def decode_floor_ms(
    read: float, per_token: float, element_bytes: int, batch: int, bandwidth_gbs: float, gflops: float
) -> float:
    """The least time a decode step of `batch` tokens can take: read its weights once (`read` of
    them), or do 2 FLOPs per weight per token (`per_token` of them), whichever is slower."""
    read_s = read * element_bytes / (bandwidth_gbs * 1e9)
    compute_s = 2 * per_token * batch / (gflops * 1e9)
    return 1000 * max(read_s, compute_s)


class LinearSwitch:
    """Swaps every `PackedLinear` of a model for a plain ``nn.Linear`` on the same parameters
    and back (the packed weights are opaque oneDNN tensors: the model cannot be deep-copied)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.slots: list[tuple[torch.nn.Module, str, PackedLinear, torch.nn.Linear]] = []
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, PackedLinear):
                    child.restore_weight()  # for the plain layer; the packed one reads its copy
                    plain = torch.nn.Linear(
                        child.in_features, child.out_features, bias=child.bias is not None, device="meta"
                    )
                    plain.weight, plain.bias = child.weight, child.bias
                    self.slots.append((parent, name, child, plain))

    def packed(self, on: bool) -> None:
        for parent, name, packed, plain in self.slots:
            setattr(parent, name, packed if on else plain)


def compare_eager(runner: ModelRunner, driver: StepDriver, batch: int, steps: int) -> None:
    """Prefill and decode steps alternating between prepacked and plain linear layers."""
    switch = LinearSwitch(runner.model)
    variants = {"prepacked": True, "eager": False}
    times: dict[str, dict[str, list[float]]] = {k: {"prefill": [], "decode": []} for k in variants}
    for rep in range(3):
        for name, packed in variants.items():
            switch.packed(packed)
            driver.computed = [0] * len(driver.prompts)
            seconds = driver.step(batch * len(driver.prompts[0]))
            if rep:  # the first round pays one-time costs
                times[name]["prefill"].append(seconds)
    for _ in range(steps):
        for name, packed in variants.items():
            switch.packed(packed)
            times[name]["decode"].append(driver.step(batch))
    switch.packed(True)
    med = {k: {p: statistics.median(v) for p, v in t.items()} for k, t in times.items()}
    for name in variants:
        print(
            f"{name:9}: prefill {1000 * med[name]['prefill']:.0f} ms, decode {1000 * med[name]['decode']:.1f} ms "
            f"per step (medians, interleaved)"
        )
    print(
        f"prepacked / eager: prefill {med['prepacked']['prefill'] / med['eager']['prefill']:.2f}x, "
        f"decode {med['prepacked']['decode'] / med['eager']['decode']:.2f}x"
    )


def compare_fused(runner: ModelRunner, driver: StepDriver, batch: int, steps: int) -> None:
    """Decode steps alternating between the native layer loop (`sonar.models.fused`) and the
    per-op path on the same weights and KV cache."""
    fused = runner.model.fused_decode
    serves = fused.serves
    times: dict[str, list[float]] = {"fused": [], "per-op": []}
    for _ in range(steps):
        for name in times:
            fused.serves = serves if name == "fused" else (lambda *args: False)
            times[name].append(driver.step(batch))
    fused.serves = serves
    med = {k: statistics.median(v) for k, v in times.items()}
    for name, value in med.items():
        print(
            f"{name:6}: decode {1000 * value:.1f} ms (min {1000 * min(times[name]):.1f}) per step "
            f"(medians, interleaved)"
        )
    print(f"fused / per-op: decode {med['fused'] / med['per-op']:.2f}x")


def random_adapters(runner: ModelRunner, count: int, rank: int) -> list[LoRARequest]:
    """`count` adapters of rank `rank` on every projection (random A, B a tenth of A's scale, as
    a trained adapter's deltas are small), put in the worker's host memory as if read from disk."""
    slots = runner.lora
    assert slots is not None
    gen = torch.Generator().manual_seed(7)
    requests = []
    for k in range(count):
        factors = {
            (layer, module): (
                torch.randn(rank, fan_in, generator=gen) / fan_in**0.5,
                0.1 * torch.randn(fan_out, rank, generator=gen) / rank**0.5,
            )
            for layer in range(slots.shapes.num_layers)
            for module, (fan_in, fan_out) in slots.shapes.modules.items()
        }
        digest = f"bench-adapter-{k}"
        slots.host[digest] = LoRAWeights(factors, rank, digest)
        requests.append(LoRARequest(f"a{k}", "", digest))
    return requests


def compare_lora(runner: ModelRunner, batch: int, prompt_len: int, steps: int, adapters: int, rank: int) -> None:
    """Decode steps alternating between a batch of base-model requests and a batch whose rows use
    `adapters` random adapters, on the same runner (their own requests and KV blocks)."""
    loras = random_adapters(runner, adapters, rank)
    per_request = -(-(prompt_len + steps + 8) // runner.config.block_size)
    top = runner.num_blocks
    drivers = {}
    for k, name in enumerate(("base", "lora")):
        blocks = list(range(top - (k + 1) * batch * per_request, top - k * batch * per_request))
        rows = [loras[i % adapters] for i in range(batch)] if name == "lora" else None
        drivers[name] = StepDriver(runner, batch, prompt_len, seed=1, blocks=blocks, name=name, loras=rows)
        while not drivers[name].prefilled:
            drivers[name].step(batch * prompt_len)
    times: dict[str, list[float]] = {name: [] for name in drivers}
    for step in range(steps + 3):
        for name, driver in drivers.items():
            seconds = driver.step(batch)
            if step >= 3:  # the first steps write the adapters to their slots
                times[name].append(seconds)
    med = {k: statistics.median(v) for k, v in times.items()}
    for name, value in med.items():
        print(
            f"{name:4}: decode {1000 * value:.1f} ms (min {1000 * min(times[name]):.1f}) per step (medians, interleaved)"
        )
    print(
        f"{adapters} adapters of rank {rank} / base: decode {med['lora'] / med['base']:.2f}x the time "
        f"({med['base'] / med['lora']:.2f}x the tokens/s; mins {min(times['base']) / min(times['lora']):.2f}x)"
    )


class CompiledCopy:
    """A second copy of the runner's weights whose forward pass is compiled, to swap in for
    ``runner.model`` (same KV caches, same steps)."""

    def __init__(self, runner: ModelRunner, prefill_chunk: int, batch: int, cache_root: Path | None) -> None:
        from sonar.engine.compile import compile_forward

        cfg = runner.config
        self.model = load_model(
            cfg.model,
            dtype=cfg.dtype,
            load_format=cfg.load_format,
            revision=cfg.revision,
            download_dir=cfg.download_dir,
        ).model
        prepack_linears(self.model, keep_weights=True)  # as the runner does when it compiles
        key = {
            "model": runner.loaded.source,
            "revision": cfg.revision,
            "dtype": runner.info.dtype,
            "block_size": cfg.block_size,
        }
        t = time.perf_counter()
        self.forward = compile_forward(self.model, config_key_parts=key, cache_root=cache_root)
        self.manifest = self.forward.warm_up(runner.kv_caches, cfg.block_size, (1, batch, prefill_chunk))
        self.seconds = time.perf_counter() - t
        self.model.forward = self.forward


def compare_compiled(
    runner: ModelRunner, driver: StepDriver, compiled: CompiledCopy, batch: int, steps: int, prefill_chunk: int
) -> None:
    """Prefill chunks and decode steps alternating between the eager model and the compiled copy."""
    m = compiled.manifest
    print(
        f"compile + warm-up {compiled.seconds:.1f} s (token counts {m['token_counts']}): FX graph cache "
        f"{m['fxgraph_hit']} hit(s), {m['fxgraph_miss']} miss(es); {compiled.forward.directory}"
    )
    eager_model = runner.model
    variants = {"eager": eager_model, "compiled": compiled.model}
    times: dict[str, dict[str, list[float]]] = {k: {"prefill": [], "decode": []} for k in variants}
    for _ in range(3):
        for name, model in variants.items():
            runner.model = model
            driver.computed = [0] * len(driver.prompts)
            times[name]["prefill"].append(driver.step(prefill_chunk))
            while not driver.prefilled:
                driver.step(prefill_chunk)
    for _ in range(steps):
        for name, model in variants.items():
            runner.model = model
            times[name]["decode"].append(driver.step(batch))
    runner.model = eager_model
    med = {k: {p: statistics.median(v) for p, v in t.items()} for k, t in times.items()}
    low = {k: {p: min(v) for p, v in t.items()} for k, t in times.items()}
    for name in variants:
        print(
            f"{name:9}: first prefill step ({prefill_chunk} tokens max) {1000 * med[name]['prefill']:.0f} ms "
            f"(min {1000 * low[name]['prefill']:.0f}), decode {1000 * med[name]['decode']:.1f} ms "
            f"(min {1000 * low[name]['decode']:.1f}) per step (medians, interleaved)"
        )
    print(
        f"compiled / eager: prefill {med['compiled']['prefill'] / med['eager']['prefill']:.2f}x "
        f"(mins {low['compiled']['prefill'] / low['eager']['prefill']:.2f}x), "
        f"decode {med['compiled']['decode'] / med['eager']['decode']:.2f}x "
        f"(mins {low['compiled']['decode'] / low['eager']['decode']:.2f}x)"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sonar.bench.step", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model path or id (default: the embedded SmolLM2)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--load-format", default="auto", help="as serve's (dummy: random weights from a config.json alone)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--prefill-chunk", type=int, default=2048, help="tokens per step (the token budget)")
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--warmup-steps", type=int, default=3, help="decode steps not timed")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--profile", action="store_true", help="print a torch profiler table of decode steps")
    ap.add_argument(
        "--compare-eager", action="store_true", help="also time plain (not prepacked) linear layers, interleaved"
    )
    ap.add_argument(
        "--compare-fused",
        action="store_true",
        help="also time decode steps through the per-op path, interleaved with the native layer loop",
    )
    ap.add_argument(
        "--compare-compiled", action="store_true", help="also time a torch.compile'd copy of the model, interleaved"
    )
    ap.add_argument(
        "--compile-cache-root",
        type=Path,
        default=None,
        help="compile cache root for --compare-compiled (default: $SONAR_CACHE_ROOT)",
    )
    ap.add_argument(
        "--compare-lora",
        type=int,
        default=0,
        metavar="N",
        help="also time decode steps of requests using N random LoRA adapters against base-model ones, interleaved",
    )
    ap.add_argument("--lora-rank", type=int, default=16, help="the adapters' rank for --compare-lora")
    ap.add_argument(
        "--bandwidth",
        type=float,
        default=None,
        help="GB/s of weight reads (default: measured here after the timed steps, as `bench compare` does)",
    )
    ap.add_argument("--flops", type=float, default=390.0, help="GFLOP/s of bf16 matmul")
    args = ap.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    # each request decodes --decode-steps once, and twice more per comparison (once per variant)
    rounds = 1 + 2 * (args.compare_eager + args.compare_compiled + args.compare_fused)
    per_request = -(-(args.prompt_len + rounds * args.decode_steps + args.warmup_steps + 5 + 32) // 16)
    blocks = max(64, args.batch * per_request + 16, -(-args.prefill_chunk // 16) + 1)
    lora: dict[str, object] = {}
    if args.compare_lora:  # two more batches, each with blocks of its own
        blocks += 2 * args.batch * -(-(args.prompt_len + args.decode_steps + 8) // 16)
        lora = dict(enable_lora=True, max_loras=args.compare_lora, max_lora_rank=args.lora_rank)
    config = EngineConfig.from_args(
        args.model,
        dtype=args.dtype,
        load_format=args.load_format,
        enforce_eager=args.enforce_eager,
        num_gpu_blocks_override=blocks,
        **lora,
    )
    t0 = time.perf_counter()
    runner = ModelRunner(config)
    print(f"runner ready in {time.perf_counter() - t0:.1f} s: {runner.info.startup_seconds}")
    compiled = None
    if args.compare_compiled:  # before any step: its warm-up writes the first KV blocks
        compiled = CompiledCopy(runner, args.prefill_chunk, args.batch, args.compile_cache_root)
    driver = StepDriver(runner, args.batch, args.prompt_len)
    prefill: list[float] = []
    while not driver.prefilled:
        prefill.append(driver.step(args.prefill_chunk))
    for _ in range(args.warmup_steps):
        driver.step(args.batch)
    decode = [driver.step(args.batch) for _ in range(args.decode_steps)]
    read, per_token = step_weights(runner.model, args.batch)
    element = runner.loaded.dtype.itemsize
    bandwidth = args.bandwidth or read_bandwidth_gbs(threads=args.threads)
    floor = decode_floor_ms(read, per_token, element, args.batch, bandwidth, args.flops)
    med = statistics.median(decode)
    print(
        f"threads {torch.get_num_threads()}, dtype {runner.info.dtype}, batch {args.batch}, "
        f"prompt {args.prompt_len}, eager {args.enforce_eager}; weights read per decode step "
        f"{read * element / 1e9:.2f} GB ({read / 1e6:.0f} M)"
    )
    print(
        f"prefill: {len(prefill)} step(s), {1000 * sum(prefill):.0f} ms total "
        f"({args.batch * args.prompt_len / sum(prefill):.0f} prompt tok/s), mean time to first token "
        f"{1000 * statistics.mean(driver.first_token.values()):.0f} ms"
    )
    print(
        f"decode: median {1000 * med:.1f} ms, mean {1000 * statistics.mean(decode):.1f} ms, "
        f"min {1000 * min(decode):.1f} ms per step -> {args.batch / med:.0f} tok/s; "
        f"floor {floor:.1f} ms at {bandwidth:.1f} GB/s{'' if args.bandwidth else ' measured'} "
        f"({floor / (1000 * med):.0%} of it reached)"
    )
    if args.compare_eager:
        compare_eager(runner, driver, args.batch, args.decode_steps)
    if args.compare_fused:
        compare_fused(runner, driver, args.batch, args.decode_steps)
    if args.compare_lora:
        compare_lora(runner, args.batch, args.prompt_len, args.decode_steps, args.compare_lora, args.lora_rank)
    if compiled is not None:
        compare_compiled(runner, driver, compiled, args.batch, args.decode_steps, args.prefill_chunk)
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(5):
                driver.step(args.batch)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
