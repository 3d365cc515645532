"""DistributedOptimizer's step without a cluster (issue 29): what it reads from the device,
when it writes, how it plans its buckets, and its hooks on other threads.

A fake world of two ranks stands in for the process group: its allreduce adds what a peer
sent (a function of this rank's buffer) when it is waited for, and a test can make a release
land in that wait, as an NCCL abort does: the wait returns, with no error. Parameters on the
``meta`` device stand for a GPU's (nothing is computed, nothing can be read from them).
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist

from ipydist.rank import stack_sampler, watcher
from ipydist.torch._core import process_group, topology, waiting
from ipydist.torch._wire import call_check
from ipydist.torch._wire.compression import Compression
from ipydist.torch.training import optimizer as optimizer_module
from ipydist.torch.training.gradients import buckets
from ipydist.torch.training.optimizer import DistributedOptimizer
from ipydist.torch.training.optimizer_options import OptimizerOptions

GRADIENT_WAIT = "allreduce of gradients (DistributedOptimizer)"


class FakeWork:
    """An allreduce in flight: ``wire`` gets the peer's ``sent`` when waited for."""

    def __init__(self, world: FakeWorld, wire: torch.Tensor, sent: torch.Tensor) -> None:
        self.world, self.wire, self.sent, self.done = world, wire, sent, False

    def wait(self, timeout=None) -> bool:
        if self.world.on_wait is not None:
            self.world.on_wait()
        if not self.done:
            self.wire += self.sent
            self.done = True
        return True

    def is_completed(self) -> bool:
        return self.done


class FakeWorld:
    """This rank and a peer that sends what ``peer`` makes of this rank's buffer (the same,
    by default: both had the same gradients)."""

    def __init__(self, monkeypatch) -> None:
        self.rt = topology.Runtime(rank=0, size=2, local_rank=0, local_size=1, host="here",
                                   group=object())
        self.peer = lambda wire: wire.clone()
        self.on_wait = None  # called in every wait: a release landing there
        self.launched: list[torch.Tensor] = []  # the buffers sent, in order
        self.launch_delay = 0.0
        monkeypatch.setattr(topology, "_runtime", self.rt)
        monkeypatch.setattr(process_group, "ensure", lambda: self.rt)
        monkeypatch.setattr(call_check, "_enabled", False)
        monkeypatch.setattr(optimizer_module, "size", lambda: 2)
        monkeypatch.setattr(dist, "all_reduce", self.all_reduce)

    def all_reduce(self, wire, op=None, async_op=False, group=None):
        assert async_op
        time.sleep(self.launch_delay)
        self.launched.append(wire)
        return FakeWork(self, wire, self.peer(wire))

    def release(self) -> None:
        """What ``process_group.break_communication`` does to the runtime."""
        self.rt.broken = True


@pytest.fixture
def world(monkeypatch):
    return FakeWorld(monkeypatch)


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.unused = torch.nn.Linear(4, 2)  # no gradient on this rank: the last buckets
        self.a = torch.nn.Linear(4, 3)
        self.b = torch.nn.Linear(3, 2)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def net_and_optimizer(**kwargs):
    torch.manual_seed(0)
    net = Net()
    opt = DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9),
                               named_parameters=net.named_parameters(),
                               bucket_cap_mb=1e-6, **kwargs)  # a bucket per parameter
    return net, opt


def backward(net, opt) -> dict[str, torch.Tensor | None]:
    """One backward pass; this rank's own gradients, by name."""
    opt.zero_grad()
    net(torch.arange(8.0).reshape(2, 4)).square().mean().backward()
    return {n: None if p.grad is None else p.grad.clone() for n, p in net.named_parameters()}


def state(net, opt):
    return ({n: p.detach().clone() for n, p in net.named_parameters()},
            {n: None if p.grad is None else p.grad.clone() for n, p in net.named_parameters()},
            len(opt.state))


def the_same(a, b) -> bool:
    return a.keys() == b.keys() and all(
        (x is None and y is None) or (x is not None and y is not None and x.equal(y))
        for x, y in ((a[k], b[k]) for k in a))


def counting_reads(monkeypatch) -> list[int]:
    """Every read of values from a tensor during the test, by how many values it read (the
    optimizer's reads go through ``waiting.read_from_device``: counted there once)."""
    reads: list[int] = []
    real_read = waiting.read_from_device
    real_tolist, real_item = torch.Tensor.tolist, torch.Tensor.item
    inside = threading.local()

    def read_from_device(values):
        reads.append(values.numel())
        inside.now = True
        try:
            return real_read(values)
        finally:
            inside.now = False

    def tolist(self):
        if not getattr(inside, "now", False):
            reads.append(self.numel())
        return real_tolist(self)

    def item(self):
        reads.append(1)
        return real_item(self)

    monkeypatch.setattr(waiting, "read_from_device", read_from_device)
    monkeypatch.setattr(torch.Tensor, "tolist", tolist)
    monkeypatch.setattr(torch.Tensor, "item", item)
    return reads


def test_parameters_that_had_a_gradient_here_need_no_read(world, monkeypatch):
    net, opt = net_and_optimizer()
    assert len(opt._buckets) == 6
    world.peer = lambda wire: wire * 3  # the peer's gradients: 3 times this rank's
    mine = backward(net, opt)
    reads = counting_reads(monkeypatch)
    net.unused.weight.grad = torch.ones_like(net.unused.weight)  # every parameter had one
    net.unused.bias.grad = torch.ones_like(net.unused.bias)
    opt.step()
    assert reads == []
    assert net.a.weight.grad.allclose(2 * mine["a.weight"])  # (g + 3 g) / 2
    assert net.unused.bias.grad.allclose(torch.full((2,), 2.0))


def test_parameters_missing_here_are_read_in_one_read_per_step(world, monkeypatch):
    net, opt = net_and_optimizer()
    mine = backward(net, opt)

    def peer(wire):  # had every gradient this rank had, and unused.weight's (ones)
        sent = wire.clone()
        if wire.numel() == net.unused.weight.numel() + 1:
            sent[:-1], sent[-1] = 0.5, 1.0  # prescaled by 1/2, and its flag
        return sent

    world.peer = peer
    reads = counting_reads(monkeypatch)
    opt.step()
    assert reads == [2]  # unused.weight's and unused.bias's flags, from two buckets, at once
    assert net.unused.weight.grad.equal(torch.full((2, 4), 0.5))  # averaged with this zero
    assert net.unused.bias.grad is None  # no rank had one
    assert net.a.weight.grad.allclose(mine["a.weight"])
    assert opt.state[net.a.weight]["momentum_buffer"] is not None


@pytest.mark.parametrize("bucket", [0, 5])
def test_a_release_in_any_wait_leaves_no_gradient_written_and_no_step(world, bucket):
    net, opt = net_and_optimizer()
    world.peer = lambda wire: wire * 3
    backward(net, opt)
    waits = []

    def on_wait():
        waits.append(1)
        if len(waits) == bucket + 1:  # the wait returns, as an aborted NCCL kernel does
            world.release()

    world.on_wait = on_wait
    before = state(net, opt)
    with pytest.raises(RuntimeError, match="was released"):
        opt.step()
    after = state(net, opt)
    assert the_same(before[0], after[0]) and the_same(before[1], after[1])
    assert after[2] == 0  # no momentum either
    world.rt.broken = False  # the recovery: rebuilt, and the step abandoned
    opt._abandon_pending()
    backward(net, opt)
    opt.step()
    assert len(opt.state) == 4


def test_a_release_after_the_last_read_is_caught_before_the_first_write(world, monkeypatch):
    net, opt = net_and_optimizer()
    world.peer = lambda wire: wire * 3
    backward(net, opt)
    real = waiting.read_from_device

    def read_then_released(values):
        read = real(values)
        world.release()
        return read

    monkeypatch.setattr(waiting, "read_from_device", read_then_released)
    before = state(net, opt)
    with pytest.raises(RuntimeError, match="was released"):
        opt.step()
    after = state(net, opt)
    assert the_same(before[0], after[0]) and the_same(before[1], after[1])
    assert after[2] == 0


def test_a_released_rank_does_not_step_after_synchronize(world):
    net, opt = net_and_optimizer()
    backward(net, opt)
    opt.synchronize()
    params = state(net, opt)[0]
    world.release()  # while the cell clips the gradients, say
    with opt.skip_synchronize(), pytest.raises(RuntimeError, match="was released"):
        opt.step()
    assert the_same(params, state(net, opt)[0]) and len(opt.state) == 0


# --- on a GPU: buckets on the meta device stand for it ------------------------------------------


def gpu_like_buckets(world, monkeypatch, had: list[bool]):
    """Launched and finished buckets of meta parameters (one each), some without a gradient
    here; reads from the device counted, each value 1.0."""
    params = [torch.nn.Parameter(torch.empty(3, device="meta")) for _ in had]
    for p, h in zip(params, had):
        p.grad = torch.empty_like(p) if h else None
    plan = buckets.plan(params, 1.0)
    reads: list[int] = []

    def read_from_device(values):
        assert values.device.type == "meta"
        reads.append(values.numel())
        waiting.check_usable()
        return [1.0] * values.numel()

    monkeypatch.setattr(waiting, "read_from_device", read_from_device)

    def no_host_tensor(*args, **kwargs):
        raise AssertionError("a tensor made on the host in a gradient hook")

    with monkeypatch.context() as m:
        m.setattr(torch, "tensor", no_host_tensor)
        for bucket in plan:
            bucket.launch(Compression.none, 0.5)
    for bucket in plan:
        bucket.finish()
    return params, plan, reads


def test_on_a_gpu_the_step_waits_once_even_with_nothing_to_read(world, monkeypatch):
    params, plan, reads = gpu_like_buckets(world, monkeypatch, [True] * 4)
    buckets.unpack(plan, 0.5, 1.0)
    assert reads == [0]  # a wait for the device: the step's one
    assert all(p.grad is not None for p in params)


def test_on_a_gpu_the_flags_missing_here_are_read_at_once(world, monkeypatch):
    params, plan, reads = gpu_like_buckets(world, monkeypatch, [True, False, True, False])
    buckets.unpack(plan, 0.5, 1.0)
    assert reads == [2]
    assert all(p.grad is not None for p in params)  # some rank had one (the fake read says)


def test_on_a_gpu_a_release_during_the_read_writes_nothing(world, monkeypatch):
    params, plan, reads = gpu_like_buckets(world, monkeypatch, [True, False])
    world.release()  # the read returns, as after an NCCL abort, and looks
    grads = [p.grad for p in params]
    with pytest.raises(RuntimeError, match="was released"):
        buckets.unpack(plan, 0.5, 1.0)
    assert [p.grad for p in params] == grads  # the same tensors, and none made


def test_flags_are_written_where_they_lie():
    flags = torch.full((7,), 5.0)
    buckets._mark(flags, [True, False, False, True, False, True, False])
    assert flags.tolist() == [1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 0.0]


# --- the plan ---------------------------------------------------------------------------------


def test_large_parameters_travel_alone_only_where_mpi_reduces_them_in_place(monkeypatch):
    rt = topology.Runtime(rank=0, size=2, local_rank=0, local_size=1, host="here",
                          transport="mpi", data_comm=object())
    monkeypatch.setattr(topology, "_runtime", rt)
    large = [torch.nn.Parameter(torch.empty(512, 1024)) for _ in range(3)]  # 2 MB each
    small = [torch.nn.Parameter(torch.empty(16)) for _ in range(3)]
    params = [large[0], small[0], large[1], small[1], large[2], small[2]]

    def alone(plan):
        return [len(b.params) == 1 and b.own for b in plan].count(True)

    cap = 25 * 2**20
    assert alone(buckets.plan(params, cap, alone=buckets.alone_rule(Compression.none))) == 3
    assert alone(buckets.plan(params, cap, alone=buckets.alone_rule(Compression.fp16))) == 0
    warm = buckets.alone_rule(Compression.fp16, distributed_after=10)  # uncompressed at first
    assert alone(buckets.plan(params, cap, alone=warm)) == 3
    rt.transport = "gloo"
    assert alone(buckets.plan(params, cap, alone=buckets.alone_rule(Compression.none))) == 0
    rt.transport = "mpi"
    on_gpu = [torch.nn.Parameter(torch.empty(p.shape, device="meta")) for p in params]
    plan = buckets.plan(on_gpu, cap, alone=buckets.alone_rule(Compression.none))
    assert alone(plan) == 0 and len(plan) == 2  # the first bucket is small (1 MB)
    halves = [torch.nn.Parameter(torch.empty(p.shape, dtype=torch.float16)) for p in params]
    assert alone(buckets.plan(halves, cap, alone=buckets.alone_rule(Compression.none))) == 0


def bert_large_like() -> list[torch.nn.Parameter]:
    """The parameters of a BERT-large-sized model (340 M), on the meta device."""
    def p(*shape):
        return torch.nn.Parameter(torch.empty(*shape, device="meta"))

    params = [p(30522, 1024), p(512, 1024), p(2, 1024), p(1024), p(1024)]
    for _ in range(24):
        for _ in range(4):  # query, key, value, output
            params += [p(1024, 1024), p(1024)]
        params += [p(1024), p(1024), p(4096, 1024), p(4096), p(1024, 4096), p(1024),
                   p(1024), p(1024)]
    return params


def test_a_bert_large_sized_model_on_a_gpu_has_about_as_many_buckets_as_ddp():
    params = bert_large_like()
    total = sum(q.numel() * q.element_size() for q in params)
    cap = 25 * 2**20
    plan = buckets.plan(params, cap, alone=buckets.alone_rule(Compression.none))
    assert not any(b.own for b in plan)
    assert len(plan) <= total // cap + 2  # DDP's plan: about 51 buckets (was about 150)
    assert sorted(id(q) for b in plan for q in b.params) == sorted(id(q) for q in params)


# --- hooks on other threads ---------------------------------------------------------------------


def test_hooks_of_two_threads_launch_every_bucket_once_in_order(world):
    torch.manual_seed(0)
    left, right = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    params = [*left.parameters(), *right.parameters()]
    opt = DistributedOptimizer(torch.optim.SGD(params, lr=0.1), bucket_cap_mb=1e-6)
    world.launch_delay = 0.05  # the second thread's hooks come while the first launches
    opt.zero_grad()
    errors = []

    def run(layer):
        try:
            layer(torch.ones(2, 4)).sum().backward()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(layer,)) for layer in (right, left)]
    for t in threads:  # right's buckets come first: without a lock, both threads launch them
        t.start()
        time.sleep(0.01)
    for t in threads:
        t.join()
    assert errors == []
    order = [next(i for i, b in enumerate(opt._buckets)
                  if b.exchange is not None and b.exchange.wire is wire)
             for wire in world.launched]
    assert order == list(range(len(opt._buckets)))
    opt.step()


def test_a_hook_waiting_on_another_thread_is_named_and_a_first_release_frees_it(
        world, monkeypatch):
    """On a GPU a parameter's hook runs on autograd's thread for the device while the main
    thread waits in backward(); here backward runs on a thread of the test's, and the step's
    check, in the first hook, waits for peers that never come."""
    def check_never_answered(*args, **kwargs):
        while True:  # as waiting.wait_for_mpi waits: a release ends it
            waiting.check_usable()
            time.sleep(0.005)

    monkeypatch.setattr(call_check, "check", check_never_answered)
    net, opt = net_and_optimizer()
    opt.zero_grad()
    raised = []

    def run():
        try:
            net(torch.ones(2, 4)).square().mean().backward()
        except RuntimeError as e:
            raised.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    try:
        deadline = time.monotonic() + 5
        while stack_sampler.collective_frame(sys._getframe()) is None:
            assert time.monotonic() < deadline, "the hook never waited"
            time.sleep(0.01)
        assert stack_sampler.collective_frame(sys._getframe())[1] == GRADIENT_WAIT
        sampler = stack_sampler.CollectiveSampler(report_after=0.0)
        sampler.sample(sys._getframe(), 0.0)
        assert sampler.sample(sys._getframe(), 1.0) == {"collective": GRADIENT_WAIT,
                                                         "waited": 1.0}
        # the watcher's first release: it finds the wait, so it breaks the group
        monkeypatch.setattr(watcher, "_main_ident", threading.get_ident())
        monkeypatch.setattr(watcher, "_in_cell", True)
        assert watcher._settle(0.0) == (GRADIENT_WAIT, False)
    finally:
        world.release()
        thread.join(5)
    assert not thread.is_alive()
    assert len(raised) == 1 and "was released" in str(raised[0])  # out of backward()
    # the watcher samples between cells only while the sampler follows a call: the next
    # sample takes the report back and lets the call's frame go
    assert sampler.following
    assert sampler.sample(sys._getframe(), 2.0) == {"collective": None}
    assert not sampler.following
    assert opt._next_launch == 0 and all(b.exchange is None for b in opt._buckets)


def test_distributed_optimizer_takes_its_options_as_declared_in_horovod_s_order():
    """The factory's parameters after the optimizer are OptimizerOptions' fields, same order
    (Horovod's, for positional calls), same defaults: one declaration, checked here."""
    parameters = list(inspect.signature(DistributedOptimizer).parameters.values())[1:]
    declared = dataclasses.fields(OptimizerOptions)
    assert [p.name for p in parameters] == [f.name for f in declared]
    assert [p.default for p in parameters] == [f.default for f in declared]


def test_bad_optimizer_options_are_refused_before_any_wrapping():
    with pytest.raises(ValueError, match="backward_passes_per_step must be at least 1"):
        OptimizerOptions(backward_passes_per_step=0)
    with pytest.raises(ValueError, match="distributed_after must be a number of steps"):
        OptimizerOptions(distributed_after=-1)
