// The native reference's front end: a C++ gRPC server (grpc++ callback API) that decodes, checks and
// batches ModelInfer before Python sees it. Python is called once per batch: take() hands a batcher
// thread the queued rows of one model as one numpy array, finish() (or fail()) answers every request of
// that batch. Built and measured by the serving benchmark (benchmarks/native_reference/build.py); it is
// a yardstick for a native front end, not part of the server (no auth, records, metrics or routing).
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include <numpy/arrayobject.h>

#include <grpcpp/grpcpp.h>

#include <array>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "digest.h"  // serving/native/digest.h
#include "grpc_service.grpc.pb.h"

namespace {

using inference::ModelInferRequest;
using inference::ModelInferResponse;

constexpr int kMaxMessageBytes = 100 << 20;  // our server's default, so a medium batch is not refused here only

struct Pending {
  const ModelInferRequest* request;
  ModelInferResponse* response;
  grpc::ServerUnaryReactor* reactor;
  int64_t rows;
};

struct Model {
  std::string name, input, output;
  std::vector<int64_t> row_shape, out_row_shape;
  int64_t row_bytes = sizeof(float), out_row_bytes = sizeof(float), max_batch = 8;
  std::mutex mu;
  std::condition_variable ready;
  std::deque<Pending> queue;
  bool stopping = false;
};

// Filled by add_model() before start() and only read afterwards, so the handlers need no lock for them.
std::vector<std::unique_ptr<Model>> g_models;
std::unordered_map<std::string, Model*> g_by_name;
std::unique_ptr<grpc::Server> g_server;
bool g_record = false;  // take() also returns each request's (id, input digest)

struct Batch {
  Model* model;
  std::vector<Pending> items;
  int64_t rows = 0;
};

grpc::ServerUnaryReactor* answer(grpc::CallbackServerContext* ctx, const grpc::Status& status) {
  auto* reactor = ctx->DefaultReactor();
  reactor->Finish(status);
  return reactor;
}

void set_tensor(inference::ModelMetadataResponse::TensorMetadata* t, const std::string& name,
                const std::vector<int64_t>& row_shape) {
  t->set_name(name);
  t->set_datatype("FP32");
  t->add_shape(-1);
  for (auto dim : row_shape) t->add_shape(dim);
}

class Service final : public inference::GRPCInferenceService::CallbackService {
  grpc::ServerUnaryReactor* ServerLive(grpc::CallbackServerContext* ctx, const inference::ServerLiveRequest*,
                                       inference::ServerLiveResponse* response) override {
    response->set_live(true);
    return answer(ctx, grpc::Status::OK);
  }

  grpc::ServerUnaryReactor* ServerReady(grpc::CallbackServerContext* ctx, const inference::ServerReadyRequest*,
                                        inference::ServerReadyResponse* response) override {
    response->set_ready(true);  // models are added before the port opens
    return answer(ctx, grpc::Status::OK);
  }

  grpc::ServerUnaryReactor* ModelReady(grpc::CallbackServerContext* ctx, const inference::ModelReadyRequest* request,
                                       inference::ModelReadyResponse* response) override {
    response->set_ready(g_by_name.count(request->name()) > 0);
    return answer(ctx, grpc::Status::OK);
  }

  grpc::ServerUnaryReactor* ModelMetadata(grpc::CallbackServerContext* ctx,
                                          const inference::ModelMetadataRequest* request,
                                          inference::ModelMetadataResponse* response) override {
    auto found = g_by_name.find(request->name());
    if (found == g_by_name.end()) return answer(ctx, grpc::Status(grpc::StatusCode::NOT_FOUND, "no such model"));
    const Model* m = found->second;
    response->set_name(m->name);
    response->add_versions("1");
    response->set_platform("onnxruntime_onnx");
    set_tensor(response->add_inputs(), m->input, m->row_shape);
    set_tensor(response->add_outputs(), m->output, m->out_row_shape);
    return answer(ctx, grpc::Status::OK);
  }

  // Runs on grpc's callback threads: check, queue and return; the batcher thread answers later.
  grpc::ServerUnaryReactor* ModelInfer(grpc::CallbackServerContext* ctx, const ModelInferRequest* request,
                                       ModelInferResponse* response) override {
    auto found = g_by_name.find(request->model_name());
    if (found == g_by_name.end()) return answer(ctx, grpc::Status(grpc::StatusCode::NOT_FOUND, "no such model"));
    Model* m = found->second;
    if (request->inputs_size() != 1 || request->raw_input_contents_size() != 1 ||
        request->inputs(0).datatype() != "FP32" ||
        request->inputs(0).shape_size() != static_cast<int>(m->row_shape.size()) + 1) {
      return answer(ctx, grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "one FP32 input as raw_input_contents"));
    }
    const auto& tensor = request->inputs(0);
    const int64_t rows = tensor.shape(0);
    bool ok = rows >= 1 && rows <= m->max_batch;
    for (size_t i = 0; ok && i < m->row_shape.size(); ++i) ok = tensor.shape(static_cast<int>(i) + 1) == m->row_shape[i];
    if (!ok || static_cast<int64_t>(request->raw_input_contents(0).size()) != rows * m->row_bytes) {
      return answer(ctx, grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "input shape or size is not the model's"));
    }
    auto* reactor = ctx->DefaultReactor();
    {
      std::lock_guard<std::mutex> lock(m->mu);
      m->queue.push_back(Pending{request, response, reactor, rows});
    }
    m->ready.notify_one();
    return reactor;
  }
};

Service* g_service = nullptr;

bool int_list(PyObject* seq, std::vector<int64_t>* out, int64_t* product) {
  PyObject* fast = PySequence_Fast(seq, "a shape must be a sequence of ints");
  if (fast == nullptr) return false;
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(fast); ++i) {
    const long long dim = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(fast, i));
    if (dim <= 0) {
      Py_DECREF(fast);
      if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "every row dimension must be fixed and positive");
      return false;
    }
    out->push_back(dim);
    *product *= dim;
  }
  Py_DECREF(fast);
  return true;
}

// add_model(name, input_name, row_shape, output_name, output_row_shape, max_batch) -> index
PyObject* add_model(PyObject*, PyObject* args) {
  const char *name, *input, *output;
  PyObject *row_shape, *out_shape;
  long max_batch;
  if (!PyArg_ParseTuple(args, "ssOsOl", &name, &input, &row_shape, &output, &out_shape, &max_batch)) return nullptr;
  if (g_server) {
    PyErr_SetString(PyExc_RuntimeError, "add every model before start()");
    return nullptr;
  }
  auto m = std::make_unique<Model>();
  m->name = name;
  m->input = input;
  m->output = output;
  m->max_batch = max_batch;
  if (!int_list(row_shape, &m->row_shape, &m->row_bytes) || !int_list(out_shape, &m->out_row_shape, &m->out_row_bytes))
    return nullptr;
  g_by_name[m->name] = m.get();
  g_models.push_back(std::move(m));
  return PyLong_FromSize_t(g_models.size() - 1);
}

// start(address, record): listen and serve on grpc's own threads.
PyObject* start(PyObject*, PyObject* args) {
  const char* address;
  int record = 0;
  if (!PyArg_ParseTuple(args, "s|p", &address, &record)) return nullptr;
  g_record = record != 0;
  g_service = new Service();
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(address, grpc::InsecureServerCredentials(), &port);
  builder.SetMaxReceiveMessageSize(kMaxMessageBytes);
  builder.SetMaxSendMessageSize(kMaxMessageBytes);
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);  // a stale server on the port fails the start
  builder.RegisterService(g_service);
  Py_BEGIN_ALLOW_THREADS;
  g_server = builder.BuildAndStart();
  Py_END_ALLOW_THREADS;
  if (!g_server || port == 0) {
    PyErr_Format(PyExc_OSError, "cannot serve on %s", address);
    return nullptr;
  }
  return PyLong_FromLong(port);
}

// stop(grace_s): refuse new calls, let the batchers finish theirs, wake batchers waiting on empty queues.
PyObject* stop(PyObject*, PyObject* args) {
  double grace_s;
  if (!PyArg_ParseTuple(args, "d", &grace_s)) return nullptr;
  Py_BEGIN_ALLOW_THREADS;
  if (g_server) {
    auto deadline = std::chrono::system_clock::now() + std::chrono::milliseconds(static_cast<int64_t>(grace_s * 1e3));
    g_server->Shutdown(deadline);
  }
  for (auto& m : g_models) {
    {
      std::lock_guard<std::mutex> lock(m->mu);
      m->stopping = true;
    }
    m->ready.notify_all();
  }
  Py_END_ALLOW_THREADS;
  Py_RETURN_NONE;
}

void free_batch(PyObject* capsule) {
  auto* batch = static_cast<Batch*>(PyCapsule_GetPointer(capsule, "native_front.batch"));
  // A batch dropped without an answer (an exception between take and finish) must not hang its callers.
  for (auto& p : batch->items) p.reactor->Finish(grpc::Status(grpc::StatusCode::INTERNAL, "batch dropped"));
  delete batch;
}

// take(model_index) -> (rows, batch, records) with rows a float32 array of up to max_batch rows and
// records a list of (request id, input digest, rows) when start() was asked to record (else None);
// None once stopping.
PyObject* take(PyObject*, PyObject* args) {
  long index;
  if (!PyArg_ParseTuple(args, "l", &index)) return nullptr;
  if (index < 0 || static_cast<size_t>(index) >= g_models.size()) {
    PyErr_SetString(PyExc_IndexError, "no such model index");
    return nullptr;
  }
  Model* m = g_models[index].get();
  auto batch = std::make_unique<Batch>();
  batch->model = m;
  Py_BEGIN_ALLOW_THREADS;
  {
    std::unique_lock<std::mutex> lock(m->mu);
    m->ready.wait(lock, [m] { return !m->queue.empty() || m->stopping; });
    // Requests of several rows: the first always goes; later ones only while they fit.
    while (!m->queue.empty() && (batch->items.empty() || batch->rows + m->queue.front().rows <= m->max_batch)) {
      batch->rows += m->queue.front().rows;
      batch->items.push_back(m->queue.front());
      m->queue.pop_front();
    }
  }
  Py_END_ALLOW_THREADS;
  if (batch->items.empty()) Py_RETURN_NONE;
  std::vector<npy_intp> dims{static_cast<npy_intp>(batch->rows)};
  for (auto dim : m->row_shape) dims.push_back(static_cast<npy_intp>(dim));
  PyObject* rows = PyArray_SimpleNew(static_cast<int>(dims.size()), dims.data(), NPY_FLOAT32);
  PyObject* capsule = PyCapsule_New(batch.get(), "native_front.batch", free_batch);
  if (rows == nullptr || capsule == nullptr) {
    Py_XDECREF(rows);
    if (capsule != nullptr) PyCapsule_SetDestructor(capsule, nullptr);  // the unique_ptr owns the batch
    Py_XDECREF(capsule);
    for (auto& p : batch->items) p.reactor->Finish(grpc::Status(grpc::StatusCode::INTERNAL, "out of memory"));
    return nullptr;
  }
  Batch* raw = batch.release();
  char* dst = static_cast<char*>(PyArray_DATA(reinterpret_cast<PyArrayObject*>(rows)));
  std::vector<std::string> digests;
  Py_BEGIN_ALLOW_THREADS;
  for (auto& p : raw->items) {
    const std::string& data = p.request->raw_input_contents(0);
    std::memcpy(dst, data.data(), data.size());
    dst += data.size();
    if (g_record) digests.push_back(sluicegate::input_digest(std::array<std::string_view, 1>{data}));
  }
  Py_END_ALLOW_THREADS;
  if (!g_record) return Py_BuildValue("(NNO)", rows, capsule, Py_None);
  PyObject* records = PyList_New(static_cast<Py_ssize_t>(raw->items.size()));
  for (size_t i = 0; records != nullptr && i < raw->items.size(); ++i) {
    const std::string& id = raw->items[i].request->id();
    PyObject* item = Py_BuildValue("(s#s#L)", id.data(), static_cast<Py_ssize_t>(id.size()), digests[i].data(),
                                   static_cast<Py_ssize_t>(digests[i].size()),
                                   static_cast<long long>(raw->items[i].rows));
    if (item == nullptr) Py_CLEAR(records);
    else PyList_SET_ITEM(records, static_cast<Py_ssize_t>(i), item);
  }
  if (records == nullptr) {  // a request id that is not UTF-8, or out of memory: the batch still runs
    PyErr_Clear();
    records = Py_NewRef(Py_None);
  }
  return Py_BuildValue("(NNN)", rows, capsule, records);
}

Batch* batch_of(PyObject* capsule) {
  return static_cast<Batch*>(PyCapsule_GetPointer(capsule, "native_front.batch"));
}

// finish(batch, outputs): outputs a float32 array of the batch's rows x the output row shape.
PyObject* finish(PyObject*, PyObject* args) {
  PyObject *capsule, *outputs;
  if (!PyArg_ParseTuple(args, "OO", &capsule, &outputs)) return nullptr;
  Batch* batch = batch_of(capsule);
  if (batch == nullptr) return nullptr;
  auto* array = reinterpret_cast<PyArrayObject*>(
      PyArray_FROMANY(outputs, NPY_FLOAT32, 1, 0, NPY_ARRAY_C_CONTIGUOUS | NPY_ARRAY_ALIGNED));
  if (array == nullptr) return nullptr;
  const Model* m = batch->model;
  if (PyArray_NBYTES(array) != static_cast<npy_intp>(batch->rows * m->out_row_bytes)) {
    Py_DECREF(array);
    PyErr_SetString(PyExc_ValueError, "outputs are not the batch's rows x the output row shape");
    return nullptr;
  }
  const char* src = static_cast<const char*>(PyArray_DATA(array));
  std::vector<Pending> items;
  items.swap(batch->items);  // answered here, so the capsule's destructor has nothing left to fail
  Py_BEGIN_ALLOW_THREADS;
  for (auto& p : items) {
    ModelInferResponse* response = p.response;
    response->set_model_name(m->name);
    response->set_model_version("1");
    response->set_id(p.request->id());
    auto* tensor = response->add_outputs();
    tensor->set_name(m->output);
    tensor->set_datatype("FP32");
    tensor->add_shape(p.rows);
    for (auto dim : m->out_row_shape) tensor->add_shape(dim);
    const size_t n = static_cast<size_t>(p.rows * m->out_row_bytes);
    response->add_raw_output_contents()->assign(src, n);
    src += n;
    p.reactor->Finish(grpc::Status::OK);
  }
  Py_END_ALLOW_THREADS;
  Py_DECREF(array);
  Py_RETURN_NONE;
}

// fail(batch, message): every request of the batch gets INTERNAL with the message.
PyObject* fail(PyObject*, PyObject* args) {
  PyObject* capsule;
  const char* message;
  if (!PyArg_ParseTuple(args, "Os", &capsule, &message)) return nullptr;
  Batch* batch = batch_of(capsule);
  if (batch == nullptr) return nullptr;
  for (auto& p : batch->items) p.reactor->Finish(grpc::Status(grpc::StatusCode::INTERNAL, message));
  batch->items.clear();
  Py_RETURN_NONE;
}

PyMethodDef kMethods[] = {
    {"add_model", add_model, METH_VARARGS, "add_model(name, input, row_shape, output, output_row_shape, max_batch)"},
    {"start", start, METH_VARARGS, "start(address, record=False) -> bound port"},
    {"stop", stop, METH_VARARGS, "stop(grace_s)"},
    {"take", take, METH_VARARGS, "take(model_index) -> (rows, batch, records) or None once stopping"},
    {"finish", finish, METH_VARARGS, "finish(batch, outputs)"},
    {"fail", fail, METH_VARARGS, "fail(batch, message)"},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "native_front", "C++ V2 gRPC front end, Python once per batch",
                       -1, kMethods, nullptr, nullptr, nullptr, nullptr};

}  // namespace

PyMODINIT_FUNC PyInit_native_front() {
  import_array();
  return PyModule_Create(&kModule);
}
