"""Memory planner: exact placements, refusals and LRU evictions for tables of budgets."""

import pytest
import torch

from mizuoto.runtime.engine import Stage
from mizuoto.errors import InvalidRequest, MemoryBudgetError
from mizuoto.runtime.memory import (Eviction, Pool, StageSize, format_bytes, measure, parse_bytes, plan_model,
                                    tensor_bytes)

M = 2**20

# A CosyVoice-shaped model, sizes in MiB: weights, fixed, working.
STAGES = (
    StageSize("frontend", "frontend", 1 * M, 0, 1 * M),
    StageSize("lm", "sequence", 4 * M, 0, 2 * M),
    StageSize("flow", "frames", 2 * M, 0, 1 * M),
    StageSize("hift", "frames", 1 * M, 1 * M, 1 * M),
)

# budget MiB, stream -> (pinned stages, turn groups, peak MiB); None: refused
PLANS = [
    (64, False, (("frontend", "lm", "flow", "hift"), 11)),   # plenty: all resident
    (11, False, (("frontend", "lm", "flow", "hift"), 11)),   # exactly fits all-resident
    (10, False, (("frontend", "lm", "hift"), 10)),           # flow takes turns; the rest pinned
    (8, False, (("frontend",), 8)),                          # only the frontend can stay
    (7, False, ((), 7)),                                     # every stage takes its turn
    (6, False, None),                                        # the LM alone does not fit
    (13, True, (("frontend", "lm", "flow", "hift"), 13)),    # streaming, all resident
    (12, True, (("lm", "flow", "hift"), 12)),                # streaming group co-resident, frontend turns
    (11, True, None),                                        # fits non-streaming, refused streaming
    (0, False, None),
]


@pytest.mark.parametrize("budget,stream,expected", PLANS)
def test_plan_table(budget, stream, expected):
    if expected is None:
        with pytest.raises(MemoryBudgetError) as e:
            plan_model("cv", STAGES, budget * M, "cuda", stream)
        msg = str(e.value)
        # The refusal names every stage's bytes and the budget.
        assert format_bytes(budget * M) in msg
        for s in STAGES:
            assert s.name in msg and format_bytes(s.weights + s.fixed) in msg
        if stream:
            assert "streaming keeps lm+flow+hift together" in msg
        return
    pinned, peak = expected
    plan = plan_model("cv", STAGES, budget * M, "cuda", stream)
    assert plan.pinned == pinned
    assert plan.peak == peak * M
    assert plan.peak <= plan.budget
    assert plan.strategy == ("resident" if len(pinned) == 4 else "turns")
    groups = (("frontend",), ("lm", "flow", "hift")) if stream else tuple((s.name,) for s in STAGES)
    assert plan.groups == groups
    assert plan.fixed == 1 * M and plan.movable == 8 * M
    assert plan.waiting == sum(s.weights for s in STAGES if s.name not in pinned)


def test_plan_group_of_and_table():
    plan = plan_model("cv", STAGES, 12 * M, "cuda", stream=True)
    assert plan.group_of("frontend") == ("lm", "flow", "hift", "frontend")
    assert plan.group_of("flow") == ("lm", "flow", "hift")
    text = plan.table()
    assert "turns" in text and "frontend" in text and "turn frontend" in text
    with pytest.raises(InvalidRequest):
        plan.group_of("nope")


def _pool_run(pool, ops):
    out = []
    for op in ops:
        name, need = op[0], op[1]
        kw = dict(zip(("fixed", "host", "reserve"), op[2:]))
        out += pool.admit(name, need * M, **{k: v * M for k, v in kw.items()})
    return out


# (device MiB, host MiB or None, admissions (name, need, fixed, host, reserve)) -> (evictions, states)
POOLS = [
    # three models of 4 on 10: the least recently used is offloaded
    (10, 20, [("a", 4, 0, 4), ("b", 4, 0, 4), ("c", 4, 0, 4)],
     [("a", "offload")], {"a": "host", "b": "device", "c": "device"}),
    # using b again makes c the least recently used
    (10, 20, [("a", 4, 0, 4), ("b", 4, 0, 4), ("c", 4, 0, 4), ("b", 4, 0, 4), ("d", 6, 0, 6)],
     [("a", "offload"), ("c", "offload")], {"a": "host", "b": "device", "c": "host", "d": "device"}),
    # host full: the LRU offloaded model is unloaded to make host room, then the next is offloaded
    (10, 5, [("a", 4, 0, 4), ("b", 4, 0, 4), ("c", 4, 0, 4), ("d", 4, 0, 4)],
     [("a", "offload"), ("a", "unload"), ("b", "offload")], {"c": "device", "d": "device", "b": "host"}),
    # no host room at all: the victim itself is unloaded
    (10, 1, [("a", 6, 0, 6), ("b", 6, 0, 6)], [("a", "unload")], {"b": "device"}),
    # fixed modules never move: an offloaded model keeps them on the device until it is unloaded
    (10, 30, [("a", 6, 2, 4), ("b", 6, 0, 6), ("c", 4, 0, 4), ("d", 8, 0, 8), ("e", 9, 0, 9)],
     [("a", "offload"), ("b", "offload"), ("c", "offload"), ("d", "offload"), ("a", "unload")],
     {"b": "host", "c": "host", "d": "host", "e": "device"}),
    # CPU: the device is the host, so eviction unloads
    (10, None, [("a", 6), ("b", 6)], [("a", "unload")], {"b": "device"}),
    # ...and with less host memory, the offloaded model that held it goes first
    (10, 20, [("a", 6, 2, 4), ("b", 6, 0, 6), ("c", 4, 0, 4), ("d", 8, 0, 8), ("e", 9, 0, 9)],
     [("a", "offload"), ("b", "offload"), ("c", "offload"), ("a", "unload"), ("d", "offload")],
     {"b": "host", "c": "host", "d": "host", "e": "device"}),
    # a model taking turns reserves host memory for its waiting stages: offloaded models make way
    (10, 8, [("a", 4, 0, 4, 0), ("b", 4, 0, 4, 0), ("c", 6, 0, 8, 5)],
     [("a", "offload"), ("a", "unload")], {"b": "device", "c": "device"}),
]


@pytest.mark.parametrize("device,host,ops,evictions,states", POOLS)
def test_pool_table(device, host, ops, evictions, states):
    pool = Pool(device * M, host * M if host is not None else None)
    got = _pool_run(pool, ops)
    assert got == [Eviction(n, a) for n, a in evictions]
    assert {n: pool.state(n) for n in pool.order()} == states
    dev, used_host = pool.used()
    assert dev <= pool.device_budget
    assert host is None or used_host <= host * M


def test_pool_refusals():
    with pytest.raises(MemoryBudgetError, match="needs 11.00 MiB on the device; the budget is 10.00 MiB"):
        Pool(10 * M, 20 * M).admit("big", 11 * M)
    pool = Pool(10 * M, 20 * M)
    pool.admit("a", 6 * M)
    with pytest.raises(MemoryBudgetError, match="held by a"):
        pool.admit("b", 6 * M, busy={"a"})
    assert pool.order() == ["a"]
    pool = Pool(10 * M, 5 * M)
    pool.admit("a", 4 * M, reserve=3 * M)
    with pytest.raises(MemoryBudgetError, match="host memory"):
        pool.admit("b", 4 * M, reserve=3 * M, busy={"a"})


def test_pool_readmit_and_release():
    pool = Pool(10 * M, 20 * M)
    assert pool.admit("a", 4 * M) == []
    assert pool.admit("a", 4 * M) == []
    assert pool.used() == (4 * M, 0)
    pool.release("a")
    assert pool.order() == [] and pool.state("a") is None


@pytest.mark.parametrize("text,expected", [
    ("6GiB", 6 * 2**30), ("512MB", 512 * 10**6), ("1.5 GiB", 3 * 2**29), ("4096", 4096), (1024, 1024),
    ("10kib", 10240), ("2 TB", 2 * 10**12),
])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["", "6 GiBs", "-1GiB", "lots", "1e9", None, True, -5])
def test_parse_bytes_rejects(bad):
    with pytest.raises(InvalidRequest):
        parse_bytes(bad)


def test_tensor_bytes_counts_each_tensor_once_at_load_dtype():
    emb = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = emb.weight  # tied, as an LM head often is
    counter = torch.nn.Module()
    counter.register_buffer("steps", torch.zeros(3, dtype=torch.int64))
    assert tensor_bytes([emb, head, counter]) == 40 * 4 + 3 * 8
    assert tensor_bytes([emb, head, counter], torch.float16) == 40 * 2 + 3 * 8


def test_measure_counts_fixed_only_on_its_device():
    moving = torch.nn.Linear(4, 4)            # 80 bytes
    fixed_here = torch.nn.Linear(2, 2)        # 24 bytes, on the CPU
    fixed_away = torch.nn.Linear(3, 3, device="meta")  # 48 bytes, elsewhere
    stage = Stage("s", "frames", {"m": moving, "f": fixed_here, "g": fixed_away}, fixed={"f", "g"},
                  memory=lambda r: 7)
    assert measure([stage], None, "cpu") == (StageSize("s", "frames", 80, 24, 7),)
    assert measure([stage], None, None) == (StageSize("s", "frames", 80, 72, 7),)
