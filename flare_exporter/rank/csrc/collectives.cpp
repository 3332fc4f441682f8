// Every collective of a gloo group, recorded without Python: a c10d Backend that wraps the real one.
//
// process_group.py registers it (wrap_backend) in place of the real ProcessGroupGloo, so DDP's reducer, FSDP
// and Python calls all reach it from C++, and the training thread never takes the GIL for a collective.
// For each collective it claims a record in its group's CollectiveLog (op, bytes, sequence number, issue
// time), delegates to the real backend, and adds a C++ callback to the work's future that stamps the
// completion time on the thread that completes it (gloo's). A work without a future (gloo's send, recv and
// reduce_scatter) shows its completion only to its wait(), which stamps it (WaitedWork). Point-to-point
// ops carry their peer and take no sequence number. The timing manager's thread takes the log at every
// drain (take()): the completed records, in issue order, also counted per op into the duration histogram's
// buckets (so that the drain's Python work does not grow with the collectives), the oldest collective not
// completed (in flight) and every point-to-point op in flight.
//
// A log is a ring of records. The issuing thread claims the next record with a compare-and-swap (no lock, no
// allocation); a record is free again once it was taken completed and every record before it too, so a
// collective that never completes (failed, or hung) stays in flight, and once the ring is full further
// collectives are counted as dropped, not recorded: the same bound as the Python hooks' pending queue.
//
// A scrape's render holds the GIL for a millisecond or more, and the training thread, which takes the GIL back
// after every op, would wait for it: in a synchronous job, every rank with it. While the training thread waits
// for a collective it needs no GIL, so a scrape first waits (wait_for_collective, the GIL released) until the
// next collective is issued, and renders while training waits for it (TimingManager.await_collective).

#include "collectives.h"
#include "dispatch_timer.h"

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#endif

#include "clock.h"

namespace flare {
namespace {

// The op labels, as process_group.WRAPPED_METHODS names them (a test checks that they agree).
enum Op : uint8_t {
  kAllreduce,
  kAllreduceCoalesced,
  kBroadcast,
  kReduce,
  kAllgather,
  kAllgatherBase,
  kAllgatherCoalesced,
  kAllgatherIntoTensorCoalesced,
  kGather,
  kScatter,
  kReduceScatter,
  kReduceScatterBase,
  kReduceScatterTensorCoalesced,
  kAlltoall,
  kAlltoallBase,
  kSend,
  kRecv,
  kRecvAnysource,
  kBarrier,
  kOpCount,
};
const char* const kOpNames[kOpCount] = {
    "allreduce", "allreduce_coalesced", "broadcast", "reduce", "allgather", "allgather_base",
    "allgather_coalesced", "allgather_into_tensor_coalesced", "gather", "scatter", "reduce_scatter",
    "reduce_scatter_base", "reduce_scatter_tensor_coalesced", "alltoall", "alltoall_base", "send", "recv",
    "recv_anysource", "barrier",
};

inline bool point_to_point(Op op) { return op == kSend || op == kRecv || op == kRecvAnysource; }

enum State : uint32_t {
  kFree,       // claimed by the issuing thread, not yet written (or not claimed)
  kIssued,     // in flight
  kCompleted,  // its completion stamped; the next take hands it over
  kFailed,     // completed with an error: it stays in flight, as a hung collective would
  kTaken,      // handed over (or abandoned: the real backend raised); free once every record before it is
};

// Scrapes waiting for the next collective issued by any recording backend. The issuing thread takes no lock:
// one load when nobody waits, else a bump of `issues` and a futex wake.
class IssueSignal {
 public:
  // The issuing thread, once its collective is under way.
  void issued() {
    if (waiters_.load(std::memory_order_seq_cst) == 0) return;
    issues_.fetch_add(1, std::memory_order_seq_cst);
#ifdef __linux__
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(&issues_), FUTEX_WAKE_PRIVATE, INT32_MAX, nullptr, nullptr, 0);
#endif
  }

  // Any thread, without the GIL: true once a collective is issued after the call, false after `timeout`. A
  // collective issued while the waiter was arriving may be missed; the next one wakes it.
  bool wait(double timeout_seconds) {
    waiters_.fetch_add(1, std::memory_order_seq_cst);
    uint32_t seen = issues_.load(std::memory_order_seq_cst);
    auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_seconds);
    bool issued = false;
    while (!(issued = issues_.load(std::memory_order_seq_cst) != seen)) {
      auto left = deadline - std::chrono::steady_clock::now();
      if (left <= std::chrono::steady_clock::duration::zero()) break;
#ifdef __linux__
      auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(left).count();
      struct timespec relative = {static_cast<time_t>(ns / 1000000000), static_cast<long>(ns % 1000000000)};
      syscall(SYS_futex, reinterpret_cast<uint32_t*>(&issues_), FUTEX_WAIT_PRIVATE, seen, &relative, nullptr, 0);
#else
      std::this_thread::sleep_for(std::min<std::chrono::steady_clock::duration>(left, std::chrono::milliseconds(1)));
#endif
    }
    waiters_.fetch_sub(1, std::memory_order_seq_cst);
    return issued;
  }

  uint32_t waiters() const { return waiters_.load(std::memory_order_seq_cst); }

 private:
  std::atomic<uint32_t> waiters_{0};
  std::atomic<uint32_t> issues_{0};  // the futex word
  static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t), "a futex is a plain 32-bit word");
};

IssueSignal& issue_signal() {
  static IssueSignal* signal = new IssueSignal();  // never destroyed: backends may issue during exit
  return *signal;
}

struct Record {
  std::atomic<uint32_t> state{kFree};
  Op op = kAllreduce;
  bool failure_counted = false;  // consumer only
  int64_t nbytes = 0;
  uint64_t seq = 0;  // 0 for point-to-point ops, which have no group-wide sequence
  int32_t peer = -1;  // a point-to-point op's peer (group rank; -1: any source, or a collective)
  int64_t issued_ns = 0;
  int64_t completed_ns = 0;  // written before the state becomes kCompleted or kFailed
};

// One op's collectives completed since the last take, counted for the duration histogram: only the buckets
// that count any, as (bucket index, collectives).
struct OpCounts {
  int64_t collectives = 0;
  int64_t nbytes = 0;
  double seconds = 0.0;
  uint64_t last_seq = 0;
  std::vector<std::pair<int64_t, int64_t>> buckets;

  void add(const Record& record, double duration, const std::vector<double>& bounds) {
    ++collectives;
    nbytes += record.nbytes;
    seconds += duration;
    last_seq = std::max(last_seq, record.seq);
    int64_t index = std::lower_bound(bounds.begin(), bounds.end(), duration) - bounds.begin();
    for (auto& bucket : buckets) {
      if (bucket.first == index) {
        ++bucket.second;
        return;
      }
    }
    buckets.emplace_back(index, 1);
  }

  pybind11::tuple tuple(Op op) const {
    return pybind11::make_tuple(kOpNames[op], collectives, nbytes, seconds, buckets, last_seq);
  }
};

class CollectiveLog : public std::enable_shared_from_this<CollectiveLog> {
 public:
  explicit CollectiveLog(uint64_t capacity) {
    uint64_t size = 16;
    while (size < capacity) size <<= 1;
    records_.reset(new Record[size]);
    mask_ = size - 1;
  }

  // The issuing thread: a record of `op` issued now, or nullptr (counted) when the ring is full. Its sequence
  // number is taken either way, so that every rank numbers the group's collectives alike.
  Record* issue(Op op, int64_t nbytes, int32_t peer = -1) {
    uint64_t seq = point_to_point(op) ? 0 : next_seq_.fetch_add(1, std::memory_order_relaxed) + 1;
    int64_t issued_ns = now_ns();
    last_issued_ns_.store(issued_ns, std::memory_order_relaxed);
    uint64_t head = head_.load(std::memory_order_relaxed);
    do {
      if (head - tail_.load(std::memory_order_acquire) > mask_) {
        dropped_.fetch_add(1, std::memory_order_relaxed);
        return nullptr;
      }
    } while (!head_.compare_exchange_weak(head, head + 1, std::memory_order_acq_rel));
    Record& record = records_[head & mask_];
    record.op = op;
    record.failure_counted = false;
    record.nbytes = nbytes;
    record.seq = seq;
    record.peer = peer;
    record.issued_ns = issued_ns;
    record.completed_ns = 0;
    record.state.store(kIssued, std::memory_order_release);
    return &record;
  }

  // The issuing thread, after the real backend returned `work`: who will notice its completion. Returns the
  // work to hand to the caller: `work`, or a WaitedWork around it.
  c10::intrusive_ptr<c10d::Work> track(Record* record, const c10::intrusive_ptr<c10d::Work>& work);

  // The real backend raised (the collective was never issued), or its completion cannot be followed
  // (`dropped`: counted as such). Its record is handed over as nothing.
  void abandon(Record* record, bool dropped = false) {
    if (dropped) dropped_.fetch_add(1, std::memory_order_relaxed);
    record->state.store(kTaken, std::memory_order_release);
  }

  // Any thread, once.
  static void complete(Record* record, bool failed, int64_t completed_ns) {
    record->completed_ns = completed_ns;
    record->state.store(failed ? kFailed : kCompleted, std::memory_order_release);
  }

  // The consumer (the timing manager's drain, one at a time): what completed since the last take, in issue
  // order, as (issue time, seconds, op, bytes, sequence number, peer), which the straggler windows keep as
  // they are; the same counted per op, as (op, collectives, bytes, seconds, [(bucket index, collectives)],
  // highest sequence number), the durations bucketed by `bounds` (ascending upper bounds; index
  // len(bounds) is +Inf; a duration equal to a bound counts in that bound's bucket, as Python's
  // bisect_left); the oldest collective in flight, as (op, bytes, sequence number, issue time) or None;
  // every point-to-point op in flight, oldest first, as (op, bytes, peer, issue time); the newest issued
  // sequence number and issue time; how many collectives were dropped since the last take; and how many
  // failed.
  pybind11::tuple take(const std::vector<double>& bounds) {
    pybind11::list completed;
    OpCounts counts[kOpCount];
    pybind11::object oldest = pybind11::none();
    pybind11::list point_to_point_in_flight;
    uint64_t failed = 0;
    uint64_t tail = tail_.load(std::memory_order_relaxed);
    uint64_t head = head_.load(std::memory_order_acquire);
    bool freeing = true;  // still at the front: taken records are freed
    for (uint64_t index = tail; index < head; ++index) {
      Record& record = records_[index & mask_];
      uint32_t state = record.state.load(std::memory_order_acquire);
      if (state == kFree) break;  // claimed, not yet written: the records after it are newer still
      if (state == kCompleted) {
        double duration = seconds(record.completed_ns - record.issued_ns);
        completed.append(pybind11::make_tuple(seconds(record.issued_ns), duration, kOpNames[record.op],
                                              record.nbytes, record.seq, record.peer));
        counts[record.op].add(record, duration, bounds);
        record.state.store(kTaken, std::memory_order_relaxed);
        state = kTaken;
      }
      if (state == kFailed && !record.failure_counted) {
        record.failure_counted = true;
        ++failed;
      }
      if (state == kTaken) {
        if (freeing) {
          record.state.store(kFree, std::memory_order_relaxed);
          tail = index + 1;
        }
        continue;
      }
      freeing = false;
      if (point_to_point(record.op)) {
        point_to_point_in_flight.append(
            pybind11::make_tuple(kOpNames[record.op], record.nbytes, record.peer, seconds(record.issued_ns)));
      } else if (oldest.is_none()) {  // the oldest collective still in flight
        oldest = pybind11::make_tuple(kOpNames[record.op], record.nbytes, record.seq, seconds(record.issued_ns));
      }
    }
    tail_.store(tail, std::memory_order_release);
    pybind11::list counted;
    for (int op = 0; op < kOpCount; ++op) {
      if (counts[op].collectives) counted.append(counts[op].tuple(static_cast<Op>(op)));
    }
    return pybind11::make_tuple(completed, counted, oldest, point_to_point_in_flight,
                                next_seq_.load(std::memory_order_relaxed), last_issued_at(),
                                dropped_.exchange(0, std::memory_order_relaxed), failed);
  }

  // perf_counter time of the newest collective issued (0 before the first): any thread.
  double last_issued_at() const { return seconds(last_issued_ns_.load(std::memory_order_relaxed)); }

 private:
  static double seconds(int64_t ns) { return static_cast<double>(ns) * 1e-9; }

  std::unique_ptr<Record[]> records_;
  uint64_t mask_ = 0;
  std::atomic<uint64_t> head_{0};  // the next record to claim
  std::atomic<uint64_t> tail_{0};  // the oldest record not yet free (written by the consumer)
  std::atomic<uint64_t> next_seq_{0};
  std::atomic<int64_t> last_issued_ns_{0};
  std::atomic<uint64_t> dropped_{0};
};

// A work whose completion only its wait() shows: gloo's send, recv and reduce_scatter have no future, and
// their isCompleted() stays false until they are waited for (reduce_scatter's after it completed too). Its first wait() that returns, or its end (the caller let it
// go), stamps the record; the rest is the real work's.
class WaitedWork : public c10d::Work {
 public:
  WaitedWork(c10::intrusive_ptr<c10d::Work> inner, std::shared_ptr<CollectiveLog> log, Record* record)
      : inner_(std::move(inner)), log_(std::move(log)), record_(record) {}
  ~WaitedWork() override { stamp(false); }

  bool wait(std::chrono::milliseconds timeout) override {
    bool done;
    try {
      done = inner_->wait(timeout);
    } catch (...) {
      stamp(true);
      throw;
    }
    if (done) stamp(false);
    return done;
  }
  bool isCompleted() override { return stamped_.load(std::memory_order_acquire) || inner_->isCompleted(); }
  bool isSuccess() const override { return inner_->isSuccess(); }
  std::exception_ptr exception() const override { return inner_->exception(); }
  int sourceRank() const override { return inner_->sourceRank(); }
  std::vector<at::Tensor> result() override { return inner_->result(); }
  void synchronize() override { inner_->synchronize(); }
  void blockCurrentStream() override { inner_->blockCurrentStream(); }
  void abort() override { inner_->abort(); }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return inner_->getFuture(); }
  c10::intrusive_ptr<c10::ivalue::Future> getFutureResult() override { return inner_->getFutureResult(); }
  float getDuration() const override { return inner_->getDuration(); }
  uint64_t getSequencenumber() const override { return inner_->getSequencenumber(); }

 private:
  void stamp(bool failed) {
    if (stamped_.exchange(true, std::memory_order_acq_rel)) return;
    int64_t now = now_ns();
    note_completion(now);  // a wait that returned: the caller's host gap was that wait
    CollectiveLog::complete(record_, failed, now);
  }

  c10::intrusive_ptr<c10d::Work> inner_;
  std::shared_ptr<CollectiveLog> log_;  // keeps the record alive: it is freed only once completed
  Record* record_;
  std::atomic<bool> stamped_{false};
};

c10::intrusive_ptr<c10d::Work> CollectiveLog::track(Record* record, const c10::intrusive_ptr<c10d::Work>& work) {
  c10::intrusive_ptr<c10::ivalue::Future> future;
  try {
    future = work->getFuture();
  } catch (const std::exception&) {  // no future: its wait() will tell
    return c10::make_intrusive<WaitedWork>(work, shared_from_this(), record);
  }
  future->addCallback(
      [log = shared_from_this(), record](c10::ivalue::Future& done) {
        int64_t now = now_ns();
        note_completion(now);
        log->complete(record, done.hasError(), now);
      },
      /*uses_future=*/false);
  return work;
}

int64_t bytes_of(const at::Tensor& tensor) { return static_cast<int64_t>(tensor.nbytes()); }

int64_t bytes_of(const std::vector<at::Tensor>& tensors) {
  int64_t total = 0;
  for (const auto& tensor : tensors) total += bytes_of(tensor);
  return total;
}

int64_t bytes_of(const std::vector<std::vector<at::Tensor>>& lists) {
  int64_t total = 0;
  for (const auto& tensors : lists) total += bytes_of(tensors);
  return total;
}

using WorkPtr = c10::intrusive_ptr<c10d::Work>;

// The real backend, each collective recorded in `log` around it; everything else passed through as is.
class RecordingBackend : public c10d::Backend {
 public:
  RecordingBackend(c10::intrusive_ptr<c10d::Backend> inner, std::shared_ptr<CollectiveLog> log)
      : c10d::Backend(inner->getRank(), inner->getSize()), inner_(std::move(inner)), log_(std::move(log)) {}

  // Without the GIL, as torch destroys its own backends: the real backend joins its threads, which may be
  // dropping the last reference to a tensor of Python's (and wait for the GIL to do it).
  ~RecordingBackend() override {
    if (Py_IsInitialized() && PyGILState_Check()) {
      pybind11::gil_scoped_release released;
      inner_.reset();
    }
  }

  // The collectives process_group.WRAPPED_METHODS names, with what they send (scatter and the receives: what
  // they receive), as the Python hooks count them.
  WorkPtr broadcast(std::vector<at::Tensor>& tensors, const c10d::BroadcastOptions& opts) override {
    return recorded(kBroadcast, bytes_of(tensors), [&] { return inner_->broadcast(tensors, opts); });
  }
  WorkPtr allreduce(std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts) override {
    return recorded(kAllreduce, bytes_of(tensors), [&] { return inner_->allreduce(tensors, opts); });
  }
  WorkPtr allreduce_coalesced(std::vector<at::Tensor>& tensors,
                              const c10d::AllreduceCoalescedOptions& opts) override {
    return recorded(kAllreduceCoalesced, bytes_of(tensors), [&] { return inner_->allreduce_coalesced(tensors, opts); });
  }
  WorkPtr reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) override {
    return recorded(kReduce, bytes_of(tensors), [&] { return inner_->reduce(tensors, opts); });
  }
  WorkPtr allgather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                    const c10d::AllgatherOptions& opts) override {
    return recorded(kAllgather, bytes_of(inputs), [&] { return inner_->allgather(outputs, inputs, opts); });
  }
  WorkPtr _allgather_base(at::Tensor& output, at::Tensor& input, const c10d::AllgatherOptions& opts) override {
    return recorded(kAllgatherBase, bytes_of(input), [&] { return inner_->_allgather_base(output, input, opts); });
  }
  WorkPtr allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                              const c10d::AllgatherOptions& opts) override {
    return recorded(kAllgatherCoalesced, bytes_of(inputs),
                    [&] { return inner_->allgather_coalesced(outputs, inputs, opts); });
  }
  WorkPtr allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                          const c10d::AllgatherOptions& opts) override {
    return recorded(kAllgatherIntoTensorCoalesced, bytes_of(inputs),
                    [&] { return inner_->allgather_into_tensor_coalesced(outputs, inputs, opts); });
  }
  WorkPtr gather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                 const c10d::GatherOptions& opts) override {
    return recorded(kGather, bytes_of(inputs), [&] { return inner_->gather(outputs, inputs, opts); });
  }
  WorkPtr scatter(std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
                  const c10d::ScatterOptions& opts) override {
    return recorded(kScatter, bytes_of(outputs), [&] { return inner_->scatter(outputs, inputs, opts); });
  }
  WorkPtr reduce_scatter(std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
                         const c10d::ReduceScatterOptions& opts) override {
    return recorded(kReduceScatter, bytes_of(inputs), [&] { return inner_->reduce_scatter(outputs, inputs, opts); });
  }
  WorkPtr _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                               const c10d::ReduceScatterOptions& opts) override {
    return recorded(kReduceScatterBase, bytes_of(input),
                    [&] { return inner_->_reduce_scatter_base(output, input, opts); });
  }
  WorkPtr reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                          const c10d::ReduceScatterOptions& opts) override {
    return recorded(kReduceScatterTensorCoalesced, bytes_of(inputs),
                    [&] { return inner_->reduce_scatter_tensor_coalesced(outputs, inputs, opts); });
  }
  WorkPtr alltoall_base(at::Tensor& output, at::Tensor& input, std::vector<int64_t>& output_splits,
                        std::vector<int64_t>& input_splits, const c10d::AllToAllOptions& opts) override {
    return recorded(kAlltoallBase, bytes_of(input),
                    [&] { return inner_->alltoall_base(output, input, output_splits, input_splits, opts); });
  }
  WorkPtr alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                   const c10d::AllToAllOptions& opts) override {
    return recorded(kAlltoall, bytes_of(inputs), [&] { return inner_->alltoall(outputs, inputs, opts); });
  }
  WorkPtr send(std::vector<at::Tensor>& tensors, int dst_rank, int tag) override {
    return recorded(kSend, bytes_of(tensors), [&] { return inner_->send(tensors, dst_rank, tag); }, dst_rank);
  }
  WorkPtr recv(std::vector<at::Tensor>& tensors, int src_rank, int tag) override {
    return recorded(kRecv, bytes_of(tensors), [&] { return inner_->recv(tensors, src_rank, tag); }, src_rank);
  }
  WorkPtr recvAnysource(std::vector<at::Tensor>& tensors, int tag) override {
    return recorded(kRecvAnysource, bytes_of(tensors), [&] { return inner_->recvAnysource(tensors, tag); });
  }
  WorkPtr barrier(const c10d::BarrierOptions& opts) override {
    return recorded(kBarrier, 0, [&] { return inner_->barrier(opts); });
  }

  // Passed through: the real backend answers.
  const std::string getBackendName() const override { return inner_->getBackendName(); }
  c10::intrusive_ptr<Options> getBackendOptions() override { return inner_->getBackendOptions(); }
  bool supportsSplitting() const override { return inner_->supportsSplitting(); }
  bool supportsCoalescing() const override { return inner_->supportsCoalescing(); }
  bool supportsTimeEstimation() const override { return inner_->supportsTimeEstimation(); }
  bool supportsShrinking() const override { return inner_->supportsShrinking(); }
  bool supportsTensorAlloc(c10::DeviceIndex device) override { return inner_->supportsTensorAlloc(device); }
  c10::intrusive_ptr<c10d::Backend> shrink(const std::vector<int64_t>& ranks, int flags,
                                           const c10::intrusive_ptr<Options>& opts) override {
    return inner_->shrink(ranks, flags, opts);
  }
  c10::intrusive_ptr<c10d::Backend> split(const c10::intrusive_ptr<c10d::Store>& store, const std::vector<int>& ranks,
                                          const c10::intrusive_ptr<Options>& opts) override {
    return inner_->split(store, ranks, opts);
  }
  c10::intrusive_ptr<c10d::Backend> merge(const c10::intrusive_ptr<c10d::Store>& store,
                                          const c10::intrusive_ptr<Options>& opts, const int& rank,
                                          const int& size) override {
    return inner_->merge(store, opts, rank, size);
  }
  void setTimeout(std::chrono::milliseconds timeout) override { inner_->setTimeout(timeout); }
  void startCoalescing() override { inner_->startCoalescing(); }
  WorkPtr endCoalescing() override { return inner_->endCoalescing(); }
  WorkPtr allreduce_sparse(std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts) override {
    return inner_->allreduce_sparse(tensors, opts);
  }
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) override {
    inner_->monitoredBarrier(opts, wait_all_ranks);
  }
  void setSequenceNumberForGroup() override { inner_->setSequenceNumberForGroup(); }
  uint64_t getSequenceNumberForGroup() override { return inner_->getSequenceNumberForGroup(); }
  void registerOnCompletionHook(std::function<void(std::shared_ptr<c10d::WorkInfo>)>&& hook) override {
    inner_->registerOnCompletionHook(std::move(hook));
  }
  void waitForPendingWorks() override { inner_->waitForPendingWorks(); }
  void enableCollectivesTiming() override { inner_->enableCollectivesTiming(); }
  void setGroupUid(const std::string& uid) override {
    c10d::Backend::setGroupUid(uid);
    inner_->setGroupUid(uid);
  }
  void eagerConnectSingleDevice(at::Device device) override { inner_->eagerConnectSingleDevice(device); }
  c10d::ErrorType getError() override { return inner_->getError(); }
  std::shared_ptr<c10::Allocator> getMemAllocator() override { return inner_->getMemAllocator(); }
  at::Tensor allocateTensor(long size, at::TensorOptions options) override {
    return inner_->allocateTensor(size, options);
  }
  void abort() override { inner_->abort(); }
  void shutdown() override { inner_->shutdown(); }
  void suspend() override { inner_->suspend(); }
  void resume() override { inner_->resume(); }
  std::unordered_map<std::string, uint64_t> getMemoryStats() override { return inner_->getMemoryStats(); }

 private:
  template <typename Call>
  WorkPtr recorded(Op op, int64_t nbytes, Call&& call, int32_t peer = -1) {
    Record* record = log_->issue(op, nbytes, peer);
    WorkPtr work;
    try {
      work = call();  // the user's collective: its errors are theirs
    } catch (...) {
      if (record != nullptr) log_->abandon(record);
      throw;
    }
    issue_signal().issued();
    if (record == nullptr) return work;
    try {
      return log_->track(record, work);
    } catch (...) {  // out of memory for the callback: never into training; the collective goes unrecorded
      log_->abandon(record, /*dropped=*/true);
      return work;
    }
  }

  c10::intrusive_ptr<c10d::Backend> inner_;
  std::shared_ptr<CollectiveLog> log_;
};

}  // namespace

void add_collectives(pybind11::module_& module) {
  pybind11::class_<CollectiveLog, std::shared_ptr<CollectiveLog>>(module, "CollectiveLog")
      .def(pybind11::init<uint64_t>(), pybind11::arg("capacity"))
      .def("take", &CollectiveLog::take, pybind11::arg("bounds"),
           "(completed [(issued_at, seconds, op, bytes, seq, peer)], counted per op [(op, collectives, "
           "bytes, seconds, [(bucket index, collectives)], last seq)] with durations bucketed by `bounds`, "
           "oldest collective in flight (op, bytes, seq, issued_at) or None, point-to-point ops in flight "
           "[(op, bytes, peer, issued_at)], last issued seq, last issued_at, dropped since the last take, "
           "failed since the last take)")
      .def_property_readonly("last_issued_at", &CollectiveLog::last_issued_at,
                             "perf_counter time of the newest collective issued (0 before the first)");
  module.def(
      "wrap_backend",
      [](c10::intrusive_ptr<c10d::Backend> inner, std::shared_ptr<CollectiveLog> log) {
        return c10::intrusive_ptr<c10d::Backend>(c10::make_intrusive<RecordingBackend>(std::move(inner), std::move(log)));
      },
      pybind11::arg("inner"), pybind11::arg("log"),
      "a c10d Backend that records every collective of `inner` in `log`, then delegates it");
  module.def(
      "wait_for_collective",
      [](double timeout_seconds) {
        pybind11::gil_scoped_release released;
        return issue_signal().wait(timeout_seconds);
      },
      pybind11::arg("timeout_seconds"),
      "wait, without the GIL, until a recording backend issues its next collective (true) or `timeout_seconds` "
      "pass (false)");
  module.def(
      "collective_waiters", [] { return issue_signal().waiters(); },
      "how many threads wait_for_collective is holding now");
  std::vector<std::string> ops(kOpNames, kOpNames + kOpCount);
  module.attr("COLLECTIVE_OPS") = ops;
}

}  // namespace flare
