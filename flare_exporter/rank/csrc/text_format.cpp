// The text exposition format (0.0.4) of a scrape's metric families, written in C++.
//
// A scrape holds the GIL from its first collector to its last line, and the training thread waits for the
// GIL after each of its ops: every microsecond the scrape spends in Python is a microsecond the rank's
// training step can stall. Written here, the text of a page took 90 µs instead of 237 µs in Python. flare's
// own families (collectors.SeriesFamily) hand over each series' numbers with the text of its lines up to
// their values, kept from one scrape to the next (collectors.Lines): no sample object, no label read.
//
// It writes exactly what exposition._family_text writes (a test compares the two on every metric and on
// hostile label values), and answers None for a family that the Python renderer would hand to
// prometheus_client's generate_latest (another type, a timestamp, an exemplar, a name that needs
// escaping), so that the caller does the same.

#include "text_format.h"

#include <Python.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace flare {
namespace {

constexpr long long kShortInt = 1000000;  // exposition.SHORT_INT

enum class Result { kOk, kNotPlain, kError };

// An owned reference, released when it goes out of scope.
struct Ref {
  PyObject* object;
  explicit Ref(PyObject* owned) : object(owned) {}
  ~Ref() { Py_XDECREF(object); }
  Ref(const Ref&) = delete;
  Ref& operator=(const Ref&) = delete;
};

PyObject* kType = nullptr;  // interned attribute names of a prometheus_client Metric
PyObject* kName = nullptr;
PyObject* kDocumentation = nullptr;
PyObject* kSamples = nullptr;
PyObject* kSeries = nullptr;  // a flare family's (collectors.SeriesFamily)
PyObject* kPrefixes = nullptr;

// [a-zA-Z_:][a-zA-Z0-9_:]*: sample_lines.is_legacy_name
bool legacy_name(std::string_view name) {
  if (name.empty()) return false;
  for (size_t i = 0; i < name.size(); ++i) {
    const char c = name[i];
    const bool letter = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || c == ':';
    if (!letter && !(i > 0 && c >= '0' && c <= '9')) return false;
  }
  return true;
}

bool ends_with(std::string_view text, std::string_view suffix) {
  return text.size() >= suffix.size() && text.compare(text.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// The UTF-8 of a str (kept by the str itself), or kNotPlain for anything else.
Result utf8(PyObject* text, std::string_view* out) {
  if (!PyUnicode_Check(text)) return Result::kNotPlain;
  Py_ssize_t size = 0;
  const char* data = PyUnicode_AsUTF8AndSize(text, &size);
  if (data == nullptr) return Result::kError;
  *out = std::string_view(data, static_cast<size_t>(size));
  return Result::kOk;
}

// Backslash and newline escaped, and double quotes too in a label value (sample_lines._escape_value); HELP
// text keeps its quotes.
void append_escaped(std::string& out, std::string_view text, bool quotes) {
  for (const char c : text) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '"' && quotes) {
      out += "\\\"";
    } else {
      out += c;
    }
  }
}

// A sample's value as exposition._value_text writes it: prometheus_client's floatToGoString (Python's
// repr, with Go's exponent for large values), without a trailing ".0".
Result append_value(std::string& out, PyObject* value) {
  if (PyLong_CheckExact(value)) {
    int overflow = 0;
    const long long number = PyLong_AsLongLongAndOverflow(value, &overflow);
    if (number == -1 && PyErr_Occurred()) return Result::kError;
    if (overflow == 0 && number > -kShortInt && number < kShortInt) {
      out += std::to_string(number);
      return Result::kOk;
    }
  } else if (!PyFloat_Check(value) && !PyLong_Check(value)) {
    return Result::kNotPlain;  // floatToGoString would call float() on it: leave that to Python
  }
  const double number = PyFloat_AsDouble(value);
  if (number == -1.0 && PyErr_Occurred()) return Result::kError;
  if (std::isinf(number)) {
    out += number > 0 ? "+Inf" : "-Inf";
    return Result::kOk;
  }
  if (std::isnan(number)) {
    out += "NaN";
    return Result::kOk;
  }
  char* repr = PyOS_double_to_string(number, 'r', 0, Py_DTSF_ADD_DOT_0, nullptr);
  if (repr == nullptr) return Result::kError;
  std::string text(repr);
  PyMem_Free(repr);
  const size_t dot = text.find('.');
  if (number > 0 && dot != std::string::npos && dot > 6) {  // Go switches to exponents sooner than Python
    std::string mantissa = text.substr(0, 1) + "." + text.substr(1, dot - 1) + text.substr(dot + 1);
    const size_t last = mantissa.find_last_not_of("0.");
    mantissa.erase(last == std::string::npos ? 0 : last + 1);
    char exponent[24];
    std::snprintf(exponent, sizeof exponent, "e+%02zu", dot - 1);
    text = mantissa + exponent;
  }
  if (ends_with(text, ".0")) text.resize(text.size() - 2);
  out += text;
  return Result::kOk;
}

using Labels = std::vector<std::pair<std::string_view, std::string_view>>;

// A sample's name and labels as its line starts, `name{label="value",...} `, labels sorted by name.
Result append_prefix(std::string& out, PyObject* name_object, PyObject* label_dict, Labels& labels) {
  std::string_view name;
  Result result = utf8(name_object, &name);
  if (result != Result::kOk) return result;
  if (ends_with(name, "_created") || ends_with(name, "_gsum") || ends_with(name, "_gcount")) {
    return Result::kNotPlain;
  }
  labels.clear();
  Py_ssize_t position = 0;
  PyObject* key = nullptr;
  PyObject* value = nullptr;
  while (PyDict_Next(label_dict, &position, &key, &value)) {
    std::string_view key_text, value_text;
    if ((result = utf8(key, &key_text)) != Result::kOk) return result;
    if (!legacy_name(key_text) || key_text.substr(0, 2) == "__") return Result::kNotPlain;
    if ((result = utf8(value, &value_text)) != Result::kOk) return result;
    labels.emplace_back(key_text, value_text);
  }
  std::sort(labels.begin(), labels.end());  // UTF-8 bytes sort as Python sorts code points
  out += name;
  if (!labels.empty()) {
    out += '{';
    for (size_t i = 0; i < labels.size(); ++i) {
      if (i > 0) out += ',';
      out += labels[i].first;
      out += "=\"";
      append_escaped(out, labels[i].second, /*quotes=*/true);
      out += '"';
    }
    out += '}';
  }
  out += ' ';
  return Result::kOk;
}

// One sample line: its prefix and its value.
Result append_sample(std::string& out, PyObject* sample, Labels& labels) {
  if (!PyTuple_Check(sample) || PyTuple_GET_SIZE(sample) < 5) return Result::kNotPlain;
  PyObject* label_dict = PyTuple_GET_ITEM(sample, 1);
  if (PyTuple_GET_ITEM(sample, 3) != Py_None || PyTuple_GET_ITEM(sample, 4) != Py_None ||
      !PyDict_Check(label_dict)) {
    return Result::kNotPlain;  // a timestamp or an exemplar
  }
  Result result = append_prefix(out, PyTuple_GET_ITEM(sample, 0), label_dict, labels);
  if (result != Result::kOk) return result;
  if ((result = append_value(out, PyTuple_GET_ITEM(sample, 2))) != Result::kOk) return result;
  out += '\n';
  return Result::kOk;
}

// A flare family's series, each (Lines, values): each line its kept prefix and its value, with no sample
// object and no label read; kNotPlain where the lines have no prefixes (a label that only prometheus_client's
// writer writes) or do not match the values.
Result append_series(std::string& out, PyObject* series) {
  Ref items(PySequence_Fast(series, "a family's series must be a sequence"));
  if (!items.object) return Result::kError;
  const Py_ssize_t count = PySequence_Fast_GET_SIZE(items.object);
  PyObject** each = PySequence_Fast_ITEMS(items.object);
  for (Py_ssize_t i = 0; i < count; ++i) {
    PyObject* entry = each[i];
    if (!PyTuple_Check(entry) || PyTuple_GET_SIZE(entry) != 2) return Result::kNotPlain;
    Ref prefixes(PyObject_GetAttr(PyTuple_GET_ITEM(entry, 0), kPrefixes));
    if (!prefixes.object) return Result::kError;
    PyObject* values = PyTuple_GET_ITEM(entry, 1);
    if (!PyTuple_Check(prefixes.object) || !PyList_Check(values) ||
        PyTuple_GET_SIZE(prefixes.object) != PyList_GET_SIZE(values)) {
      return Result::kNotPlain;
    }
    for (Py_ssize_t line = 0; line < PyList_GET_SIZE(values); ++line) {
      std::string_view prefix;
      Result result = utf8(PyTuple_GET_ITEM(prefixes.object, line), &prefix);
      if (result != Result::kOk) return result;
      out += prefix;
      if ((result = append_value(out, PyList_GET_ITEM(values, line))) != Result::kOk) return result;
      out += '\n';
    }
  }
  return Result::kOk;
}

// One family: its HELP and TYPE lines, then its samples (exposition._family_text).
Result append_family(std::string& out, PyObject* metric, Labels& labels) {
  Ref type(PyObject_GetAttr(metric, kType));
  Ref name(PyObject_GetAttr(metric, kName));
  Ref documentation(PyObject_GetAttr(metric, kDocumentation));
  if (!type.object || !name.object || !documentation.object) return Result::kError;
  std::string_view kind, base, help;
  Result result;
  if ((result = utf8(type.object, &kind)) != Result::kOk) return result;
  // a flare family's series, read instead of its samples (which it would build from them)
  Ref series(PyObject_GetAttr(metric, kSeries));
  if (series.object == nullptr && PyErr_Occurred()) {
    if (!PyErr_ExceptionMatches(PyExc_AttributeError)) return Result::kError;
    PyErr_Clear();
  }
  Ref samples(series.object == nullptr ? PyObject_GetAttr(metric, kSamples) : nullptr);
  if (series.object == nullptr && samples.object == nullptr) return Result::kError;
  if ((result = utf8(name.object, &base)) != Result::kOk) return result;
  if ((result = utf8(documentation.object, &help)) != Result::kOk) return result;
  std::string_view suffix, shown = kind;
  if (kind == "counter") {
    suffix = "_total";
  } else if (kind == "info") {
    suffix = "_info";
    shown = "gauge";
  } else if (kind != "gauge" && kind != "histogram") {
    return Result::kNotPlain;
  }
  std::string family(base);
  family += suffix;
  if (!legacy_name(family)) return Result::kNotPlain;
  out += "# HELP ";
  out += family;
  out += ' ';
  append_escaped(out, help, /*quotes=*/false);
  out += "\n# TYPE ";
  out += family;
  out += ' ';
  out += shown;
  out += '\n';
  if (series.object != nullptr) return append_series(out, series.object);
  Ref items(PySequence_Fast(samples.object, "a metric's samples must be a sequence"));
  if (!items.object) return Result::kError;
  const Py_ssize_t count = PySequence_Fast_GET_SIZE(items.object);
  PyObject** each = PySequence_Fast_ITEMS(items.object);
  for (Py_ssize_t i = 0; i < count; ++i) {
    if ((result = append_sample(out, each[i], labels)) != Result::kOk) return result;
  }
  return Result::kOk;
}

// The text of `metrics` (Metric objects, in order) as bytes, or None when one of them is not plain.
PyObject* render_text(PyObject* metrics) {
  Ref families(PySequence_Fast(metrics, "metrics must be a sequence"));
  if (!families.object) return nullptr;
  std::string out;
  out.reserve(48 * 1024);
  Labels labels;
  const Py_ssize_t count = PySequence_Fast_GET_SIZE(families.object);
  PyObject** each = PySequence_Fast_ITEMS(families.object);
  for (Py_ssize_t i = 0; i < count; ++i) {
    const Result result = append_family(out, each[i], labels);
    if (result == Result::kError) return nullptr;
    if (result == Result::kNotPlain) Py_RETURN_NONE;
  }
  return PyBytes_FromStringAndSize(out.data(), static_cast<Py_ssize_t>(out.size()));
}

}  // namespace

void add_text_format(pybind11::module_& module) {
  kType = PyUnicode_InternFromString("type");
  kName = PyUnicode_InternFromString("name");
  kDocumentation = PyUnicode_InternFromString("documentation");
  kSamples = PyUnicode_InternFromString("samples");
  kSeries = PyUnicode_InternFromString("series");
  kPrefixes = PyUnicode_InternFromString("prefixes");
  if (!kType || !kName || !kDocumentation || !kSamples || !kSeries || !kPrefixes) {
    throw pybind11::error_already_set();
  }
  module.def(
      "render_text",
      [](pybind11::handle metrics) {
        PyObject* text = render_text(metrics.ptr());
        if (text == nullptr) throw pybind11::error_already_set();
        return pybind11::reinterpret_steal<pybind11::object>(text);
      },
      "the text format of these metric families as bytes; None if one needs prometheus_client's renderer");
}

}  // namespace flare
