"""The thread governor (worker/engine/threads.py) against a simulated machine: a fake clock
whose step durations depend on the thread count the step ran on, so the choice it must make is
known, and no test depends on this machine's timing."""

from __future__ import annotations

import os

import pytest
import torch

from pagedq.worker.engine.threads import (
    EXPLORE_AT_MOST,
    ThreadGovernor,
    cpu_list,
    performance_cores,
    size_class,
    usable_cpus,
)


@pytest.fixture(autouse=True)
def keep_threads():
    """The governor sets torch's thread count: each test leaves it as it found it."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


class Machine:
    """A clock that advances by the cost of the step that just ran on the current threads."""

    def __init__(self, cost: dict[int, float]) -> None:
        self.cost, self.now, self.runs = cost, 0.0, []

    def clock(self) -> float:
        return self.now

    def forward(self) -> str:
        threads = torch.get_num_threads()
        self.runs.append(threads)
        self.now += self.cost[threads]
        return "logits"


def run_steps(governor: ThreadGovernor, machine: Machine, steps: int, tokens: int = 1) -> list[int]:
    start = len(machine.runs)
    for _ in range(steps):
        assert governor.run(tokens, machine.forward) == "logits"
    return machine.runs[start:]


def test_a_quiet_machine_keeps_every_thread():
    machine = Machine({2: 0.010, 1: 0.016})
    governor = ThreadGovernor((2, 1), clock=machine.clock)
    runs = run_steps(governor, machine, 200)
    assert runs[:2] == [2, 1] and governor.chosen == 2
    assert runs.count(1) <= 8  # the tries of one thread, ever rarer


def test_a_shared_machine_falls_back_to_one_thread_and_tries_rarely():
    machine = Machine({2: 0.300, 1: 0.020})  # barriers waiting on descheduled threads
    governor = ThreadGovernor((2, 1), clock=machine.clock)
    runs = run_steps(governor, machine, 2000)
    assert governor.chosen == 1
    tries = [i for i, t in enumerate(runs) if t == 2][1:]
    gaps = [b - a for a, b in zip(tries, tries[1:], strict=False)]
    assert gaps == sorted(gaps) and gaps[-1] == EXPLORE_AT_MOST  # backing off
    # what the tries cost: a few percent of the steps on the slow count
    assert sum(machine.cost[t] for t in runs) < 1.25 * 2000 * 0.020


def test_it_follows_the_load_when_it_goes_away():
    machine = Machine({2: 0.300, 1: 0.020})
    governor = ThreadGovernor((2, 1), clock=machine.clock)
    run_steps(governor, machine, 300)
    assert governor.chosen == 1
    machine.cost = {2: 0.010, 1: 0.020}  # the other work ended
    run_steps(governor, machine, EXPLORE_AT_MOST * 3)
    assert governor.chosen == 2


def test_steps_of_different_sizes_are_timed_apart():
    machine = Machine({2: 0.010, 1: 0.016})
    governor = ThreadGovernor((2, 1), clock=machine.clock)
    run_steps(governor, machine, 20, tokens=1)
    run_steps(governor, machine, 20, tokens=300)
    assert set(governor.snapshot()) == {str(size_class(1)), str(size_class(300))}
    assert size_class(2) == size_class(3) != size_class(4)


def test_one_count_is_no_choice():
    machine = Machine({1: 0.01})
    assert set(run_steps(ThreadGovernor((1,), clock=machine.clock), machine, 50)) == {1}


def test_usable_cpus_honours_a_cgroup_quota(tmp_path):
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert usable_cpus(tmp_path) == 1
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert usable_cpus(tmp_path) >= 1
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert usable_cpus(v1) == usable_cpus(tmp_path / "none")
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("100000\n")
    assert usable_cpus(v1) == 1


def test_load_arriving_is_noticed_within_steps_not_a_back_off():
    machine = Machine({2: 0.010, 1: 0.016})
    governor = ThreadGovernor((2, 1), clock=machine.clock)
    run_steps(governor, machine, 2000)  # quiet for long: the back-off is at its longest
    assert governor.chosen == 2
    machine.cost = {2: 0.300, 1: 0.020}  # the load arrives
    runs = run_steps(governor, machine, 10)
    assert runs[-1] == 1 and governor.chosen == 1 and runs.count(2) <= 2


def hybrid_sysfs(root, p_cores: int, e_cores: int):
    """A /sys of a hybrid Intel CPU: P-cores with two hyperthreads each (CPUs 0 .. 2p - 1, core
    ids 0 .. p - 1), then single-threaded E-cores; Linux's cpu_core / cpu_atom PMU lists."""
    (root / "devices" / "cpu_core").mkdir(parents=True)
    (root / "devices" / "cpu_atom").mkdir(parents=True)
    (root / "devices" / "cpu_core" / "cpus").write_text(f"0-{2 * p_cores - 1}\n")
    (root / "devices" / "cpu_atom" / "cpus").write_text(f"{2 * p_cores}-{2 * p_cores + e_cores - 1}\n")
    for cpu in range(2 * p_cores + e_cores):
        topology = root / "devices" / "system" / "cpu" / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        core = cpu // 2 if cpu < 2 * p_cores else p_cores + cpu
        (topology / "core_id").write_text(f"{core}\n")
        (topology / "physical_package_id").write_text("0\n")
    return root


def test_cpu_lists_parse_as_linux_writes_them():
    assert cpu_list("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert cpu_list("5") == {5} and cpu_list("") == set()


def test_a_hybrid_cpus_performance_cores_are_counted_once_per_core(tmp_path):
    sysfs = hybrid_sysfs(tmp_path, p_cores=6, e_cores=8)  # an Alder Lake i7-12700H's shape
    assert performance_cores(sysfs, allowed=set(range(20))) == 6
    assert performance_cores(sysfs, allowed={0, 1, 2, 12, 13}) == 2  # cores 0 and 1; E-cores not
    assert performance_cores(sysfs, allowed={12, 13}) is None  # only E-cores allowed


def test_a_cpu_of_one_kind_has_no_performance_cores(tmp_path):
    (tmp_path / "devices" / "cpu").mkdir(parents=True)  # the PMU a non-hybrid CPU lists
    assert performance_cores(tmp_path, allowed={0, 1}) is None
    if not os.path.exists("/sys/devices/cpu_atom/cpus"):  # this machine, unless it is hybrid
        assert performance_cores() is None


def test_the_governor_measures_the_performance_cores_against_all_and_one(monkeypatch):
    """On a hybrid CPU with the default thread count the P-cores' count is a candidate beside
    all the threads and one, and the fastest is kept (here: an even split waits for E-cores)."""
    from pagedq.worker.config import EngineConfig
    from pagedq.worker.engine import engine

    monkeypatch.setattr(engine, "usable_cpus", lambda: 14)
    monkeypatch.setattr(engine, "performance_cores", lambda: 6)
    torch.set_num_threads(14)
    governor = engine.thread_governor(EngineConfig(), torch.device("cpu"))
    assert governor.counts == (14, 6, 1)
    assert engine.thread_governor(EngineConfig(num_threads=8), torch.device("cpu")).counts == (8, 1)
    machine = Machine({14: 2.0, 6: 1.0, 1: 3.0})
    timed = ThreadGovernor(governor.counts, clock=machine.clock)
    for _ in range(40):
        timed.run(1, machine.forward)
    assert timed.chosen == 6 and machine.runs[-8:].count(6) >= 7
