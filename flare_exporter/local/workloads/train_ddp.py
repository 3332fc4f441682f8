"""A small, ordinary DDP training script; it knows nothing about flare-exporter.

    RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 \
        python flare_exporter/local/workloads/train_ddp.py

--wait-for PATH keeps the ranks alive after training until PATH exists (tests scrape them then);
--start-after PATH makes each rank, ready to train, create PATH.ready and wait for PATH before its first step
  (benchmarks/instructions.py starts counting instructions then);
--scrape-every N makes each rank GET its own exporter's /metrics every N steps (FLARE_PORT + LOCAL_RANK on
  loopback, gzip accepted, as Prometheus asks) and read the answer before its next step, so that every
  render covers the same N steps (benchmarks/instructions.py counts what a scrape costs);
--report PATH writes this rank's step times as JSON (the overhead benchmark reads them): per step, the wall
  time, the training thread's CPU time, the whole process's CPU time (every thread: gloo's, and an
  attached exporter's) and when it ended (time.time()); and each Python thread's CPU time over the steps,
  by name.
--fault KIND --fault-rank R --fault-step S makes rank R misbehave at step S, the way real jobs do:
  stuck     R loops in Python before its next collective, forever (a livelock in its own code);
  mismatch  every rank syncs a metric with one extra collective, R with broadcast instead of all_reduce;
  raise     R raises an exception out of the training loop and dies.
  oom       R runs out of memory in its forward pass (torch.OutOfMemoryError, as a too-large batch raises).
  estale    R's DataLoader worker fails to read its input (OSError ESTALE, a stale NFS handle): needs
            --data-workers N, which reads the inputs through a real DataLoader with N worker processes.
  host-stall   R sleeps --stall-seconds in the middle of every step from step S (a GC storm, a slow
               data loader): with --fake-kernels, between the two halves of the step's launches;
  contention   R starts --contention-threads busy Python threads at step S (CPU and interpreter contention,
               as a runaway logging or data thread causes): every op of R is slower to dispatch;
  host-delay   every op R runs from step S is delayed by --host-delay-seconds (busy-waited on the host).
--gc-rank R --gc-cycles N --gc-from-step S: from step S (default: --fault-step) on, rank R builds N
  short-lived reference cycles before every step's forward pass (a data or logging path that leaves cyclic
  garbage behind), which only the cyclic garbage collector frees: it runs several times a step, now and then
  over the whole heap. Goes with any --fault.
--step-seconds T paces each step to at least T seconds (a steadier job to watch than a flat-out one): after
  the backward pass (whose all-reduce every rank leaves together) each rank sleeps until T seconds after
  it, so the ranks start each step together as in a real job (pacing from each rank's own start would keep
  whatever phase offset the ranks started with, and a rank that starts late would wait least in every
  collective, like a straggler).
--slow-rank R --slowdown F --slow-from-step S: from step S, rank R (-1: every rank) computes F times longer
  (busy extra compute of F x its own forward+backward time, measured before training), a fail-slow GPU;
  with --slow-by sleep, F x a nominal 1 ms is slept instead (a slow input pipeline; no CPU used, and the
  same on every rank, so that every rank of a job on a small machine can be slowed alike: a compute time
  measured on a busy machine differs from rank to rank and would make one of them a real straggler).
--fake-kernels K --fake-kernel-seconds D: each step also launches K kernels of D seconds on a fake device
  (flare_exporter.rank.fake_device, a CPU thread standing in for a GPU) before its host work, and waits for
  them at the end of the step, as a GPU job waits on its loss.
--device cuda trains on the GPU numbered LOCAL_RANK (modulo the GPUs there are) over NCCL instead of on the
  CPU over gloo, and each step waits for the GPU at its end, as a job reading its loss does; --width W sets
  the model's width (default 256; a GPU wants thousands).
--slow-data-seconds T: with --data-workers N, each batch takes T seconds more to read (a slow dataset: the
  workers sleep, using no CPU), so that the ranks wait for their input.
--pg-timeout S sets the process group's collective timeout (a mismatched collective fails after S seconds
  instead of the default 30 minutes).
--pair-groups also makes process groups of ranks 0-1, 2-3, ... (a tensor-parallel pair's, described "tp":
  role tp), and each rank all-reduces a small tensor in its pair before every forward pass (after the fault
  step's fault).
--sync-mb M: each step also all-reduces M megabytes of float32 after its backward pass (weights averaged
  across ranks, an EMA or optimizer state kept in sync): communication with no compute beside it.
--fr-dump-after S: with PyTorch's flight recorder on (TORCH_FR_BUFFER_SIZE), dump every rank's recorder to
  TORCH_FR_DUMP_TEMP_FILE<rank> once a collective has been in flight for S seconds, as NCCL's watchdog dumps
  on a timeout (flight_recorder_dumps.py: gloo has no dump of its own).
Signals (SIGKILL, SIGSTOP) are sent from outside, by the demo or the tests.
"""

import argparse
import datetime
import errno
import functools
import http.client
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader, Dataset

WIDTH = 256
FAULTS = ("none", "stuck", "mismatch", "raise", "oom", "estale", "host-stall", "contention", "host-delay")


def threads_cpu() -> dict[str, float]:
    """CPU seconds of each Python thread alive, by name (an attached exporter's threads among them)."""
    seconds: dict[str, float] = {}
    for thread in threading.enumerate():
        try:
            clock = time.pthread_getcpuclockid(thread.ident or 0)
            seconds[thread.name] = seconds.get(thread.name, 0.0) + time.clock_gettime(clock)
        except OSError:  # it ended meanwhile
            pass
    return seconds


def make_model(width: int = WIDTH) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10)
    )


def stuck_in_compute() -> None:
    """A rank's own code that never finishes (think: a retry loop around a dead file system)."""
    total = 0
    while True:
        total += sum(range(1000))
        time.sleep(0.01)


NOMINAL_COMPUTE_SECONDS = 0.001  # the model's forward+backward at batch 64 on one core, about


def compute_seconds(batch: int, repeats: int = 20) -> float:
    """Median time of one forward+backward of the model on this rank alone (no collectives)."""
    model = make_model()
    inputs, targets = torch.randn(batch, WIDTH), torch.randint(0, 10, (batch,))
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        nn.functional.cross_entropy(model(inputs), targets).backward()
        times.append(time.perf_counter() - started)
    return sorted(times)[len(times) // 2]


def busy_compute(seconds: float) -> None:
    """Compute (small matrix products) for `seconds`: a slower GPU or a CPU burner next to the rank."""
    matrix = torch.randn(64, 64)
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        matrix = torch.tanh(matrix @ matrix)


def sync_metric(value: torch.Tensor, rank: int, odd_rank: int) -> None:
    """Average a metric over the ranks; the odd rank calls the wrong collective (a classic bug)."""
    if rank == odd_rank:
        dist.broadcast(value, src=0)
    else:
        dist.all_reduce(value)


def busy_thread() -> None:
    """Burns CPU in Python, holding the interpreter whenever it runs."""
    total = 0
    while True:
        total = (total + 1) % 1_000_003


def churn_cycles(count: int) -> None:
    """Build `count` reference cycles, then drop them: garbage that only the cyclic collector frees. Alone on
    this machine, 5,000 cost ~5.5 ms, 90 % of it in ~7 collections a call, a full one every ~20 calls."""
    cycles = []
    for _ in range(count):
        node: dict[str, object] = {}
        node["self"] = node
        cycles.append(node)
    del cycles


def scrape_own_endpoint() -> None:
    """GET this rank's /metrics from the exporter attached to it, and read the whole answer."""
    port = int(os.environ["FLARE_PORT"]) + int(os.environ.get("LOCAL_RANK", "0"))
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)  # valgrind renders slowly
    try:
        connection.request("GET", "/metrics", headers={"Accept-Encoding": "gzip"})
        response = connection.getresponse()
        response.read()
        if response.status != 200:
            raise RuntimeError(f"the exporter answered /metrics with HTTP {response.status}")
    finally:
        connection.close()


class HostDelay(TorchDispatchMode):
    """Busy-waits `seconds` on the host before every op, as a slowed issue path would."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        until = time.perf_counter() + self.seconds
        while time.perf_counter() < until:
            pass
        return func(*args, **(kwargs or {}))


def launch_kernels(device, count: int, seconds: float, stall: float) -> None:  # type: ignore[no-untyped-def]
    """Launch `count` fake kernels; a stall (if any) between the two halves lets the device queue drain."""
    for index in range(count):
        if stall and index == count // 2:
            time.sleep(stall)
        device.launch(seconds)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--wait-for", default="")
    parser.add_argument("--start-after", default="")
    parser.add_argument("--report", default="")
    parser.add_argument("--scrape-every", type=int, default=0)
    parser.add_argument("--fault", choices=FAULTS, default="none")
    parser.add_argument("--fault-rank", type=int, default=1)
    parser.add_argument("--fault-step", type=int, default=10)
    parser.add_argument("--step-seconds", type=float, default=0.0)
    parser.add_argument("--slow-rank", type=int, default=-2)  # -1: every rank; default: none
    parser.add_argument("--slowdown", type=float, default=0.0)
    parser.add_argument("--slow-from-step", type=int, default=0)
    parser.add_argument("--slow-by", choices=("compute", "sleep"), default="compute")
    parser.add_argument("--stall-seconds", type=float, default=0.02)
    parser.add_argument("--contention-threads", type=int, default=2)
    parser.add_argument("--host-delay-seconds", type=float, default=20e-6)
    parser.add_argument("--gc-rank", type=int, default=-2)  # default: none
    parser.add_argument("--gc-cycles", type=int, default=10000)
    parser.add_argument("--gc-from-step", type=int, default=-1)  # default: --fault-step
    parser.add_argument("--fake-kernels", type=int, default=0)
    parser.add_argument("--fake-kernel-seconds", type=float, default=0.001)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--width", type=int, default=WIDTH)
    parser.add_argument("--data-workers", type=int, default=0)
    parser.add_argument("--slow-data-seconds", type=float, default=0.0)
    parser.add_argument("--pg-timeout", type=float, default=0.0)
    parser.add_argument("--pair-groups", action="store_true")
    parser.add_argument("--sync-mb", type=float, default=0.0)
    parser.add_argument("--fr-dump-after", type=float, default=0.0)
    return parser.parse_args(argv)


class SyntheticData(Dataset):
    """Random samples; on the faulty rank, the sample of the fault step fails to read (a stale NFS handle)."""

    def __init__(
        self, width: int, batch: int, seed: int, fail_at_batch: int, batch_delay: float = 0.0
    ) -> None:
        self.width, self.batch, self.seed, self.fail_at_batch = width, batch, seed, fail_at_batch
        self.batch_delay = batch_delay  # seconds slept at each batch's first sample (a slow dataset)

    def __len__(self) -> int:
        return 1 << 30

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if index // self.batch == self.fail_at_batch:
            raise OSError(errno.ESTALE, os.strerror(errno.ESTALE), "/mnt/dataset/shard-00017.bin")
        if self.batch_delay and index % self.batch == 0:
            time.sleep(self.batch_delay)
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        return torch.randn(self.width, generator=generator), torch.randint(0, 10, (), generator=generator)


class Training:
    """One rank's job: its process group, model, optimizer and input, and the faults it was told to play."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.on_gpu = args.device == "cuda"
        if self.on_gpu:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        timeout = datetime.timedelta(seconds=args.pg_timeout) if args.pg_timeout else None
        dist.init_process_group("nccl" if self.on_gpu else "gloo", timeout=timeout)
        self.rank = dist.get_rank()
        self.pair = pair_group(self.rank, dist.get_world_size(), timeout) if args.pair_groups else None
        cuda = torch.device("cuda", torch.cuda.current_device()) if self.on_gpu else None
        self.tensor_device = cuda or torch.device("cpu")
        self.model = nn.parallel.DistributedDataParallel(make_model(args.width).to(self.tensor_device))
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01)
        self.generator = torch.Generator(self.tensor_device).manual_seed(self.rank)
        self.faulty = self.rank == args.fault_rank
        elements = int(args.sync_mb * 2**20 / 4)
        self.synced_state = torch.zeros(elements, device=self.tensor_device) if elements else None
        self.device = None
        if args.fake_kernels:
            from flare_exporter.rank.fake_device import FakeDevice  # a script: no relative import

            self.device = FakeDevice()
        self.extra_compute = self._extra_compute()
        self.batches = self._loader()

    def _extra_compute(self) -> float:
        args = self.args
        if not (args.slowdown > 0 and args.slow_rank in (-1, self.rank)):
            return 0.0
        if args.slow_by == "sleep":
            return args.slowdown * NOMINAL_COMPUTE_SECONDS
        return args.slowdown * compute_seconds(args.batch)

    def _loader(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]] | None:
        """A real DataLoader with worker processes (--data-workers), or None: inputs drawn in the step."""
        args = self.args
        if not args.data_workers:
            return None
        fail_at = args.fault_step if args.fault == "estale" and self.faulty else -1
        data = SyntheticData(args.width, args.batch, self.rank, fail_at, args.slow_data_seconds)
        return iter(DataLoader(data, batch_size=args.batch, num_workers=args.data_workers))

    def batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.batches is not None:
            inputs, targets = next(self.batches)
            return inputs.to(self.tensor_device), targets.to(self.tensor_device)
        args, device, generator = self.args, self.tensor_device, self.generator
        inputs = torch.randn(args.batch, args.width, generator=generator, device=device)
        return inputs, torch.randint(0, 10, (args.batch,), generator=generator, device=device)

    def before_step(self, step: int) -> None:
        """The faults that act before a step's compute (contention, delays, stalls, fake kernels)."""
        args = self.args
        if self.extra_compute and step >= args.slow_from_step:
            (time.sleep if args.slow_by == "sleep" else busy_compute)(self.extra_compute)
        if step == args.fault_step and self.faulty:
            if args.fault == "contention":
                for _ in range(args.contention_threads):
                    threading.Thread(target=busy_thread, daemon=True).start()
            if args.fault == "host-delay":
                HostDelay(args.host_delay_seconds).__enter__()  # stays on for the rest of the run
        gc_from = args.fault_step if args.gc_from_step < 0 else args.gc_from_step
        if self.rank == args.gc_rank and step >= gc_from:
            churn_cycles(args.gc_cycles)
        stalled = args.fault == "host-stall" and self.faulty and step >= args.fault_step
        stall = args.stall_seconds if stalled else 0.0
        if self.device is not None:
            launch_kernels(self.device, args.fake_kernels, args.fake_kernel_seconds, stall)
        elif stall:
            time.sleep(stall)

    def at_fault_step(self, step: int) -> None:
        """The faults that strike at the fault step itself, before its forward pass."""
        args = self.args
        if step != args.fault_step:
            return
        if args.fault == "stuck" and self.faulty:
            stuck_in_compute()
        if args.fault == "raise" and self.faulty:
            raise RuntimeError(f"injected fault on rank {self.rank} at step {step}")
        if args.fault == "oom" and self.faulty:
            self.model.register_forward_pre_hook(out_of_memory)  # raised inside the forward pass
        if args.fault == "mismatch":
            sync_metric(torch.ones(16), self.rank, args.fault_rank)

    def step(self, step: int) -> float:
        """One training step; returns when DDP's all-reduce finished (perf_counter)."""
        self.before_step(step)
        self.at_fault_step(step)
        if self.pair is not None:
            dist.all_reduce(torch.ones(4, device=self.tensor_device), group=self.pair)
        inputs, targets = self.batch()
        loss = nn.functional.cross_entropy(self.model(inputs), targets)
        self.optimizer.zero_grad()
        loss.backward()
        if self.synced_state is not None:
            dist.all_reduce(self.synced_state)
        synced = time.perf_counter()  # DDP's all-reduce is done: every rank is here at about this time
        self.optimizer.step()
        if self.device is not None:
            self.device.synchronize()
        if self.on_gpu:
            torch.cuda.synchronize()
        if self.args.step_seconds:
            time.sleep(max(0.0, self.args.step_seconds - (time.perf_counter() - synced)))
        return synced


def pair_group(rank: int, world_size: int, timeout: datetime.timedelta | None) -> Any:
    """This rank's group of two (ranks 0-1, 2-3, ...; the last alone in an odd world): every rank creates
    every pair, in the same order, as torch.distributed asks. Described as "tp", as a tensor-parallel
    group is: flare names it tp-<hash> and gives it the role tp."""
    pairs = [
        dist.new_group(list(range(first, min(first + 2, world_size))), timeout=timeout, group_desc="tp")
        for first in range(0, world_size, 2)
    ]
    return pairs[rank // 2]


def out_of_memory(module: nn.Module, inputs: Any) -> None:
    """A forward pre-hook that runs out of device memory, as a too-large batch does."""
    raise torch.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity of 79.11 GiB of which "
        "1.25 GiB is free."
    )


class StepReport:
    """Each step's wall time, the training thread's and the process's CPU time, and when it ended."""

    def __init__(self) -> None:
        self.step_times: list[float] = []
        self.step_cpu: list[float] = []
        self.process_cpu: list[float] = []
        self.step_ends: list[float] = []
        self.threads_before = threads_cpu()

    def measure(self, run_step: Callable[[], object]) -> None:
        started = time.perf_counter()
        cpu_started, process_started = time.thread_time(), time.process_time()
        run_step()
        self.step_times.append(time.perf_counter() - started)
        self.step_cpu.append(time.thread_time() - cpu_started)
        self.process_cpu.append(time.process_time() - process_started)
        self.step_ends.append(time.time())

    def write(self, path: str, rank: int) -> None:
        threads_after = threads_cpu()
        report = {
            "rank": rank,
            "step_times": self.step_times,
            "step_cpu": self.step_cpu,
            "process_cpu": self.process_cpu,
            "step_ends": self.step_ends,
            "cpus": sorted(os.sched_getaffinity(0)),  # where it may run
            "threads_cpu": {
                name: threads_after[name] - self.threads_before.get(name, 0.0) for name in threads_after
            },
        }
        with open(path, "w") as out:
            json.dump(report, out)


def main() -> None:
    args = parse_args()
    training = Training(args)
    if args.fr_dump_after:
        from flare_exporter.local.workloads.flight_recorder_dumps import DumpOnHang  # a script: absolute

        DumpOnHang(args.fr_dump_after).start()
    if args.start_after:
        open(f"{args.start_after}.ready", "w").close()
        while not os.path.exists(args.start_after):
            time.sleep(0.01)
    report = StepReport()
    for step in range(args.steps):
        report.measure(functools.partial(training.step, step))
        if args.scrape_every and (step + 1) % args.scrape_every == 0:
            scrape_own_endpoint()
    if args.report:
        report.write(args.report, training.rank)
    dist.barrier()
    while args.wait_for and not os.path.exists(args.wait_for):
        time.sleep(0.05)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
