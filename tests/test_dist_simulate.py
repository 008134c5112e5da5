"""The pipeline simulator (``fitgraph.dist.simulate``) against hand-computed timelines, the
closed forms of ``fitgraph.dist.schedules``, and its own rules on random schedules; the Gantt
chart (``fitgraph.dist.gantt``)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fitgraph.dist.schedules import bubble_fraction, in_flight
from fitgraph.dist.simulate import (
    SIM_SCHEDULES,
    ZB_W_HOLD,
    Action,
    _run_programs,
    programs,
    simulate,
)

F, B = 1.0, 2.0


def spans(tl, device):
    """``device``'s actions as ``kind chunk.micro -> (start, end)``."""
    return {f"{e.action.kind}{e.action.chunk}.{e.action.micro}": (e.start, e.end)
            for e in tl.events if e.device == device}


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_equal_stages_leave_the_textbook_bubble(schedule):
    p, m = 4, 8
    tl = simulate(schedule, [F] * p, [B] * p, m, act_bytes=[10.0] * p)
    assert tl.makespan_s == (m + p - 1) * (F + B) == 33
    for d in range(p):
        assert tl.busy_s[d] == m * (F + B)
        assert tl.bubble_s(d) == (p - 1) * (F + B)
        assert tl.bubble_s(d) / tl.busy_s[d] == bubble_fraction(schedule, p, m)
    # NOTE: 1F1B holds what its warm-up forwards left, GPipe every micro-batch at the turn
    assert tl.peak_bytes == tuple(in_flight(schedule, p, m, d) * 10.0 for d in range(p))
    assert tl.peak_bytes == ((40.0, 30.0, 20.0, 10.0) if schedule == "1f1b" else (80.0,) * 4)


def test_interleaving_divides_the_bubble_by_the_chunks():
    p, m, v = 4, 8, 2
    # NOTE: each chunk is 1/v of a stage: F/v, B/v seconds and 1/v of its activations
    tl = simulate("interleaved", [F / v] * (p * v), [B / v] * (p * v), m, v=v,
                  act_bytes=[10.0 / v] * (p * v))
    assert tl.makespan_s == m * (F + B) + (p - 1) * (F + B) / v == 28.5
    for d in range(p):
        assert tl.bubble_s(d) == 4.5
        assert tl.bubble_s(d) / tl.busy_s[d] == bubble_fraction("interleaved", p, m, v)
        assert tl.peak_bytes[d] == in_flight("interleaved", p, m, d, v) * 10.0
    # NOTE: device 0 warms up with 2 (p - 1) + (v - 1) p = 10 chunk forwards, Megatron's order:
    # chunk 0 on micro-batches 0-3, chunk 4 (its second) on 0-3, chunk 0 on 4-5
    order = [(a.kind, a.chunk, a.micro) for a in programs("interleaved", p, m, v)[0]]
    assert order[:11] == [("F", 0, i) for i in range(4)] + [("F", 4, i) for i in range(4)] + [
        ("F", 0, 4), ("F", 0, 5), ("F", 0, 6)]
    assert order[11] == ("B", 4, 0)


@pytest.mark.parametrize(("p", "v", "k"), [(2, 2, 1), (3, 3, 2), (4, 3, 3), (5, 2, 2)])
def test_interleaved_agrees_with_the_closed_forms(p, v, k):
    m = p * k
    tl = simulate("interleaved", [F / v] * (p * v), [B / v] * (p * v), m, v=v,
                  act_bytes=[1.0 / v] * (p * v))
    assert tl.makespan_s == pytest.approx(m * (F + B) * (1 + bubble_fraction(
        "interleaved", p, m, v)))
    assert tl.peak_bytes == pytest.approx([in_flight("interleaved", p, m, d, v)
                                           for d in range(p)])


def test_a_transfer_delays_its_reader_both_ways():
    # NOTE: F0 [0,1]; activation arrives 1.5; F1 [1.5,2.5]; B1 [2.5,4.5]; gradient arrives 5
    tl = simulate("1f1b", [F, F], [B, B], m=1, p2p_s=[0.5])
    assert spans(tl, 0) == {"F0.0": (0.0, 1.0), "B0.0": (5.0, 7.0)}
    assert spans(tl, 1) == {"F1.0": (1.5, 2.5), "B1.0": (2.5, 4.5)}
    assert tl.makespan_s == 2 * (F + B) + 2 * 0.5


def test_transfers_on_one_link_take_turns():
    # NOTE: both forwards of chunk 0 end by 0.2, but the link carries one second-long send at a
    # time: micro-batch 1's activation leaves at 1.1 and arrives at 2.1, not at 1.2
    tl = simulate("gpipe", [0.1, 0.5], [0.1, 0.1], m=2, p2p_s=[1.0])
    assert spans(tl, 1)["F1.0"] == (1.1, 1.6)
    assert spans(tl, 1)["F1.1"] == (2.1, 2.6)


def test_the_two_directions_of_a_link_do_not_wait_for_each_other():
    # NOTE: the gradient of micro-batch 0 leaves device 1 at 6, while micro-batch 1's activation
    # is still on its way (4 to 7) the other way; it arrives at 9. Sends each way: [1,4] [4,7]
    # forward, [6,9] [9,12] backward; device 0's backwards then run [9,10] and [12,13]
    tl = simulate("1f1b", [1.0, 1.0], [1.0, 1.0], m=2, p2p_s=[3.0])
    assert spans(tl, 1) == {"F1.0": (4.0, 5.0), "B1.0": (5.0, 6.0), "F1.1": (7.0, 8.0),
                            "B1.1": (8.0, 9.0)}
    assert spans(tl, 0)["B0.0"] == (9.0, 10.0)
    assert tl.makespan_s == 13.0


def test_zero_bubble_h1_fills_the_cool_down_with_weight_gradients():
    p, m = 4, 8
    zb = simulate("zb-h1", [1.0] * p, [1.0] * p, m, w_s=[1.0] * p, act_bytes=[34.0] * p)
    one = simulate("1f1b", [1.0] * p, [2.0] * p, m, act_bytes=[34.0] * p)
    # NOTE: device 0 runs p forwards, then idles (p - 1) B while the first gradient comes back
    # (B alone, the W's are deferred downstream), then never again: m (F + B + W) + (p - 1) B;
    # 1F1B idles (p - 1)(B + W) there and as much at the end
    assert zb.makespan_s == m * 3 + (p - 1) * 1 == 27
    assert [zb.bubble_s(d) for d in range(p)] == [3.0] * p
    assert zb.bubble_s(0) == one.bubble_s(0) / 3
    # NOTE: device r holds p - r micro-batches whole and r more until their W: 32 of 34 bytes
    assert zb.peak_bytes == tuple((p - d) * 34.0 + d * 34.0 * ZB_W_HOLD for d in range(p))
    assert zb.peak_bytes[0] == one.peak_bytes[0] == max(zb.peak_bytes)


def test_zero_bubble_h1_by_hand_on_two_devices():
    tl = simulate("zb-h1", [1.0, 1.0], [1.0, 1.0], m=2, w_s=[1.0, 1.0])
    assert spans(tl, 0) == {"F0.0": (0, 1), "F0.1": (1, 2), "B0.0": (3, 4), "W0.0": (4, 5),
                            "B0.1": (5, 6), "W0.1": (6, 7)}
    assert spans(tl, 1) == {"F1.0": (1, 2), "B1.0": (2, 3), "F1.1": (3, 4), "B1.1": (4, 5),
                            "W1.0": (5, 6), "W1.1": (6, 7)}


def test_one_device_runs_everything_back_to_back():
    tl = simulate("1f1b", [F], [B], m=5, act_bytes=[3.0])
    assert tl.makespan_s == 5 * (F + B) and tl.bubble_s(0) == 0.0 and tl.peak_bytes == (3.0,)
    # NOTE: three chunks on one device pass outputs without a link: the p2p times are unused
    tl = simulate("interleaved", [1.0, 2.0, 3.0], [2.0, 4.0, 6.0], m=4, v=3, p2p_s=[5.0, 5.0])
    assert tl.makespan_s == 4 * (6.0 + 12.0) and tl.devices == 1


def test_deadlocks_name_each_waiting_device():
    fb = [Action(kind, 0, i) for i in (0, 1) for kind in "FB"]
    crossed = [Action("F", 1, 1), Action("F", 1, 0), Action("B", 1, 0), Action("B", 1, 1)]
    with pytest.raises(ValueError, match=r"deadlock: device 0 waits to run Action\(kind='B', "
                       r"chunk=0, micro=0\) for chunk 1's backward.*device 1 waits to run "
                       r"Action\(kind='F', chunk=1, micro=1\) for chunk 0's forward"):
        _run_programs([fb, crossed], [1.0, 1.0], [1.0, 1.0], m=2)
    backwards_first = [Action("B", 1, 0), Action("F", 1, 0)]
    with pytest.raises(ValueError, match="device 1 waits .* its own F.*later in its program"):
        _run_programs([[Action("F", 0, 0), Action("B", 0, 0)], backwards_first],
                      [1.0, 1.0], [1.0, 1.0], m=1)
    # NOTE: the same actions in a workable order run
    in_order = [Action(kind, 1, i) for i in (0, 1) for kind in "FB"]
    tl = _run_programs([fb, in_order], [1.0, 1.0], [1.0, 1.0], m=2)
    assert tl.makespan_s == 8.0


def test_hand_made_programs_must_be_complete_and_in_place():
    with pytest.raises(ValueError, match="device 0's program.*chunk=0, micro=1"):
        _run_programs([[Action("F", 0, 0), Action("B", 0, 0)]], [1.0], [1.0], m=2)
    with pytest.raises(ValueError, match="device 1's program.*chunk=0"):
        _run_programs([[Action("F", 0, 0), Action("B", 0, 0)],
                       [Action("F", 0, 0), Action("F", 1, 0), Action("B", 1, 0)]],
                      [1.0, 1.0], [1.0, 1.0], m=1)


@pytest.mark.parametrize(("call", "message"), [
    (lambda: simulate("zb", [1.0], [1.0], 2), "unknown schedule 'zb'"),
    (lambda: simulate("1f1b", [1.0], [1.0], 0), "m = 0"),
    (lambda: simulate("1f1b", [1.0, 1.0], [1.0], 2), "bwd_s has 1 entries; it needs 2"),
    (lambda: simulate("1f1b", [1.0, -1.0], [1.0, 1.0], 2), r"fwd_s\[1\] = -1.0"),
    (lambda: simulate("1f1b", [1.0], [float("nan")], 2), r"bwd_s\[0\] = nan"),
    (lambda: simulate("1f1b", [1.0] * 2, [1.0] * 2, 2, p2p_s=[1.0, 1.0]), "p2p_s has 2"),
    (lambda: simulate("1f1b", [1.0] * 2, [1.0] * 2, 2, act_bytes=[1.0]), "act_bytes has 1"),
    (lambda: simulate("1f1b", [1.0] * 4, [1.0] * 4, 2, v=2), "one chunk per device"),
    (lambda: simulate("interleaved", [1.0] * 3, [1.0] * 3, 2, v=2), "3 chunks cannot be split"),
    (lambda: simulate("interleaved", [1.0] * 8, [1.0] * 8, 6, v=2), "multiple of the devices"),
    (lambda: simulate("zb-h1", [1.0] * 2, [1.0] * 2, 2), "give it w_s"),
    (lambda: simulate("1f1b", [1.0] * 2, [1.0] * 2, 2, w_s=[1.0] * 2), "1f1b does not run"),
    (lambda: simulate("zb-h1", [1.0], [1.0], 2, w_s=[1.0], w_hold=1.5), "w_hold = 1.5"),
    (lambda: programs("gpipe", 0, 2), "p = 0"),
])
def test_what_cannot_be_simulated_is_named(call, message):
    with pytest.raises(ValueError, match=message):
        call()


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(SIM_SCHEDULES), st.integers(1, 5), st.integers(1, 3), st.integers(1, 3),
       st.data())
def test_every_schedule_keeps_the_rules(schedule, p, k, v, data):
    """On random times: no deadlock; each device runs its own actions once, one at a time, in
    program order; each waits for what it reads (and its transfer)."""
    v = v if schedule == "interleaved" else 1
    m = p * k if schedule == "interleaved" else data.draw(st.integers(1, 7))
    n = p * v
    times = st.lists(st.floats(0.0, 3.0), min_size=n, max_size=n)
    fwd, bwd, wgt = data.draw(times), data.draw(times), data.draw(times)
    p2p = data.draw(st.lists(st.floats(0.0, 1.0), min_size=n - 1, max_size=n - 1))
    tl = simulate(schedule, fwd, bwd, m, v=v, p2p_s=p2p,
                  w_s=wgt if schedule == "zb-h1" else None)
    at = {(e.action.kind, e.action.chunk, e.action.micro): e for e in tl.events}
    assert len(at) == len(tl.events) == n * m * (3 if schedule == "zb-h1" else 2)
    progs = programs(schedule, p, m, v)
    for d in range(p):
        mine = [e for e in tl.events if e.device == d]
        assert [e.action for e in mine] == progs[d]
        assert all(a.end <= b.start for a, b in zip(mine, mine[1:]))
        assert tl.busy_s[d] == pytest.approx(sum(e.end - e.start for e in mine))
        assert tl.end_s[d] == mine[-1].end
    # NOTE: p == 1 passes outputs between its chunks for free
    hop = [0.0 if p == 1 else s for s in p2p]
    for (kind, c, i), e in at.items():
        assert e.device == c % p and e.end <= tl.makespan_s + 1e-9
        if kind == "F" and c > 0:
            assert e.start >= at["F", c - 1, i].end + hop[c - 1] - 1e-9
        if kind == "B":
            assert e.start >= at["F", c, i].end - 1e-9
            if c < n - 1:
                assert e.start >= at["B", c + 1, i].end + hop[c] - 1e-9
        if kind == "W":
            assert e.start >= at["B", c, i].end - 1e-9


def test_determinism():
    args = ("interleaved", [0.3, 0.7, 0.2, 0.9] * 2, [0.5, 1.1, 0.4, 1.3] * 2, 8)
    a, b = (simulate(*args, v=2, p2p_s=[0.05] * 7, act_bytes=[1.0] * 8) for _ in range(2))
    assert a == b and a.events == b.events


def test_a_megatron_size_pipeline_runs():
    """p = 64, m = 3072 (GPT-3 1T's pipeline in Megatron-LM's Table 1): not a timed assertion,
    the formula holds at size."""
    p, m = 64, 3072
    tl = simulate("1f1b", [F] * p, [B] * p, m, p2p_s=[0.0] * (p - 1))
    assert tl.makespan_s == (m + p - 1) * (F + B)


def test_gantt_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    from fitgraph.dist.gantt import plot_gantt

    tl = simulate("zb-h1", [1.0] * 4, [1.0] * 4, 8, w_s=[1.0] * 4)
    out = plot_gantt(tl, tmp_path / "zb.png", title="ZB-H1")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    big = simulate("interleaved", [0.5] * 32, [1.0] * 32, 64, v=2)
    out = plot_gantt(big, tmp_path / "big.png", max_micro_labels=10)
    assert out.stat().st_size > 1000
