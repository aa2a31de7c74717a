"""The worker's adapter table (`sonar.lora.slots`): what a slot holds, which slot an adapter gets,
where an evicted adapter comes back from (host memory, else its folder), and the wrapped layers'
output row by row."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from sonar.core.request import LoRARequest
from sonar.errors import LoRAError
from sonar.lora.adapter import file_digest, read_adapter
from sonar.lora.limits import LoRALimits, ModelShapes
from sonar.lora.slots import AdapterSlots
from sonar.models.loader import load_model
from sonar.models.lora import LoRALinear
from tests.lora.conftest import Tiny, make_adapter

RANK = 16


def _table(tiny: Tiny, max_loras: int, max_cpu_loras: int, **limits: Any) -> AdapterSlots:
    loaded = load_model(str(tiny.path), dtype="float32")
    return AdapterSlots(
        loaded.model,
        max_loras=max_loras,
        max_cpu_loras=max_cpu_loras,
        limits=LoRALimits(RANK, **limits),
        shapes=ModelShapes.of_config(loaded.config),
        dtype=torch.float32,
        device=torch.device("cpu"),
    )


def _request(name: str, folder: Path) -> LoRARequest:
    return LoRARequest(name, str(folder), file_digest(folder))


def test_a_slot_holds_each_projection_padded_to_the_max_rank(tiny_qwen3: Tiny) -> None:
    table = _table(tiny_qwen3, max_loras=2, max_cpu_loras=2)
    built = tiny_qwen3.adapters["all"]
    where, failed = table.activate([_request("all", built.path)])
    assert not failed
    slot = where[file_digest(built.path)]
    weights = read_adapter(built.path, table.shapes, table.limits)
    layer = table.model.model.layers[1]
    qkv, down = layer.self_attn.qkv_proj, layer.mlp.down_proj
    assert isinstance(qkv, LoRALinear) and qkv.splits == (128, 64, 64)
    a_k, b_k = weights.factors[(1, "k_proj")]
    assert torch.equal(qkv.a[slot, RANK : RANK + 8], a_k)
    assert not qkv.a[slot, RANK + 8 : 2 * RANK].any()  # rank 8 of 16: zero padding
    assert torch.equal(qkv.b[slot, 128:192, :8], b_k)
    a_down, b_down = weights.factors[(1, "down_proj")]
    assert torch.equal(down.a[slot, :8], a_down) and torch.equal(down.b[slot, :, :8], b_down)
    assert not qkv.a[1 - slot].any()  # the other slot is still empty


def test_evicted_adapters_come_back_from_host_memory_then_from_disk(tiny_qwen3: Tiny, tmp_path: Path) -> None:
    folders = {}
    for name in ("x", "y", "z"):  # copies: these tests delete them
        folders[name] = tmp_path / name
        shutil.copytree(tiny_qwen3.adapters["all" if name != "y" else "mlp"].path, folders[name])
    make_adapter(tiny_qwen3.hf, folders["z"], seed=99)  # another adapter's content
    x, y, z = (_request(name, folders[name]) for name in ("x", "y", "z"))
    table = _table(tiny_qwen3, max_loras=1, max_cpu_loras=2)
    table.activate([x])
    table.activate([y])  # x leaves the one slot but stays in host memory
    assert table.slots == [y.digest] and list(table.host) == [x.digest, y.digest]
    shutil.rmtree(folders["x"])
    table.activate([x])  # from host memory: its folder is gone
    assert table.slots == [x.digest]
    table.activate([z])  # host memory keeps two: y, the least recently used, goes
    assert list(table.host) == [x.digest, z.digest]
    shutil.rmtree(folders["y"])
    where, failed = table.activate([y])  # lost: z keeps the slot
    assert not where and list(failed) == [y.digest] and table.slots == [z.digest]
    assert "is not a directory" in str(failed[y.digest])


def test_a_folder_rewritten_since_loading_is_refused(tiny_qwen3: Tiny, tmp_path: Path) -> None:
    folder = tmp_path / "a"
    shutil.copytree(tiny_qwen3.adapters["all"].path, folder)
    stale = _request("a", folder)
    make_adapter(tiny_qwen3.hf, folder, seed=5)
    table = _table(tiny_qwen3, max_loras=1, max_cpu_loras=1)
    where, failed = table.activate([stale])
    assert not where and isinstance(failed[stale.digest], LoRAError)
    assert "changed since it was loaded (their digest differs)" in str(failed[stale.digest])


def test_more_adapters_than_slots_is_refused(tiny_qwen3: Tiny) -> None:
    table = _table(tiny_qwen3, max_loras=1, max_cpu_loras=2)
    both = [_request(name, built.path) for name, built in tiny_qwen3.adapters.items()]
    with pytest.raises(ValueError, match="a step uses 2 LoRA adapters; --max-loras is 1"):
        table.activate(both)


def test_slots_stay_with_their_adapter_and_the_least_recent_is_replaced(tiny_qwen3: Tiny, tmp_path: Path) -> None:
    requests = []
    for i in range(3):
        make_adapter(tiny_qwen3.hf, tmp_path / str(i), seed=20 + i)
        requests.append(_request(str(i), tmp_path / str(i)))
    table = _table(tiny_qwen3, max_loras=2, max_cpu_loras=3)
    first, _ = table.activate(requests[:2])
    assert table.activate(requests[1:2]) == ({requests[1].digest: first[requests[1].digest]}, {})
    third, _ = table.activate(requests[2:])  # replaces adapter 0, used longest ago
    assert third[requests[2].digest] == first[requests[0].digest]


def test_target_modules_wrap_only_those_layers(tiny_qwen3: Tiny, tmp_path: Path) -> None:
    table = _table(tiny_qwen3, max_loras=1, max_cpu_loras=1, target_modules=frozenset({"o_proj", "up_proj"}))
    layer = table.model.model.layers[0]
    assert isinstance(layer.self_attn.o_proj, LoRALinear) and isinstance(layer.mlp.gate_up_proj, LoRALinear)
    assert not isinstance(layer.self_attn.qkv_proj, LoRALinear) and not isinstance(layer.mlp.down_proj, LoRALinear)
    make_adapter(tiny_qwen3.hf, tmp_path / "up", seed=8, target_modules=["up_proj", "o_proj"])
    where, failed = table.activate([_request("up", tmp_path / "up")])
    assert not failed
    gate_up = layer.mlp.gate_up_proj
    slot = where[file_digest(tmp_path / "up")]
    assert not gate_up.a[slot, :RANK].any() and gate_up.a[slot, RANK:].any()  # up, not gate
    _, failed = table.activate([_request("all", tiny_qwen3.adapters["all"].path)])
    assert "the server applies adapters only to o_proj, up_proj" in str(next(iter(failed.values())))


def test_each_row_gets_its_own_slots_delta(tiny_qwen3: Tiny) -> None:
    table = _table(tiny_qwen3, max_loras=2, max_cpu_loras=2)
    requests = [_request(name, built.path) for name, built in tiny_qwen3.adapters.items()]
    where, _ = table.activate(requests)
    weights = [read_adapter(built.path, table.shapes, table.limits) for built in tiny_qwen3.adapters.values()]
    gate_up = table.model.model.layers[0].mlp.gate_up_proj
    x = torch.randn(5, 64)
    slots = [where[requests[0].digest], -1, where[requests[1].digest], where[requests[0].digest], -1]
    with table.context.step(slots):
        y = gate_up(x)
    base = gate_up.base(x)
    for row, slot in enumerate(slots):
        expected = base[row].clone()
        if slot >= 0:
            factors = weights[0 if slot == where[requests[0].digest] else 1].factors
            for j, module in enumerate(("gate_proj", "up_proj")):
                a, b = factors[(0, module)]
                expected[j * 128 : (j + 1) * 128] += b @ (a @ x[row])
        torch.testing.assert_close(y[row], expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(gate_up(x), base)  # outside a step: the base layer alone
