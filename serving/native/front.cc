// The server's native gRPC front end (serving/README.md, "The native front end").
//
// grpc++'s callback server owns the public gRPC port. Every call arrives at one generic service:
//  - a ModelInfer of the common form (raw_input_contents of a lane's fixed-shape inputs, no parameters,
//    nothing the Python fast path would refuse) is checked, digested (XXH3-128, the digest our request
//    records carry) and queued on its lane (model, requested version) here, without Python;
//  - everything else (other RPCs, health's Watch, any other ModelInfer) is proxied byte for byte to the
//    grpcio server on a private Unix socket, with the caller's metadata, deadline and peer, so every answer
//    and refusal is the grpcio server's own.
// One Python thread per lane calls take() (the GIL released while it waits), runs the batch and hands the
// answers back with answer()/refuse(); Python runs once per batch, not once per request.
//
// Written against grpc++ 1.51 (Debian 12), header-only xxhash, numpy's C API.
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include <numpy/arrayobject.h>

#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/impl/codegen/proto_utils.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "digest.h"
#include "grpc_service.pb.h"

namespace {

using inference::ModelInferRequest;
using inference::ModelInferResponse;

const char kModelInfer[] = "/inference.GRPCInferenceService/ModelInfer";
// Set by this front end only (a caller's own value is dropped): the grpcio server behind reads the
// caller's address from it, since its own peer is the Unix socket.
const char kPeerKey[] = "x-sluicegate-peer";

struct InputSpec {
  std::string name, datatype;
  std::vector<int64_t> tail;  // the non-batch dimensions, all fixed
  int typenum = 0;            // numpy's type number for take()'s arrays
  int64_t row_bytes = 0, row_elements = 0;
};

class Call;

// One raw_input_contents entry where grpc received it: pieces of the request's slices, in order. The lane
// copies them straight into the batch: one copy of each input instead of two (protobuf's into a string,
// then that into the batch), and no input-sized allocation per request. Medium model (602 KB inputs),
// c=32: the copy and its page faults were ~1 % of the server's core.
struct RawInput {
  std::vector<std::string_view> pieces;
  size_t size = 0;
};

// A received message read front to back across grpc's slices, which it does not copy.
class SliceCursor {
 public:
  explicit SliceCursor(const std::vector<grpc::Slice>& slices) : slices_(slices) { SkipEmpty(); }
  bool done() const { return index_ == slices_.size(); }
  bool Byte(unsigned char* out) {
    if (done()) return false;
    *out = slices_[index_].begin()[offset_];
    Advance(1);
    return true;
  }
  // The next n bytes, handed to sink piece by piece; false when fewer remain.
  template <typename Sink>
  bool Take(uint64_t n, Sink&& sink) {
    while (n > 0) {
      if (done()) return false;
      const size_t here = static_cast<size_t>(std::min<uint64_t>(n, slices_[index_].size() - offset_));
      sink(std::string_view(reinterpret_cast<const char*>(slices_[index_].begin()) + offset_, here));
      Advance(here);
      n -= here;
    }
    return true;
  }

 private:
  void Advance(size_t n) {
    offset_ += n;
    if (offset_ == slices_[index_].size()) {
      ++index_;
      offset_ = 0;
      SkipEmpty();
    }
  }
  void SkipEmpty() {
    while (index_ < slices_.size() && slices_[index_].size() == 0) ++index_;
  }
  const std::vector<grpc::Slice>& slices_;
  size_t index_ = 0, offset_ = 0;
};

// A base-128 varint of at most 10 bytes (the wire format's limit); its bytes are appended to `raw`.
bool ReadVarint(SliceCursor& in, uint64_t* value, std::string* raw) {
  uint64_t v = 0;
  for (int shift = 0; shift < 64; shift += 7) {
    unsigned char byte;
    if (!in.Byte(&byte)) return false;
    raw->push_back(static_cast<char>(byte));
    v |= static_cast<uint64_t>(byte & 0x7f) << shift;
    if ((byte & 0x80) == 0) {
      *value = v;
      return true;
    }
  }
  return false;
}

constexpr uint64_t kRawInputContents = 7;  // ModelInferRequest.raw_input_contents (grpc_service.proto)
// More slices than this (a client sending its message in tiny frames) and the request takes the
// grpcio path: the pieces' bookkeeping must stay small next to the message.
constexpr size_t kMaxSlices = 4096;

// Parses a ModelInferRequest without copying its raw_input_contents: every other field's bytes go to
// protobuf (a message is the concatenation of its fields, so leaving field 7 out parses to the same
// request without it), field 7's are located in `slices`, which hold them. False for anything unusual
// (groups, a field 7 that is not length-delimited, a truncated message, too many slices): the caller
// then hands the call to the grpcio server, which answers it. Hand-written because protobuf has no
// aliasing parse of a bytes field from grpc's slices (Cord fields would copy too).
bool SplitRequest(const grpc::ByteBuffer& buffer, ModelInferRequest* request, std::vector<grpc::Slice>* slices,
                  std::vector<RawInput>* raws) {
  if (!buffer.Dump(slices).ok() || slices->size() > kMaxSlices) return false;
  SliceCursor in(*slices);
  std::string rest, head;  // head: a field's tag bytes (and field 7's length), passed to protobuf but for field 7
  auto keep = [&rest](std::string_view piece) { rest.append(piece.data(), piece.size()); };
  while (!in.done()) {
    uint64_t tag, length, ignored;
    head.clear();
    if (!ReadVarint(in, &tag, &head) || tag > UINT32_MAX || (tag >> 3) == 0) return false;
    const uint64_t wire = tag & 7;
    if ((tag >> 3) == kRawInputContents) {
      if (wire != 2 || !ReadVarint(in, &length, &head) || length > INT32_MAX) return false;
      RawInput& raw = raws->emplace_back();
      raw.size = static_cast<size_t>(length);
      if (!in.Take(length, [&raw](std::string_view piece) { raw.pieces.push_back(piece); })) return false;
      continue;
    }
    rest += head;
    switch (wire) {
      case 0:
        if (!ReadVarint(in, &ignored, &rest)) return false;
        break;
      case 1:
        if (!in.Take(8, keep)) return false;
        break;
      case 2:
        if (!ReadVarint(in, &length, &rest) || length > INT32_MAX || !in.Take(length, keep)) return false;
        break;
      case 5:
        if (!in.Take(4, keep)) return false;
        break;
      default:  // 3 and 4: groups, which this message never has; 6 and 7: not wire types
        return false;
    }
  }
  return request->ParseFromString(rest);
}

struct Item {
  Call* call;
  std::unique_ptr<ModelInferRequest> request;  // without raw_input_contents: see `raws`
  std::vector<grpc::Slice> slices;             // the received message, which `raws` point into
  std::vector<RawInput> raws;
  int64_t rows;
  double received;             // CLOCK_MONOTONIC seconds: Python's time.perf_counter() on Linux
  std::vector<int> wanted;     // indices into the lane's outputs; empty: all
  std::string traceparent;     // the caller's W3C traceparent, for the record's trace id; empty: none
};

struct Lane {
  int64_t id = 0;
  std::string model, version;
  std::vector<InputSpec> inputs;
  std::vector<std::string> outputs;  // names, in the model's order
  int64_t max_batch = 1, max_queue = 1, max_elements = 0;
  std::mutex mu;
  std::condition_variable ready;
  std::deque<Item> queue;
  bool closed = false;
};

using LaneTable = std::unordered_map<std::string, std::shared_ptr<Lane>>;

struct Front {
  std::unique_ptr<grpc::Server> server;
  std::unique_ptr<grpc::CallbackGenericService> service;
  std::shared_ptr<grpc::Channel> upstream;
  std::unique_ptr<grpc::GenericStub> stub;
  std::mutex lanes_mu;  // writers of `lanes` and `by_id`
  std::shared_ptr<const LaneTable> lanes = std::make_shared<LaneTable>();
  std::map<int64_t, std::shared_ptr<Lane>> by_id;
  int64_t next_id = 1;
  std::atomic<int64_t> fast{0}, proxied{0};
  bool record_digests = true;
};

std::string lane_key(const std::string& model, const std::string& version) { return model + '\0' + version; }

double monotonic_s() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

bool copyable_header(const grpc::string_ref& key) {
  // grpc sets these itself on the upstream call; the peer key is ours alone.
  const std::string k(key.data(), key.size());
  return !(k.rfind("grpc-", 0) == 0 || k == "user-agent" || k == "te" || k == "content-type" || k == kPeerKey ||
           (!k.empty() && k[0] == ':'));
}

// One call on the public port: either answered from a lane or proxied to the grpcio server.
class Call : public grpc::ServerGenericBidiReactor {
 public:
  Call(Front* front, grpc::GenericCallbackServerContext* ctx) : front_(front), ctx_(ctx), up_(this) {
    candidate_ = ctx->method() == kModelInfer;
    StartRead(&in_);
  }

  // -- fast path: the lane thread answers ---------------------------------------------------------------
  void Answer(grpc::ByteBuffer&& response) {
    out_ = std::move(response);
    StartWriteAndFinish(&out_, grpc::WriteOptions(), grpc::Status::OK);
  }
  void Refuse(const grpc::Status& status) { Finish(status); }

  // What the caller saw if it is no longer waiting (the grpcio servicer's rule: the deadline first, then a
  // cancellation); nullptr while it waits.
  const char* Gone(std::chrono::system_clock::time_point now) const {
    if (ctx_->deadline() <= now) return "DEADLINE_EXCEEDED";
    if (cancelled_.load(std::memory_order_relaxed)) return "CANCELLED";
    return nullptr;
  }

  // -- the server side -----------------------------------------------------------------------------------
  void OnReadDone(bool ok) override {
    std::unique_lock<std::mutex> lock(mu_);
    if (!started_) {
      started_ = true;
      if (ok && candidate_) {
        lock.unlock();
        if (TryLane()) return;  // queued: the lane answers
        lock.lock();
      }
      StartUpstream(ok);
      return;
    }
    if (up_done_) return;
    if (!ok) {
      up_.StartWritesDone();
      return;
    }
    up_.StartWrite(&in_);
  }

  void OnWriteDone(bool ok) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (!proxying_ || up_done_) return;
    if (!ok) {
      up_ctx_.TryCancel();
      return;
    }
    up_.StartRead(&up_in_);
  }

  void OnCancel() override {
    cancelled_.store(true, std::memory_order_relaxed);
    std::lock_guard<std::mutex> lock(mu_);
    if (proxying_ && !up_done_) up_ctx_.TryCancel();
  }

  void OnDone() override { Release(); }

 private:
  // The upstream half: a generic bidi call to the grpcio server.
  class Upstream : public grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
   public:
    explicit Upstream(Call* call) : call_(call) {}
    void OnReadInitialMetadataDone(bool ok) override { call_->UpInitialMetadata(ok); }
    void OnReadDone(bool ok) override { call_->UpReadDone(ok); }
    void OnWriteDone(bool ok) override { call_->UpWriteDone(ok); }
    void OnWritesDoneDone(bool) override {}
    void OnDone(const grpc::Status& status) override { call_->UpDone(status); }

   private:
    Call* call_;
  };

  bool TryLane();

  std::string TraceParent() const {
    const auto& metadata = ctx_->client_metadata();
    auto found = metadata.find("traceparent");
    return found == metadata.end() ? std::string() : std::string(found->second.data(), found->second.size());
  }

  // Under mu_.
  void StartUpstream(bool have_message) {
    proxying_ = true;
    refs_.fetch_add(1);
    front_->proxied.fetch_add(1, std::memory_order_relaxed);
    for (const auto& [key, value] : ctx_->client_metadata()) {
      if (copyable_header(key)) up_ctx_.AddMetadata(std::string(key.data(), key.size()), std::string(value.data(), value.size()));
    }
    up_ctx_.AddMetadata(kPeerKey, ctx_->peer());
    up_ctx_.set_deadline(ctx_->deadline());
    front_->stub->PrepareBidiStreamingCall(&up_ctx_, ctx_->method(), grpc::StubOptions(), &up_);
    up_.StartCall();
    up_.StartRead(&up_in_);
    if (have_message) up_.StartWrite(&in_);
    else up_.StartWritesDone();
  }

  void CopyInitialMetadata() {  // under mu_
    if (initial_copied_) return;
    initial_copied_ = true;
    for (const auto& [key, value] : up_ctx_.GetServerInitialMetadata()) {
      ctx_->AddInitialMetadata(std::string(key.data(), key.size()), std::string(value.data(), value.size()));
    }
  }

  void UpInitialMetadata(bool ok) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!ok) return;
    CopyInitialMetadata();
    initial_ready_ = true;
    if (held_write_) {
      held_write_ = false;
      StartWrite(&up_in_);
    }
  }

  void UpReadDone(bool ok) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!ok) return;  // the upstream finished: UpDone follows
    if (!initial_ready_) {
      held_write_ = true;  // the message must follow the initial metadata
      return;
    }
    StartWrite(&up_in_);
  }

  void UpWriteDone(bool ok) {
    std::lock_guard<std::mutex> lock(mu_);
    if (ok && !up_done_) StartRead(&in_);
  }

  void UpDone(const grpc::Status& status) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      up_done_ = true;
      CopyInitialMetadata();
      for (const auto& [key, value] : up_ctx_.GetServerTrailingMetadata()) {
        ctx_->AddTrailingMetadata(std::string(key.data(), key.size()), std::string(value.data(), value.size()));
      }
      Finish(status);
    }
    Release();
  }

  void Release() {
    if (refs_.fetch_sub(1) == 1) delete this;
  }

  Front* front_;
  grpc::GenericCallbackServerContext* ctx_;
  std::mutex mu_;
  std::atomic<int> refs_{1};
  std::atomic<bool> cancelled_{false};
  bool candidate_ = false, started_ = false, proxying_ = false, up_done_ = false;
  bool initial_ready_ = false, initial_copied_ = false, held_write_ = false;
  grpc::ByteBuffer in_, out_, up_in_;
  grpc::ClientContext up_ctx_;
  Upstream up_;
};

// The checks of serving/grpc_api/fast_infer.py's InputPlan.decode for fixed shapes: anything it would not
// accept, or a full lane, goes to the grpcio server, which answers it (or names what is wrong).
bool Call::TryLane() {
  auto table = std::atomic_load(&front_->lanes);
  if (table->empty()) return false;
  auto request = std::make_unique<ModelInferRequest>();
  std::vector<grpc::Slice> slices;  // shares in_'s: in_ stays whole for the proxy
  std::vector<RawInput> raws;
  if (!SplitRequest(in_, request.get(), &slices, &raws)) return false;
  auto found = table->find(lane_key(request->model_name(), request->model_version()));
  if (found == table->end()) return false;
  Lane* lane = found->second.get();
  const size_t n = lane->inputs.size();
  if (request->parameters_size() != 0 || static_cast<size_t>(request->inputs_size()) != n ||
      raws.size() != n) {
    return false;
  }
  int64_t rows = -1, elements = 0;
  for (size_t i = 0; i < n; ++i) {
    const auto& item = request->inputs(static_cast<int>(i));
    const InputSpec& spec = lane->inputs[i];
    if (item.name() != spec.name || item.datatype() != spec.datatype || item.parameters_size() != 0 ||
        item.has_contents() || static_cast<size_t>(item.shape_size()) != spec.tail.size() + 1) {
      return false;
    }
    const int64_t count = item.shape(0);
    if (count < 1 || count > lane->max_batch || (rows != -1 && count != rows)) return false;
    for (size_t d = 0; d < spec.tail.size(); ++d) {
      if (item.shape(static_cast<int>(d) + 1) != spec.tail[d]) return false;
    }
    if (static_cast<int64_t>(raws[i].size) != count * spec.row_bytes) return false;
    elements += count * spec.row_elements;
    rows = count;
  }
  if (elements > lane->max_elements) return false;
  std::vector<int> wanted;
  for (const auto& out : request->outputs()) {
    if (out.parameters_size() != 0) return false;
    int index = -1;
    for (size_t k = 0; k < lane->outputs.size(); ++k) {
      if (lane->outputs[k] == out.name()) index = static_cast<int>(k);
    }
    if (index < 0) return false;
    wanted.push_back(index);
  }
  Front* front = front_;  // once queued, this call may be answered and deleted before the next line
  {
    std::lock_guard<std::mutex> lock(lane->mu);
    if (lane->closed || static_cast<int64_t>(lane->queue.size()) >= lane->max_queue) return false;
    lane->queue.push_back(Item{this, std::move(request), std::move(slices), std::move(raws), rows, monotonic_s(), std::move(wanted), TraceParent()});
  }
  front->fast.fetch_add(1, std::memory_order_relaxed);
  lane->ready.notify_one();  // the lane outlives this: `table` holds it
  return true;
}

class Service final : public grpc::CallbackGenericService {
 public:
  explicit Service(Front* front) : front_(front) {}
  grpc::ServerGenericBidiReactor* CreateReactor(grpc::GenericCallbackServerContext* ctx) override {
    return new Call(front_, ctx);
  }

 private:
  Front* front_;
};

// -- Python glue ---------------------------------------------------------------------------------------------

const char kFrontCapsule[] = "sluicegate.native.front";
const char kBatchCapsule[] = "sluicegate.native.batch";

struct Batch {
  std::shared_ptr<Lane> lane;
  std::vector<Item> items;
  // One byte each, not vector<bool>'s bits: a lane shared by several versions answers its groups from
  // their batcher threads at once (distinct requests, so distinct bytes).
  std::vector<char> done;
};

Front* front_of(PyObject* capsule) { return static_cast<Front*>(PyCapsule_GetPointer(capsule, kFrontCapsule)); }
Batch* batch_of(PyObject* capsule) { return static_cast<Batch*>(PyCapsule_GetPointer(capsule, kBatchCapsule)); }

void free_front(PyObject* capsule) {
  Front* front = front_of(capsule);
  if (front == nullptr) return;
  if (front->server) {
    Py_BEGIN_ALLOW_THREADS;
    front->server->Shutdown(std::chrono::system_clock::now());
    front->server->Wait();
    Py_END_ALLOW_THREADS;
  }
  delete front;
}

void free_batch(PyObject* capsule) {
  Batch* batch = batch_of(capsule);
  if (batch == nullptr) return;
  // A batch dropped before every request was answered (an exception in the lane thread) must not hang
  // its callers.
  for (size_t i = 0; i < batch->items.size(); ++i) {
    if (!batch->done[i]) batch->items[i].call->Refuse(grpc::Status(grpc::StatusCode::INTERNAL, "internal error in /inference.GRPCInferenceService/ModelInfer; see the server log"));
  }
  delete batch;
}

// create(upstream_target) -> front
PyObject* create(PyObject*, PyObject* args) {
  const char* upstream;
  int record = 1;
  if (!PyArg_ParseTuple(args, "s|p", &upstream, &record)) return nullptr;
  auto front = std::make_unique<Front>();
  front->record_digests = record != 0;
  grpc::ChannelArguments channel_args;
  channel_args.SetMaxReceiveMessageSize(-1);  // the public port enforces the limits
  channel_args.SetMaxSendMessageSize(-1);
  front->upstream = grpc::CreateCustomChannel(upstream, grpc::InsecureChannelCredentials(), channel_args);
  front->stub = std::make_unique<grpc::GenericStub>(front->upstream);
  front->service = std::make_unique<Service>(front.get());
  return PyCapsule_New(front.release(), kFrontCapsule, free_front);
}

// start(front, address, int_args: list[(name, value)], tls: (key, cert, client_ca or None) or None) -> port
PyObject* start(PyObject*, PyObject* args) {
  PyObject *capsule, *int_args, *tls;
  const char* address;
  if (!PyArg_ParseTuple(args, "OsOO", &capsule, &address, &int_args, &tls)) return nullptr;
  Front* front = front_of(capsule);
  if (front == nullptr) return nullptr;
  if (front->server) {
    PyErr_SetString(PyExc_RuntimeError, "this front end is already started");
    return nullptr;
  }
  grpc::ServerBuilder builder;
  std::shared_ptr<grpc::ServerCredentials> credentials = grpc::InsecureServerCredentials();
  if (tls != Py_None) {
    const char *key, *cert, *client_ca = nullptr;
    Py_ssize_t key_n, cert_n, ca_n = 0;
    if (!PyArg_ParseTuple(tls, "y#y#z#", &key, &key_n, &cert, &cert_n, &client_ca, &ca_n)) return nullptr;
    grpc::SslServerCredentialsOptions options(
        client_ca != nullptr ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY : GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
    options.pem_key_cert_pairs.push_back({std::string(key, key_n), std::string(cert, cert_n)});
    if (client_ca != nullptr) options.pem_root_certs = std::string(client_ca, ca_n);
    credentials = grpc::SslServerCredentials(options);
  }
  PyObject* fast = PySequence_Fast(int_args, "int_args must be a sequence of (name, value)");
  if (fast == nullptr) return nullptr;
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(fast); ++i) {
    const char* name;
    long long value;
    if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(fast, i), "sL", &name, &value)) {
      Py_DECREF(fast);
      return nullptr;
    }
    const std::string key(name);
    if (key == "grpc.max_receive_message_length") builder.SetMaxReceiveMessageSize(static_cast<int>(value));
    else if (key == "grpc.max_send_message_length") builder.SetMaxSendMessageSize(static_cast<int>(value));
    else builder.AddChannelArgument(key, static_cast<int>(value));
  }
  Py_DECREF(fast);
  int port = 0;
  builder.AddListeningPort(address, credentials, &port);
  builder.RegisterCallbackGenericService(front->service.get());
  Py_BEGIN_ALLOW_THREADS;
  front->server = builder.BuildAndStart();
  Py_END_ALLOW_THREADS;
  if (!front->server || port == 0) {
    front->server.reset();
    return PyLong_FromLong(0);
  }
  return PyLong_FromLong(port);
}

// shutdown(front, grace_s): refuse new calls now, cancel what still runs after grace_s. Lanes keep being
// served meanwhile (their threads answer); close them afterwards.
PyObject* shutdown(PyObject*, PyObject* args) {
  PyObject* capsule;
  double grace_s;
  if (!PyArg_ParseTuple(args, "Od", &capsule, &grace_s)) return nullptr;
  Front* front = front_of(capsule);
  if (front == nullptr) return nullptr;
  if (front->server) {
    Py_BEGIN_ALLOW_THREADS;
    front->server->Shutdown(std::chrono::system_clock::now() +
                            std::chrono::milliseconds(static_cast<int64_t>(grace_s * 1e3)));
    Py_END_ALLOW_THREADS;
  }
  Py_RETURN_NONE;
}

bool parse_tail(PyObject* seq, std::vector<int64_t>* out) {
  PyObject* fast = PySequence_Fast(seq, "a shape must be a sequence of ints");
  if (fast == nullptr) return false;
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(fast); ++i) {
    const long long dim = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(fast, i));
    if (dim < 0) {
      Py_DECREF(fast);
      if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "a lane's dimensions must be fixed (0 or more)");
      return false;
    }
    out->push_back(dim);
  }
  Py_DECREF(fast);
  return true;
}

// add_lane(front, model, version, inputs: [(name, datatype, tail, typenum, itemsize)], outputs: [name],
//          max_batch, max_queue, max_elements) -> lane id
PyObject* add_lane(PyObject*, PyObject* args) {
  PyObject *capsule, *inputs, *outputs;
  const char *model, *version;
  Py_ssize_t model_n, version_n;
  long long max_batch, max_queue, max_elements;
  if (!PyArg_ParseTuple(args, "Os#s#OOLLL", &capsule, &model, &model_n, &version, &version_n, &inputs, &outputs,
                        &max_batch, &max_queue, &max_elements)) {
    return nullptr;
  }
  Front* front = front_of(capsule);
  if (front == nullptr) return nullptr;
  auto lane = std::make_shared<Lane>();
  lane->model.assign(model, model_n);
  lane->version.assign(version, version_n);
  lane->max_batch = max_batch;
  lane->max_queue = max_queue;
  lane->max_elements = max_elements;
  PyObject* fast = PySequence_Fast(inputs, "inputs must be a sequence");
  if (fast == nullptr) return nullptr;
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(fast); ++i) {
    const char *name, *datatype;
    PyObject* tail;
    int typenum;
    long long itemsize;
    if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(fast, i), "ssOiL", &name, &datatype, &tail, &typenum, &itemsize)) {
      Py_DECREF(fast);
      return nullptr;
    }
    InputSpec spec;
    spec.name = name;
    spec.datatype = datatype;
    spec.typenum = typenum;
    if (!parse_tail(tail, &spec.tail)) {
      Py_DECREF(fast);
      return nullptr;
    }
    spec.row_elements = 1;
    for (auto dim : spec.tail) spec.row_elements *= dim;
    spec.row_bytes = spec.row_elements * itemsize;
    lane->inputs.push_back(std::move(spec));
  }
  Py_DECREF(fast);
  fast = PySequence_Fast(outputs, "outputs must be a sequence of names");
  if (fast == nullptr) return nullptr;
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(fast); ++i) {
    const char* name = PyUnicode_AsUTF8(PySequence_Fast_GET_ITEM(fast, i));
    if (name == nullptr) {
      Py_DECREF(fast);
      return nullptr;
    }
    lane->outputs.emplace_back(name);
  }
  Py_DECREF(fast);
  std::lock_guard<std::mutex> lock(front->lanes_mu);
  lane->id = front->next_id++;
  auto table = std::make_shared<LaneTable>(*std::atomic_load(&front->lanes));
  (*table)[lane_key(lane->model, lane->version)] = lane;
  std::atomic_store(&front->lanes, std::shared_ptr<const LaneTable>(std::move(table)));
  front->by_id[lane->id] = lane;
  return PyLong_FromLongLong(lane->id);
}

// (front, lane id) from a call's arguments; false with the Python error set.
bool front_and_lane(PyObject* args, Front** front, long long* id) {
  PyObject* capsule;
  if (!PyArg_ParseTuple(args, "OL", &capsule, id)) return false;
  *front = front_of(capsule);
  return *front != nullptr;
}

std::shared_ptr<Lane> find_lane(Front* front, long long id) {
  std::lock_guard<std::mutex> lock(front->lanes_mu);
  auto found = front->by_id.find(id);
  return found == front->by_id.end() ? nullptr : found->second;
}

// close_lane(front, lane id): new requests no longer take it; take() returns what is queued, then None.
PyObject* close_lane(PyObject*, PyObject* args) {
  Front* front;
  long long id;
  if (!front_and_lane(args, &front, &id)) return nullptr;
  std::shared_ptr<Lane> lane = find_lane(front, id);  // stays in by_id until take() has drained it
  if (!lane) Py_RETURN_NONE;
  {
    std::lock_guard<std::mutex> lock(front->lanes_mu);
    auto table = std::make_shared<LaneTable>(*std::atomic_load(&front->lanes));
    auto entry = table->find(lane_key(lane->model, lane->version));
    if (entry != table->end() && entry->second == lane) table->erase(entry);
    std::atomic_store(&front->lanes, std::shared_ptr<const LaneTable>(std::move(table)));
  }
  {
    std::lock_guard<std::mutex> lock(lane->mu);
    lane->closed = true;
  }
  lane->ready.notify_all();
  Py_RETURN_NONE;
}

PyObject* text(const std::string& s) {
  // Request text need not be UTF-8: replaced, not refused (it is only logged).
  return PyUnicode_DecodeUTF8(s.data(), static_cast<Py_ssize_t>(s.size()), "replace");
}

// One input's array for a batch. With `spares` (the lane thread's list, one entry per input): a view of the
// spare array when nothing else holds it (its only reference is the list's) and it is large enough, else
// a new array, which becomes the spare. A lane then reuses one buffer, as large as its largest batch, for
// as long as it is open, instead of allocating every batch: a batch over the mmap threshold (8 medium
// images: 4.8 MB) was a fresh mapping, zero-filled page by page on the copy and unmapped after (~150
// minor faults per medium request). Whoever keeps a batch's array (a monitor holding images) keeps the
// spare from reuse, and the next batch gets a new one: never two batches in one buffer.
PyObject* batch_array(PyObject* spares, size_t i, std::vector<npy_intp>& dims, int typenum, npy_intp bytes) {
  const int nd = static_cast<int>(dims.size());
  if (spares == nullptr || static_cast<size_t>(PyList_GET_SIZE(spares)) <= i) return PyArray_SimpleNew(nd, dims.data(), typenum);
  PyObject* spare = PyList_GET_ITEM(spares, static_cast<Py_ssize_t>(i));
  PyArray_Descr* descr = PyArray_DescrFromType(typenum);  // a new reference: PyArray_NewFromDescr steals it
  if (descr == nullptr) return nullptr;
  auto* held = reinterpret_cast<PyArrayObject*>(spare);
  if (!(PyArray_CheckExact(spare) && Py_REFCNT(spare) == 1 && PyArray_TYPE(held) == typenum &&
        PyArray_IS_C_CONTIGUOUS(held) && PyArray_ISWRITEABLE(held) && PyArray_NBYTES(held) >= bytes)) {
    PyObject* fresh = PyArray_SimpleNew(nd, dims.data(), typenum);
    if (fresh == nullptr) {
      Py_DECREF(descr);
      return nullptr;
    }
    Py_INCREF(fresh);  // one for the list (stolen below), one for the view's base
    if (PyList_SetItem(spares, static_cast<Py_ssize_t>(i), fresh) < 0) {
      Py_DECREF(fresh);
      Py_DECREF(descr);
      return nullptr;
    }
    spare = fresh;
  } else {
    Py_INCREF(spare);  // the view's base
  }
  PyObject* view = PyArray_NewFromDescr(&PyArray_Type, descr, nd, dims.data(), nullptr,
                                        PyArray_DATA(reinterpret_cast<PyArrayObject*>(spare)), NPY_ARRAY_CARRAY, nullptr);
  if (view == nullptr) {
    Py_DECREF(spare);
    return nullptr;
  }
  if (PyArray_SetBaseObject(reinterpret_cast<PyArrayObject*>(view), spare) < 0) {  // steals spare's reference
    Py_DECREF(view);
    return nullptr;
  }
  return view;
}

// take(front, lane id[, spares]) -> (batch, arrays, items, gone) or None once the lane is closed and empty.
// arrays: one numpy array per input with the batch's rows; items: per request
// (id, digest or None, rows, received (perf_counter seconds), traceparent or None); gone: the requests
// whose callers stopped waiting (deadline, cancel), answered already and not run:
// (id, status name, rows, received). batch, arrays and items are None when every request was gone.
PyObject* take(PyObject*, PyObject* args) {
  PyObject *capsule, *spares = nullptr;
  long long id;
  if (!PyArg_ParseTuple(args, "OL|O!", &capsule, &id, &PyList_Type, &spares)) return nullptr;
  Front* front = front_of(capsule);
  if (front == nullptr) return nullptr;
  std::shared_ptr<Lane> lane = find_lane(front, id);
  auto batch = std::make_unique<Batch>();
  if (!lane) Py_RETURN_NONE;  // closed and drained
  batch->lane = lane;
  int64_t rows = 0;
  std::vector<std::pair<Item, const char*>> gone;  // callers no longer waiting: answered, never run
  bool drained = false;
  Py_BEGIN_ALLOW_THREADS;
  {
    std::unique_lock<std::mutex> lock(lane->mu);
    lane->ready.wait(lock, [&] { return !lane->queue.empty() || lane->closed; });
    const auto now = std::chrono::system_clock::now();
    // A request of several rows: the first always goes; later ones only while they fit.
    while (!lane->queue.empty() && (batch->items.empty() || rows + lane->queue.front().rows <= lane->max_batch)) {
      if (const char* code = lane->queue.front().call->Gone(now)) {
        gone.emplace_back(std::move(lane->queue.front()), code);
      } else {
        rows += lane->queue.front().rows;
        batch->items.push_back(std::move(lane->queue.front()));
      }
      lane->queue.pop_front();
    }
    drained = batch->items.empty() && gone.empty();
  }
  for (auto& [item, code] : gone) {
    item.call->Refuse(grpc::Status(std::strcmp(code, "CANCELLED") == 0 ? grpc::StatusCode::CANCELLED
                                                                       : grpc::StatusCode::DEADLINE_EXCEEDED,
                                   "the caller stopped waiting before its batch ran"));
  }
  Py_END_ALLOW_THREADS;
  if (drained) {  // closed and drained: forget it
    std::lock_guard<std::mutex> lock(front->lanes_mu);
    front->by_id.erase(id);
    Py_RETURN_NONE;
  }
  PyObject* late = PyList_New(static_cast<Py_ssize_t>(gone.size()));
  if (late == nullptr) return nullptr;
  for (size_t k = 0; k < gone.size(); ++k) {
    const Item& item = gone[k].first;
    PyObject* entry = Py_BuildValue("(NsLd)", text(item.request->id()), gone[k].second, static_cast<long long>(item.rows),
                                    item.received);
    if (entry == nullptr) {
      Py_DECREF(late);
      return nullptr;
    }
    PyList_SET_ITEM(late, static_cast<Py_ssize_t>(k), entry);
  }
  if (batch->items.empty()) return Py_BuildValue("(OOON)", Py_None, Py_None, Py_None, late);
  batch->done.assign(batch->items.size(), 0);
  Batch* raw = batch.release();
  PyObject* batch_capsule = PyCapsule_New(raw, kBatchCapsule, free_batch);
  if (batch_capsule == nullptr) {
    batch.reset(raw);
    for (auto& item : raw->items) item.call->Refuse(grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, "out of memory"));
    Py_DECREF(late);
    return nullptr;
  }
  const size_t n_inputs = lane->inputs.size();
  PyObject* arrays = PyList_New(static_cast<Py_ssize_t>(n_inputs));
  if (arrays == nullptr) {
    Py_DECREF(late);
    Py_DECREF(batch_capsule);
    return nullptr;
  }
  std::vector<char*> dst(n_inputs);
  for (size_t i = 0; i < n_inputs; ++i) {
    const InputSpec& spec = lane->inputs[i];
    std::vector<npy_intp> dims{static_cast<npy_intp>(rows)};
    for (auto dim : spec.tail) dims.push_back(static_cast<npy_intp>(dim));
    PyObject* array = batch_array(spares, i, dims, spec.typenum, static_cast<npy_intp>(rows * spec.row_bytes));
    if (array == nullptr) {
      Py_DECREF(late);
      Py_DECREF(arrays);
      Py_DECREF(batch_capsule);
      return nullptr;
    }
    dst[i] = static_cast<char*>(PyArray_DATA(reinterpret_cast<PyArrayObject*>(array)));
    PyList_SET_ITEM(arrays, static_cast<Py_ssize_t>(i), array);
  }
  std::vector<std::string> digests(raw->items.size());
  std::vector<std::string_view> pieces;
  const bool record = front->record_digests;
  Py_BEGIN_ALLOW_THREADS;
  for (size_t k = 0; k < raw->items.size(); ++k) {
    const Item& item = raw->items[k];
    pieces.clear();
    for (size_t i = 0; i < n_inputs; ++i) {
      for (std::string_view piece : item.raws[i].pieces) {
        std::memcpy(dst[i], piece.data(), piece.size());
        dst[i] += piece.size();
        if (record) pieces.push_back(piece);
      }
    }
    if (record) digests[k] = sluicegate::input_digest(pieces);  // the inputs one after another, as before
  }
  Py_END_ALLOW_THREADS;
  PyObject* items = PyList_New(static_cast<Py_ssize_t>(raw->items.size()));
  if (items == nullptr) {
    Py_DECREF(late);
    Py_DECREF(arrays);
    Py_DECREF(batch_capsule);
    return nullptr;
  }
  for (size_t k = 0; k < raw->items.size(); ++k) {
    const Item& item = raw->items[k];
    PyObject* digest = record ? PyUnicode_FromStringAndSize(digests[k].data(), static_cast<Py_ssize_t>(digests[k].size()))
                              : Py_NewRef(Py_None);
    PyObject* entry = Py_BuildValue("(NNLdN)", text(item.request->id()), digest, static_cast<long long>(item.rows),
                                    item.received,
                                    item.traceparent.empty() ? Py_NewRef(Py_None) : text(item.traceparent));
    if (entry == nullptr) {
      Py_DECREF(late);
      Py_DECREF(items);
      Py_DECREF(arrays);
      Py_DECREF(batch_capsule);
      return nullptr;
    }
    PyList_SET_ITEM(items, static_cast<Py_ssize_t>(k), entry);
  }
  return Py_BuildValue("(NNNN)", batch_capsule, arrays, items, late);
}

bool index_list(PyObject* seq, size_t size, std::vector<size_t>* out) {
  PyObject* fast = PySequence_Fast(seq, "indices must be a sequence of ints");
  if (fast == nullptr) return false;
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(fast); ++i) {
    const long long k = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(fast, i));
    if (k < 0 || static_cast<size_t>(k) >= size) {
      Py_DECREF(fast);
      if (!PyErr_Occurred()) PyErr_SetString(PyExc_IndexError, "a request index outside the batch");
      return false;
    }
    out->push_back(static_cast<size_t>(k));
  }
  Py_DECREF(fast);
  return true;
}

struct OutputView {
  std::string name, datatype;
  Py_buffer view{};
  int64_t row_bytes = 0;
};

// answer(batch, indices, version, outputs: [(name, datatype, array with the indices' rows in order)], abnormal)
// -> {index: status name} of the requests whose callers had stopped waiting (deadline, cancel)
PyObject* answer(PyObject*, PyObject* args) {
  PyObject *capsule, *indices, *outputs;
  const char* version;
  Py_ssize_t version_n;
  int abnormal;
  if (!PyArg_ParseTuple(args, "OOs#Op", &capsule, &indices, &version, &version_n, &outputs, &abnormal)) return nullptr;
  Batch* batch = batch_of(capsule);
  if (batch == nullptr) return nullptr;
  std::vector<size_t> which;
  if (!index_list(indices, batch->items.size(), &which)) return nullptr;
  int64_t rows = 0;
  std::vector<char> seen(batch->items.size(), 0);
  for (size_t k : which) {
    if (batch->done[k] || seen[k]) {
      PyErr_SetString(PyExc_ValueError, "a request of this batch was answered already");
      return nullptr;
    }
    seen[k] = 1;
    rows += batch->items[k].rows;
  }
  PyObject* fast = PySequence_Fast(outputs, "outputs must be a sequence");
  if (fast == nullptr) return nullptr;
  std::vector<OutputView> views(static_cast<size_t>(PySequence_Fast_GET_SIZE(fast)));
  size_t got = 0;
  bool ok = true;
  for (; ok && got < views.size(); ++got) {
    const char *name, *datatype;
    PyObject* array;
    if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(fast, static_cast<Py_ssize_t>(got)), "ssO", &name, &datatype, &array) ||
        PyObject_GetBuffer(array, &views[got].view, PyBUF_C_CONTIGUOUS | PyBUF_ND) != 0) {
      ok = false;
      break;
    }
    views[got].name = name;
    views[got].datatype = datatype;
    if (views[got].view.ndim < 1 || views[got].view.shape[0] != rows) {
      PyErr_SetString(PyExc_ValueError, "an output does not have the requests' rows");
      ++got;
      ok = false;
      break;
    }
    views[got].row_bytes = rows ? views[got].view.len / rows : 0;
  }
  Py_DECREF(fast);
  std::vector<std::pair<size_t, const char*>> late;  // answered after the caller stopped waiting
  if (ok) {
    // Claimed while the GIL is held, as refuse() checks them: once the GIL is released below, a refuse()
    // of the same batch from another thread (a lane thread failing the rest of it) must skip these.
    for (size_t k : which) batch->done[k] = 1;
    const std::string version_s(version, version_n);
    Py_BEGIN_ALLOW_THREADS;
    const auto now = std::chrono::system_clock::now();
    int64_t offset = 0;
    for (size_t k : which) {
      Item& item = batch->items[k];
      if (const char* code = item.call->Gone(now)) late.emplace_back(k, code);
      ModelInferResponse response;
      response.set_model_name(item.request->model_name());
      response.set_model_version(version_s);
      response.set_id(item.request->id());
      if (abnormal) (*response.mutable_parameters())["abnormal"].set_bool_param(true);
      auto emit = [&](const OutputView& out) {
        auto* tensor = response.add_outputs();
        tensor->set_name(out.name);
        tensor->set_datatype(out.datatype);
        tensor->add_shape(item.rows);
        for (int d = 1; d < out.view.ndim; ++d) tensor->add_shape(out.view.shape[d]);
        response.add_raw_output_contents()->assign(static_cast<const char*>(out.view.buf) + offset * out.row_bytes,
                                                   static_cast<size_t>(item.rows * out.row_bytes));
      };
      if (item.wanted.empty()) {
        for (const auto& out : views) emit(out);
      } else {
        for (int w : item.wanted) {
          if (static_cast<size_t>(w) < views.size()) emit(views[static_cast<size_t>(w)]);
        }
      }
      offset += item.rows;
      grpc::ByteBuffer buffer;
      bool own = false;
      grpc::SerializationTraits<ModelInferResponse>::Serialize(response, &buffer, &own);
      item.call->Answer(std::move(buffer));
    }
    Py_END_ALLOW_THREADS;
  }
  for (size_t i = 0; i < got && i < views.size(); ++i) {
    if (views[i].view.obj != nullptr) PyBuffer_Release(&views[i].view);
  }
  if (!ok) return nullptr;
  PyObject* result = PyDict_New();
  for (size_t i = 0; result != nullptr && i < late.size(); ++i) {
    PyObject* key = PyLong_FromSize_t(late[i].first);
    PyObject* value = PyUnicode_FromString(late[i].second);
    if (key == nullptr || value == nullptr || PyDict_SetItem(result, key, value) != 0) Py_CLEAR(result);
    Py_XDECREF(key);
    Py_XDECREF(value);
  }
  return result;
}

// refuse(batch, indices, status code, message)
PyObject* refuse(PyObject*, PyObject* args) {
  PyObject *capsule, *indices;
  int code;
  const char* message;
  if (!PyArg_ParseTuple(args, "OOis", &capsule, &indices, &code, &message)) return nullptr;
  Batch* batch = batch_of(capsule);
  if (batch == nullptr) return nullptr;
  std::vector<size_t> which;
  if (!index_list(indices, batch->items.size(), &which)) return nullptr;
  const grpc::Status status(static_cast<grpc::StatusCode>(code), message);
  for (size_t k : which) {
    if (batch->done[k]) continue;
    batch->done[k] = 1;
    batch->items[k].call->Refuse(status);
  }
  Py_RETURN_NONE;
}

// counts(front) -> (fast, proxied): calls taken by a lane, calls sent to the grpcio server.
PyObject* counts(PyObject*, PyObject* args) {
  PyObject* capsule;
  if (!PyArg_ParseTuple(args, "O", &capsule)) return nullptr;
  Front* front = front_of(capsule);
  if (front == nullptr) return nullptr;
  return Py_BuildValue("(LL)", static_cast<long long>(front->fast.load()), static_cast<long long>(front->proxied.load()));
}

PyMethodDef kMethods[] = {
    {"create", create, METH_VARARGS, "create(upstream_target, record_digests=True) -> front"},
    {"start", start, METH_VARARGS, "start(front, address, int_args, tls) -> bound port, 0 if it cannot bind"},
    {"shutdown", shutdown, METH_VARARGS, "shutdown(front, grace_s)"},
    {"add_lane", add_lane, METH_VARARGS, "add_lane(front, model, version, inputs, outputs, max_batch, max_queue, max_elements) -> id"},
    {"close_lane", close_lane, METH_VARARGS, "close_lane(front, lane_id)"},
    {"take", take, METH_VARARGS, "take(front, lane_id, spares=None) -> (batch, arrays, items, gone) or None"},
    {"answer", answer, METH_VARARGS, "answer(batch, indices, version, outputs, abnormal)"},
    {"refuse", refuse, METH_VARARGS, "refuse(batch, indices, code, message)"},
    {"counts", counts, METH_VARARGS, "counts(front) -> (fast, proxied)"},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_front", "sluicegate's native gRPC front end", -1, kMethods,
                       nullptr, nullptr, nullptr, nullptr};

}  // namespace

PyMODINIT_FUNC PyInit__front() {
  import_array();
  return PyModule_Create(&kModule);
}
