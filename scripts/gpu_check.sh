#!/usr/bin/env bash
# Checks to run on a lent GPU machine, from the repository root or anywhere:
#
#     scripts/gpu_check.sh            # PYTHON=... to choose the interpreter (default: .venv/bin/python, python3)
#
# Each part prints one line, PASS, FAIL or SKIP (what it needs is missing), and the next part runs anyway:
#   1. nvidia-smi summary            2. torch.cuda events (and flare's TorchCudaEvents)
#   3. cupy events (CupyEvents)      4. build the native shim (make -C cuda_hooks)
#   5. a torch CUDA workload (matmuls + NCCL all-reduce, world size 1) under LD_PRELOAD: the ring's records
#   6. flare-run --shim end to end: the kernel_issue histogram and the shim's collective statistics
#   7. NVML through flare_exporter.rank.gpu_health (pynvml)
#   8. the C step hook: ILD windows handed to it on CPU, taken back for the dispatch mode once CUDA is up
#   9. the overhead benchmark on the GPU (benchmarks/overhead.py --device cuda): one NCCL rank per job, an
#      MLP of width GPU_OVERHEAD_WIDTH (default 4096) at batch 512, GPU_OVERHEAD_PAIRS pairs without and with
#      flare (default 10; 0 skips it); its JSON goes to GPU_CHECK_OUT if set (a directory)
# Exit status: 0 if no part failed, 1 otherwise.
# shellcheck disable=SC2317  # the part functions are called indirectly, through part()
set -u

cd "$(dirname "$0")/.." || exit 1
REPO=$(pwd)
if [ -n "${PYTHON:-}" ]; then
    PY=$PYTHON
elif [ -x .venv/bin/python ]; then
    PY=.venv/bin/python
else
    PY=python3
fi
PART_TIMEOUT=${PART_TIMEOUT:-300}
WORK=$(mktemp -d -t flare-gpu-check.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
# each part runs in a child bash (for its time limit), which sees only exported variables
export PY REPO WORK OMP_NUM_THREADS=1 PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
SUMMARY=()
FAILED=0

# part NAME FUNCTION [SECONDS]: run it with a time limit (default PART_TIMEOUT); exit status 0 PASS, 77 SKIP,
# anything else FAIL
part() {
    local name=$1 function=$2 limit=${3:-$PART_TIMEOUT} status verdict
    echo "=== $name"
    timeout "$limit" bash -c "$(declare -f "$function"); $function" 2>&1
    status=$?
    case $status in
        0) verdict=PASS ;;
        77) verdict=SKIP ;;
        124) verdict="FAIL (timed out after ${limit}s)" ;;
        *) verdict="FAIL (exit $status)" ;;
    esac
    [ "${verdict%% *}" = FAIL ] && FAILED=1
    echo "${verdict%% *}: $name${verdict#"${verdict%% *}"}"
    SUMMARY+=("${verdict%% *}: $name")
}

nvidia_smi_summary() {
    command -v nvidia-smi >/dev/null || { echo "no nvidia-smi"; exit 77; }
    nvidia-smi -L &&
        nvidia-smi --query-gpu=name,driver_version,memory.total,temperature.gpu,power.draw,clocks.sm,clocks.max.sm,pcie.link.gen.current,pcie.link.width.current --format=csv &&
        nvidia-smi | sed -n '1,4p'
}

torch_events() {
    "$PY" - <<'EOF'
import sys, time
try:
    import torch
except ImportError:
    print("torch is not installed"); sys.exit(77)
if not torch.cuda.is_available():
    print("torch", torch.__version__, "sees no CUDA device"); sys.exit(77)
print("torch", torch.__version__, "CUDA", torch.version.cuda, "NCCL", torch.cuda.nccl.version(),
      "device", torch.cuda.get_device_name(0))
a = torch.randn(2048, 2048, device="cuda")
start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
start.record(); b = a @ a; end.record(); end.synchronize()
elapsed = start.elapsed_time(end)
print(f"2048^2 matmul: {elapsed:.3f} ms between events")
from flare_exporter.rank.exporter_health import ExporterHealth
from flare_exporter.rank.timing import TorchCudaEvents
events = TorchCudaEvents(ExporterHealth(), 8)
launched = time.perf_counter(); event = events.record(); b = a @ a
while not events.query(event):
    time.sleep(0.001)
latency = events.timestamp(event) - launched
print(f"TorchCudaEvents: device reached the event {latency * 1e6:.1f} us after the host recorded it")
sys.exit(0 if elapsed > 0 and -1e-3 < latency < 1.0 else 1)
EOF
}

cupy_events() {
    "$PY" - <<'EOF'
import sys, time
try:
    import cupy
except ImportError:
    print("cupy is not installed (the `cupy` extra)"); sys.exit(77)
from flare_exporter.rank.exporter_health import ExporterHealth
from flare_exporter.rank.timing import CupyEvents
a = cupy.random.rand(2048, 2048, dtype=cupy.float32)
start, end = cupy.cuda.Event(), cupy.cuda.Event()
start.record(); a @ a; end.record(); end.synchronize()
elapsed = cupy.cuda.get_elapsed_time(start, end)
events = CupyEvents(ExporterHealth(), 8)
launched = time.perf_counter(); event = events.record(); a @ a
while not events.query(event):
    time.sleep(0.001)
latency = events.timestamp(event) - launched
print(f"cupy {cupy.__version__}: matmul {elapsed:.3f} ms; CupyEvents latency {latency * 1e6:.1f} us")
sys.exit(0 if elapsed > 0 and -1e-3 < latency < 1.0 else 1)
EOF
}

build_shim() {
    command -v gcc >/dev/null || { echo "no gcc"; exit 77; }
    make -C cuda_hooks EXTRA_CFLAGS=-Werror && ls -l cuda_hooks/build/libflare_hooks.so
}

shim_under_torch() {
    [ -f cuda_hooks/build/libflare_hooks.so ] || { echo "the shim is not built (part 4)"; exit 77; }
    "$PY" -c 'import sys, torch; torch.cuda.is_available() or sys.exit("torch sees no CUDA device")' || exit 77
    mkdir -p "$WORK/rings"
    LD_PRELOAD="$REPO/cuda_hooks/build/libflare_hooks.so" FLARE_SHIM_RING_DIR="$WORK/rings" \
        FLARE_SHIM_KEEP_RING=1 FLARE_SHIM_SAMPLE_EVERY=8 MASTER_ADDR=127.0.0.1 MASTER_PORT=29571 \
        RANK=0 WORLD_SIZE=1 "$PY" - <<'EOF'
import ctypes, statistics, sys
import torch
import torch.distributed as dist
from flare_exporter.rank import shim
from flare_exporter.rank.exporter_health import ExporterHealth

print("shim mapped into this process:", shim.shim_loaded())
torch.cuda.set_device(0)
dist.init_process_group("nccl", init_method="env://")
a = torch.randn(1024, 1024, device="cuda")
for _ in range(200):
    a = a @ a.T
    a = a / a.norm()
t = torch.ones(1 << 20, device="cuda")
for _ in range(20):
    dist.all_reduce(t)
torch.cuda.synchronize()
print("flush:", ctypes.CDLL(None).flare_hooks_flush(10000))
reader = shim.RingReader(shim.ring_path(), ExporterHealth())
records = reader.read()
header = reader.header
print("header:", header)
kernels = [r for r in records if r.is_kernel]
nccl = [r for r in records if not r.is_kernel]
print(f"records: {len(records)} ({len(kernels)} kernel launches, {len(nccl)} NCCL calls), lost {reader.lost}")
print("by API:", {api: sum(r.api == api for r in records) for api in sorted({r.api for r in records})})
latencies = [r.issue_latency_seconds * 1e6 for r in kernels]
if latencies:
    print("issue latency us, first 8:", [round(v, 1) for v in latencies[:8]],
          f"median {statistics.median(latencies):.1f}")
if nccl:
    print("NCCL device durations us, first 5:", [round(r.duration_seconds * 1e6, 1) for r in nccl[:5]],
          "bytes", nccl[0].nbytes, "grouped", bool(nccl[0].flags & shim.GROUPED))
dist.destroy_process_group()
sys.exit(0 if kernels and nccl else 1)
EOF
}

flare_run_shim() {
    [ -f cuda_hooks/build/libflare_hooks.so ] || { echo "the shim is not built (part 4)"; exit 77; }
    "$PY" -c 'import sys, torch; torch.cuda.is_available() or sys.exit("torch sees no CUDA device")' || exit 77
    cat >"$WORK/train.py" <<'EOF'
import sys, torch
import torch.distributed as dist
from flare_exporter.rank import attach, shim

torch.cuda.set_device(0)
dist.init_process_group("nccl", init_method="env://")
model = torch.nn.Linear(512, 512).cuda()
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
for _ in range(30):
    loss = model(torch.randn(64, 512, device="cuda")).square().mean()
    loss.backward()
    dist.all_reduce(model.weight.grad)
    optimizer.step()
    optimizer.zero_grad()
torch.cuda.synchronize()
state = attach.attached().state
state.manager.drain()
kernel = state.ild.kernel_issue.histogram
stats = {op: sum(s.durations.counts) for op, s in state.shim_feed.collectives.items()}
print("shim loaded:", shim.shim_loaded(), "kernel_issue samples:", sum(kernel.counts),
      "shim collectives:", stats, "dropped:", dict(state.health.dropped), "errors:", dict(state.health.errors))
dist.destroy_process_group()
sys.exit(0 if shim.shim_loaded() and sum(kernel.counts) > 0 and stats else 1)
EOF
    FLARE_SHIM_RING_DIR="$WORK" MASTER_ADDR=127.0.0.1 MASTER_PORT=29572 RANK=0 WORLD_SIZE=1 \
        "$PY" -m flare_exporter.launch --shim --port 0 "$WORK/train.py"
}

nvml_health() {
    "$PY" - <<'EOF'
import sys
from flare_exporter.rank import gpu_health
from flare_exporter.rank.exporter_health import ExporterHealth
nvml = gpu_health.load_nvml("pynvml")
if nvml is None:
    print("pynvml is not installed (the `nvml` extra)"); sys.exit(77)
health = ExporterHealth()
monitor = gpu_health.GpuHealthMonitor(nvml, 0, health)
if not monitor.open():
    print("NVML did not open:", dict(health.errors)); sys.exit(1)
monitor.poll()
print("uuid", monitor.uuid, "pci", monitor.pci_bus_id, "xid events:", monitor.listens_for_xid)
print("reading:", monitor.reading)
sys.exit(0 if monitor.up else 1)
EOF
}

c_step_hook_on_cuda() {
    "$PY" -m flare_exporter.rank.cpp_recorder >/dev/null || exit 1
    "$PY" - <<'EOF'
import sys
import torch
if not torch.cuda.is_available():
    print("no CUDA device"); sys.exit(77)
from flare_exporter.config import Config
from flare_exporter.rank.identity import RankIdentity
from flare_exporter.rank.state import FlareState

def train(state, model, optimizer, steps, device):
    for _ in range(steps):
        model(torch.randn(64, 256, device=device)).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    if device == "cuda":
        torch.cuda.synchronize()
    state.manager.drain()

# the C step hook counts; on CPU the ILD windows go to it, and come back once CUDA is up (no native shim)
config = Config(ild_dispatch_every_steps=4, ild_launch_sample_every=1, gpu_health=False)
state = FlareState.create(config, RankIdentity(0, 0, 1, "gpu", "h", 1))
state.steps.install()
state.ild.install()
model = torch.nn.Linear(256, 256)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
train(state, model, optimizer, 8, "cpu")
print("CPU: counted", state.steps.steps, "C hook", state.steps.counter is not None,
      "windows handed over", state.ild.dispatch.handed_over)
ok = state.steps.steps == 8 and state.steps.counter is not None and state.ild.dispatch.handed_over
model.cuda()  # CUDA comes up after attach
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
train(state, model, optimizer, 1, "cuda")  # the drain takes the windows back
train(state, model, optimizer, 24, "cuda")
kernels = sum(state.ild.kernel_issue.histogram.counts)
print("CUDA: counted", state.steps.steps, "windows handed over", state.ild.dispatch.handed_over,
      "kernel issue samples", kernels, "errors", dict(state.health.errors))
ok = ok and state.steps.steps == 33 and not state.ild.dispatch.handed_over and kernels > 0
state.steps.remove()
state.ild.remove()
sys.exit(0 if ok and not state.health.errors else 1)
EOF
}

overhead_on_gpu() {
    [ "$GPU_OVERHEAD_PAIRS" -gt 0 ] || { echo "GPU_OVERHEAD_PAIRS=0"; exit 77; }
    "$PY" -c 'import sys, torch; torch.cuda.is_available() or sys.exit("torch sees no CUDA device")' || exit 77
    "$PY" benchmarks/overhead.py --device cuda --ranks 1 --width "$GPU_OVERHEAD_WIDTH" --batch 512 \
        --pairs "$GPU_OVERHEAD_PAIRS" --steps 2000 --warmup 100 \
        --json "${GPU_CHECK_OUT:-$WORK}/overhead-gpu-width$GPU_OVERHEAD_WIDTH.json"
}

export GPU_OVERHEAD_PAIRS=${GPU_OVERHEAD_PAIRS:-10} GPU_OVERHEAD_WIDTH=${GPU_OVERHEAD_WIDTH:-4096}
part "1 nvidia-smi summary" nvidia_smi_summary
part "2 torch.cuda events" torch_events
part "3 cupy events" cupy_events
part "4 build the native shim" build_shim
part "5 shim under a torch CUDA + NCCL workload" shim_under_torch
part "6 flare-run --shim end to end" flare_run_shim
part "7 NVML via flare_exporter.rank.gpu_health" nvml_health
part "8 the C step hook on CUDA: ILD windows back to the dispatch mode" c_step_hook_on_cuda
part "9 the overhead benchmark on the GPU" overhead_on_gpu 480

echo "=== summary"
printf '%s\n' "${SUMMARY[@]}"
exit "$FAILED"
