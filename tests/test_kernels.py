import time

import torch

from lsn_ext._kernels import choose, faster, timing_applies


def _slow() -> None:
    time.sleep(0.02)


def _fast() -> None:
    pass


def _failing() -> None:
    raise RuntimeError("no kernel for this shape")


def test_faster_keeps_the_faster_kernel_and_counts_a_failing_one_as_slower():
    assert faster(_fast, _slow)
    assert not faster(_slow, _fast)
    assert faster(_slow, _failing)


def test_faster_goes_by_the_typical_time_not_the_luckiest_run():
    # An erratic kernel that is fast on every third call loses to a steady one that is faster
    # on most calls (the fastest of a few runs would pick the erratic kernel).
    calls = []

    def erratic() -> None:
        calls.append(1)
        if len(calls) % 3:
            time.sleep(0.02)

    def steady() -> None:
        time.sleep(0.005)

    assert faster(steady, erratic)
    assert not faster(erratic, steady)


def test_choose_times_once_per_key():
    calls = []

    def counted_fast() -> None:
        calls.append(1)

    cache: dict = {}
    assert choose(cache, "k", counted_fast, _slow)
    timed = len(calls)
    assert timed >= 3  # warm-up and the timed runs
    assert choose(cache, "k", _slow, counted_fast)  # cached: not timed again
    assert len(calls) == timed
    assert cache == {"k": True}
    assert not choose(cache, "other", _slow, _fast)


def test_choose_asks_when_once_and_times_nothing_where_a_cannot_serve():
    asked, calls = [], []

    def cannot() -> bool:
        asked.append(1)
        return False

    def counted() -> None:
        calls.append(1)

    cache: dict = {}
    assert not choose(cache, "k", _fast, counted, when=cannot)
    assert not choose(cache, "k", _fast, counted, when=cannot)
    assert (len(asked), len(calls), cache) == (1, 0, {"k": False})
    assert choose(cache, "other", _fast, _slow, when=lambda: True)


def test_timing_applies_on_cpu_outside_deterministic_mode():
    t = torch.zeros(1)
    mode = torch.are_deterministic_algorithms_enabled()
    assert timing_applies(t) is not mode
    torch.use_deterministic_algorithms(True)
    try:
        assert not timing_applies(t)
    finally:
        torch.use_deterministic_algorithms(mode)
    assert not timing_applies(torch.zeros(1, device="meta"))
