"""The replicated fast tier's pure planning layer (issue 28): ring, settings agreement,
the holder table's choice, fetch and re-replication plans. Property tests over
simulated jobs: n nodes of k ranks, each node's parts replicated to its ring."""
from __future__ import annotations

import os
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dckpt.errors import CheckpointError
from dckpt.tiers.peers.plan import (Choice, HoldReport, Settings, StepHolding, check_settings,
                                  replication_plan, schedule,
                                  choose, complete_steps, fetch_plan, rereplicate, ring)


def _n(k: int) -> int:
    return k * int(os.environ.get("DCKPT_TEST_EXAMPLES", "1"))


def node_id(i: int) -> str:
    return f"n{i:02d}"


def rank_nodes(n: int, k: int) -> dict[int, str]:
    return {r: node_id(r // k) for r in range(n * k)}


def held_after_save(n: int, k: int, replicas: int, dropped: set[tuple[int, str]] = frozenset()
                    ) -> dict[str, set[int]]:
    """{node: parts it holds} after a save of n*k ranks replicated on the ring; the
    (part, node) pairs in ``dropped`` are replicas that never arrived."""
    rn = rank_nodes(n, k)
    succ, _ = ring(rn.values(), replicas)
    held: dict[str, set[int]] = {node_id(i): set() for i in range(n)}
    for p, home in rn.items():
        held[home].add(p)
        for d in succ[home]:
            if (p, d) not in dropped:
                held[d].add(p)
    return held


def reports_for(steps: list[tuple[int, str, float, int, dict[str, dict[int, bool]]]],
                n: int, k: int, rnd: random.Random) -> list[HoldReport]:
    """Every rank's report: each (node, step, part) is reported by a random rank of its
    node (sometimes by two), in a random order."""
    per_rank: dict[int, dict[tuple, list]] = {r: {} for r in range(n * k)}
    for step, sid, created, world, by_node in steps:
        for node, parts in by_node.items():
            ranks = [r for r, v in rank_nodes(n, k).items() if v == node]
            for p, ver in parts.items():
                for r in rnd.sample(ranks, rnd.choice([1, min(2, len(ranks))])):
                    per_rank[r].setdefault((step, sid, created, world), []).append((p, ver))
    out = []
    for r, d in per_rank.items():
        hs = [StepHolding(s, sid, c, w, tuple(rnd.sample(ps, len(ps))))
              for (s, sid, c, w), ps in d.items()]
        out.append(HoldReport(r, node_id(r // k), tuple(rnd.sample(hs, len(hs)))))
    rnd.shuffle(out)
    return out


def verified(held: dict[str, set[int]]) -> dict[str, dict[int, bool]]:
    return {node: {p: True for p in parts} for node, parts in held.items()}


jobs = st.tuples(st.integers(2, 6), st.integers(1, 3))  # (nodes, ranks per node)


@settings(max_examples=_n(150), deadline=None)
@given(jobs, st.data())
def test_one_node_lost_every_fully_replicated_step_is_chosen(job, data):
    n, k = job
    rnd = random.Random(data.draw(st.integers(0, 2**32 - 1)))
    world = n * k
    steps, full = [], []
    for i in range(data.draw(st.integers(1, 4))):
        complete = data.draw(st.booleans())
        dropped = set() if complete else {(data.draw(st.integers(0, world - 1)),
                                           node_id(data.draw(st.integers(0, n - 1))))}
        held = held_after_save(n, k, 1, dropped)
        steps.append(((i + 1) * 10, f"s{i}", 100.0 + i, world, verified(held)))
        if complete:
            full.append((i + 1) * 10)
    lost = node_id(data.draw(st.integers(0, n - 1)))
    alive = [node_id(i) for i in range(n) if node_id(i) != lost]
    reports = [r for r in reports_for(steps, n, k, rnd) if r.node != lost]
    got = complete_steps(reports, alive)
    assert set(full) <= {c.step for c in got}
    assert [c.step for c in got] == sorted((c.step for c in got), reverse=True)
    if full:
        assert choose(reports, alive).step >= max(full)
        for c in got:  # every part held only by survivors, verified
            assert all(h and lost not in h for h in c.holders) and len(c.holders) == world


@settings(max_examples=_n(100), deadline=None)
@given(st.integers(3, 6), st.integers(1, 3), st.data())
def test_two_adjacent_nodes_lost_with_one_replica_is_not_chosen(n, k, data):
    rnd = random.Random(data.draw(st.integers(0, 2**32 - 1)))
    held = held_after_save(n, k, 1)
    i = data.draw(st.integers(0, n - 1))
    lost = {node_id(i), node_id((i + 1) % n)}
    alive = [node_id(j) for j in range(n) if node_id(j) not in lost]
    reports = [r for r in reports_for([(10, "a", 1.0, n * k, verified(held))], n, k, rnd)
               if r.node not in lost]
    assert choose(reports, alive) is None


@settings(max_examples=_n(100), deadline=None)
@given(jobs, st.integers(0, 3), st.data())
def test_plans_do_not_depend_on_report_order(job, replicas, data):
    n, k = job
    seed = data.draw(st.integers(0, 2**32 - 1))
    held = held_after_save(n, k, replicas)
    steps = [(10, "a", 1.0, n * k, verified(held)), (20, "b", 2.0, n * k, verified(held))]
    alive = [node_id(j) for j in range(n)][::-1]
    plans = []
    for s in (seed, seed + 1):
        reps = reports_for(steps, n, k, random.Random(s))
        c = choose(reps, alive)
        succ, _ = ring(reversed(alive), replicas)
        plans.append((complete_steps(reps, alive), fetch_plan(c, rank_nodes(n, k)),
                      rereplicate(c, succ, rank_nodes(n, k))))
    assert plans[0] == plans[1]
    assert plans[0][0][0].step == 20


@settings(max_examples=_n(100), deadline=None)
@given(jobs, st.data())
def test_a_part_whose_check_failed_is_never_used(job, data):
    n, k = job
    rnd = random.Random(data.draw(st.integers(0, 2**32 - 1)))
    held = verified(held_after_save(n, k, 1))
    node = node_id(data.draw(st.integers(0, n - 1)))
    part = rnd.choice(sorted(held[node]))
    held[node][part] = False  # this node's copy failed its CRCs
    # ... and a second rank of the node reporting it verified does not rescue it
    reports = reports_for([(10, "a", 1.0, n * k, held)], n, k, rnd)
    reports.append(HoldReport(rank_nodes(n, k).__len__(), node,
                              (StepHolding(10, "a", 1.0, n * k, ((part, True),)),)))
    alive = [node_id(j) for j in range(n)]
    c = choose(reports, alive)
    others = [v for v, ps in held.items() if ps.get(part) and v != node]
    if n == 1 or not others:
        assert c is None
    else:
        assert node not in c.holders[part]
        assert all(f.source != node for f in fetch_plan(c, rank_nodes(n, k)) if f.part == part)
    # the only other holder lost too: the step is not chosen
    alive2 = [v for v in alive if v not in others]
    assert choose([r for r in reports if r.node in alive2], alive2) is None


@settings(max_examples=_n(100), deadline=None)
@given(jobs, st.data())
def test_a_step_held_from_two_saves_is_never_mixed(job, data):
    n, k = job
    rnd = random.Random(data.draw(st.integers(0, 2**32 - 1)))
    world = n * k
    split = data.draw(st.integers(1, world - 1)) if world > 1 else 1
    # save "a" left parts < split, a later save "b" of the same step the others
    held_a = {node_id(i): {p: True for p in range(world) if p < split} for i in range(n)}
    held_b = {node_id(i): {p: True for p in range(world) if p >= split} for i in range(n)}
    alive = [node_id(i) for i in range(n)]
    for t_b in (2.0, 1.0):  # b committed later, or at the same recorded time
        steps = [(10, "a", 1.0, world, held_a), (10, "b", t_b, world, held_b)]
        assert complete_steps(reports_for(steps, n, k, rnd), alive) == []  # neither is whole
    # two whole saves of one step: the newer one, alone
    whole = {node_id(i): {p: True for p in range(world)} for i in range(n)}
    got = complete_steps(reports_for([(10, "a", 1.0, world, whole), (10, "b", 2.0, world, whole)],
                                     n, k, rnd), alive)
    assert [c.save_id for c in got] == ["b"]


def test_a_rewound_timeline_is_abandoned():
    reps = [HoldReport(0, "n00", (StepHolding(100, "old", 1.0, 1, ((0, True),)),
                                  StepHolding(60, "new", 2.0, 1, ((0, True),))))]
    assert [c.step for c in complete_steps(reps, ["n00"])] == [60]


@given(st.lists(st.integers(0, 9), min_size=1, max_size=12), st.integers(0, 12))
def test_ring(ids, replicas):
    nodes = [node_id(i) for i in ids]
    succ, reduced = ring(nodes, replicas)
    distinct = sorted(set(nodes))
    assert sorted(succ) == distinct
    assert reduced == (replicas > len(distinct) - 1)
    for v, s in succ.items():
        assert len(s) == min(replicas, len(distinct) - 1) == len(set(s))
        assert v not in s
    assert ring(list(reversed(nodes)), replicas) == (succ, reduced)


def test_ring_examples_and_errors():
    assert ring(["b", "a", "c"], 1) == ({"a": ["b"], "b": ["c"], "c": ["a"]}, False)
    assert ring(["b", "a"], 3) == ({"a": ["b"], "b": ["a"]}, True)
    assert ring(["a"], 1) == ({"a": []}, True)
    assert ring(["a"], 0) == ({"a": []}, False)
    with pytest.raises(CheckpointError, match="replicas must be >= 0, got -1"):
        ring(["a"], -1)


def _lose_up_to_replicas(job, replicas: int, data):
    """A save of one step replicated ``replicas`` times on a ring of n nodes of k ranks,
    then up to ``replicas`` nodes lost; returns (n, k, lost, alive, choose's result)."""
    n, k = job
    rnd = random.Random(data.draw(st.integers(0, 2**32 - 1)))
    held = held_after_save(n, k, replicas)
    lost = {node_id(i) for i in data.draw(st.sets(st.integers(0, n - 1), max_size=replicas))}
    alive = [node_id(i) for i in range(n) if node_id(i) not in lost]
    reps = [r for r in reports_for([(10, "a", 1.0, n * k, verified(held))], n, k, rnd)
            if r.node not in lost]
    return n, k, lost, alive, choose(reps, alive)


@settings(max_examples=_n(150), deadline=None)
@given(jobs, st.integers(0, 3), st.data())
def test_fetch_plan_covers_every_part_once(job, replicas, data):
    n, k, lost, alive, c = _lose_up_to_replicas(job, replicas, data)
    if not alive:
        assert c is None
        return
    rn = rank_nodes(n, k)  # same world size: replacements take the lost ranks
    plan = fetch_plan(c, rn)
    assert [f.part for f in plan] == list(range(n * k))
    for f in plan:
        assert f.source in c.holders[f.part] and rn[f.sender] == f.source
        assert f.dest == f.part
        assert f.local == (rn[f.part] not in lost)  # own node holds it unless lost
    # at a smaller world (survivors only), every part still has one server
    small = {r: v for r, v in sorted(rn.items()) if v not in lost}
    small = {i: v for i, v in enumerate(small.values())}
    plan = fetch_plan(c, small)
    assert [f.part for f in plan] == list(range(n * k))
    assert all(f.source in c.holders[f.part] and small[f.sender] == f.source for f in plan)


def test_fetch_plan_spreads_over_holders():
    c = Choice(10, "a", 1.0, 4, (("a", "b"),) * 4)
    plan = fetch_plan(c, {0: "c", 1: "c", 2: "c", 3: "c", 4: "a", 5: "b"})
    assert [f.source for f in plan] == ["a", "b", "a", "b"]
    with pytest.raises(CheckpointError, match="part 0 is held on node"):
        fetch_plan(c, {0: "c"})


@settings(max_examples=_n(150), deadline=None)
@given(jobs, st.integers(0, 3), st.data())
def test_rereplicate_restores_the_replica_count(job, replicas, data):
    n, k, lost, alive, c = _lose_up_to_replicas(job, replicas, data)
    if c is None:
        assert not alive
        return
    for nodes_after in (rank_nodes(n, k), None):  # replacements come back / survivors alone
        live = sorted(set(nodes_after.values())) if nodes_after else alive
        succ, _ = ring(live, replicas)
        copies = rereplicate(c, succ, nodes_after)
        after = {p: set(h) for p, h in enumerate(c.holders)}
        for p in after:
            if nodes_after:
                after[p].add(nodes_after[p])  # the fetch wrote it back home
        have_before = {p: set(s) for p, s in after.items()}
        for dest, cs in copies.items():
            for cp in cs:
                assert cp.dest == dest and cp.source in have_before[cp.part]
                assert dest not in have_before[cp.part]
                after[cp.part].add(dest)
        for p, h in after.items():
            home = nodes_after[p] if nodes_after else c.holders[p][0]
            assert {home, *succ[home]} <= h
            assert len({home, *succ[home]}) == min(replicas + 1, len(live))


def test_check_settings():
    a = check_settings([Settings(1, 1, "h1"), Settings(0, 1, "h0")])
    assert a.replicas == 1 and dict(a.nodes) == {0: "h0", 1: "h1"}
    with pytest.raises(CheckpointError) as ei:
        check_settings([Settings(0, 1, "h0"), Settings(2, 2, "h1"), Settings(1, 1, "h0")])
    assert str(ei.value) == ("the ranks disagree on replicas: replicas=1 on ranks 0, 1; "
                             "replicas=2 on rank 2")
    assert ei.value.failures == {0: "replicas=1", 1: "replicas=1", 2: "replicas=2"}
    with pytest.raises(CheckpointError, match="rank 0 reported its settings twice"):
        check_settings([Settings(0, 1, "h0"), Settings(0, 1, "h0")])
    with pytest.raises(CheckpointError, match="rank 3 reported an empty node id"):
        check_settings([Settings(3, 1, "")])
    with pytest.raises(CheckpointError, match="replicas must be >= 0, got -1 on every rank"):
        check_settings([Settings(0, -1, "h0")])


def _run_schedule(order: list[tuple[int, int]]) -> int:
    """Simulate every rank running its pairs of ``order`` one at a time, in order, a
    pair completing only when both its ranks are at it; return the number of
    simultaneous rounds it took, or raise on a deadlock."""
    todo = {r: [p for p in order if r in p] for p in order for r in p}
    rounds = 0
    while any(todo.values()):
        ready = {p for r, ps in todo.items() if ps for p in [ps[0]]
                 if todo[p[0]] and todo[p[1]] and todo[p[0]][0] == p and todo[p[1]][0] == p}
        assert ready, f"deadlock: {todo}"
        for p in ready:
            todo[p[0]].pop(0)
            todo[p[1]].pop(0)
        rounds += 1
    return rounds


def test_schedule_never_deadlocks_and_runs_disjoint_pairs_together():
    rng = random.Random(7)
    for _ in range(300):
        n = rng.randint(2, 12)
        pairs = []
        for _ in range(rng.randint(1, 30)):
            a, b = rng.sample(range(n), 2)
            pairs.append((a, b))
        order = schedule(pairs)
        assert sorted(order) == sorted(pairs)
        _run_schedule(order)
    # a ring of 8 ranks sending to their successor: two rounds, not eight
    assert _run_schedule(schedule([(r, (r + 1) % 8) for r in range(8)])) == 2


def test_replication_plan_sends_each_part_to_each_successor_node_evenly():
    nodes = {r: f"n{r // 4}" for r in range(16)}  # 4 nodes of 4 ranks
    plan = replication_plan(nodes, 2)
    assert len(plan) == 32
    for p in range(16):
        dests = sorted(nodes[d] for s, d in plan if s == p)
        me = int(nodes[p][1:])
        assert dests == sorted(f"n{(me + k) % 4}" for k in (1, 2))
    received = [d for _, d in plan]
    assert sorted(received.count(r) for r in range(16)) == [2] * 16  # even over ranks
    # fewer nodes than replicas + 1: every other node, never the own one
    plan = replication_plan({0: "a", 1: "a", 2: "b"}, 3)
    assert sorted(plan) == [(0, 2), (1, 2), (2, 0)]
    assert replication_plan({0: "a", 1: "a"}, 1) == []


def test_newest_replicated_needs_every_part_on_enough_nodes():
    """Issue 34 (1.5): a step is replicated when every part is on ``copies`` distinct
    nodes; the newest own step with a replica missing is not (a receiver failed)."""
    from dckpt.tiers.peers.plan import newest_replicated

    def node(h: str) -> str:
        return h.split("#")[0]

    whole = {"a#0": {0: True, 1: True, 2: True, 3: True},
             "b#2": {0: True, 1: True, 2: True, 3: True}}
    short = {"a#0": {0: True, 1: True, 3: True},  # part 2's replica never arrived
             "b#2": {0: True, 1: True, 2: True, 3: True}}
    reports = [HoldReport(0, p, tuple(StepHolding(s, f"s{s}", float(s), 4, tuple(d[p].items()))
                                     for s, d in ((10, whole), (20, short))))
               for p in ("a#0", "b#2")]
    steps = complete_steps(reports, {"a#0", "b#2"})
    assert [c.step for c in steps] == [20, 10]  # both restorable with both nodes up
    assert newest_replicated(steps, node, 2) == 10
    assert newest_replicated(steps, node, 1) == 20  # one node: nothing to replicate to
    assert newest_replicated(steps[:1], node, 2) is None
    # two places of one node are one node: they do not make two copies
    one = [HoldReport(0, p, (StepHolding(10, "s", 1.0, 2, ((0, True), (1, True))),))
           for p in ("a#0", "a#1")]
    assert newest_replicated(complete_steps(one, {"a#0", "a#1"}), node, 2) is None
