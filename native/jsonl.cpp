// The text fields of JSON lines, read in native code with the GIL released (the tokenize stage's
// parser: tasks.tokenize.encode).
//
// A line is taken here only when it is beyond doubt: a strictly valid JSON object (RFC 8259, UTF-8
// checked, every number finite as a double, nesting at most kMaxDepth deep) holding each wanted key
// once, as a non-empty string. Its texts are decoded into one flat UTF-8 buffer per key with the
// documents' offsets. Every other line that is not blank is left to the caller's Python parser,
// so what a line means is decided in one place: anything a strict reader cannot be sure of is
// "defer".
#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

namespace py = pybind11;

namespace jsonl {

enum Status : uint8_t { kDocument = 0, kBlank = 1, kDefer = 2 };
constexpr int kMaxDepth = 128;
// A number below 10^308 is finite as a double (its largest is about 1.8e308): one with at most this many
// integer digits plus its positive exponent is. A negative exponent only takes it towards 0.
constexpr size_t kMaxDecimalPlaces = 308;

struct Field {   // one key's texts, in a buffer as large as the data (no text is longer), left uninitialised
  explicit Field(size_t capacity) : text(new uint8_t[capacity]), capacity(capacity) {}
  std::unique_ptr<uint8_t[]> text;
  size_t capacity, used = 0;
  std::vector<int64_t> offsets{0};
};

class Line {
 public:
  Line(const uint8_t* begin, const uint8_t* end) : p_(begin), end_(end) {}

  // Whether the line is one object whose wanted keys each hold a non-empty string, appended to
  // ``fields`` (and taken back from them when the line is not).
  bool read(const std::vector<std::string>& keys, std::vector<Field>& fields) {
    std::vector<size_t> marks;
    for (auto& f : fields) marks.push_back(f.used);
    std::vector<bool> seen(keys.size(), false);
    bool whole = object(keys, fields, seen);
    if (whole) {
      whitespace();
      whole = p_ == end_;
    }
    for (size_t k = 0; whole && k < keys.size(); ++k)
      whole = seen[k] && fields[k].used > marks[k];
    for (size_t k = 0; k < fields.size(); ++k) {
      if (whole)
        fields[k].offsets.push_back(static_cast<int64_t>(fields[k].used));
      else
        fields[k].used = marks[k];
    }
    return whole;
  }

 private:
  const uint8_t* p_;
  const uint8_t* end_;
  int depth_ = 0;

  void whitespace() {
    while (p_ < end_ && (*p_ == ' ' || *p_ == '\t' || *p_ == '\r' || *p_ == '\n')) ++p_;
  }
  bool take(uint8_t c) {
    whitespace();
    if (p_ < end_ && *p_ == c) {
      ++p_;
      return true;
    }
    return false;
  }

  bool object(const std::vector<std::string>& keys, std::vector<Field>& fields, std::vector<bool>& seen) {
    if (!take('{')) return false;
    if (take('}')) return true;
    do {
      whitespace();
      const uint8_t* name = p_ + 1;
      if (!string(nullptr) || !take(':')) return false;
      size_t length = static_cast<size_t>(p_ - name);   // up to the colon, past the closing quote
      while (name[--length] != '"') {}
      if (std::memchr(name, '\\', length)) return false;   // an escaped name is left to the caller
      size_t k = 0;
      while (k < keys.size() && !(keys[k].size() == length && std::memcmp(keys[k].data(), name, length) == 0)) ++k;
      if (k == keys.size()) {
        if (!value()) return false;
        continue;
      }
      whitespace();
      if (seen[k] || p_ >= end_ || *p_ != '"') return false;   // a wanted key twice, or not a string
      seen[k] = true;
      uint8_t* w = fields[k].text.get() + fields[k].used;
      if (!string(&w)) return false;
      fields[k].used = static_cast<size_t>(w - fields[k].text.get());
    } while (take(','));
    return take('}');
  }

  bool value() {
    whitespace();
    if (p_ >= end_) return false;
    switch (*p_) {
      case '"': return string(nullptr);
      case '{': return nested('{', '}');
      case '[': return nested('[', ']');
      case 't': return literal("true");
      case 'f': return literal("false");
      case 'n': return literal("null");
      default: return number();
    }
  }

  bool nested(uint8_t open, uint8_t close) {
    if (++depth_ > kMaxDepth) return false;
    ++p_;
    if (!take(close)) {
      do {
        if (open == '{') {
          whitespace();
          if (!string(nullptr) || !take(':')) return false;
        }
        if (!value()) return false;
      } while (take(','));
      if (!take(close)) return false;
    }
    --depth_;
    return true;
  }

  bool literal(const char* word) {
    size_t n = std::strlen(word);
    if (static_cast<size_t>(end_ - p_) < n || std::memcmp(p_, word, n) != 0) return false;
    p_ += n;
    return true;
  }

  size_t digits() {
    const uint8_t* start = p_;
    while (p_ < end_ && *p_ >= '0' && *p_ <= '9') ++p_;
    return static_cast<size_t>(p_ - start);
  }

  bool number() {
    if (p_ < end_ && *p_ == '-') ++p_;
    if (p_ >= end_) return false;
    size_t integer;
    if (*p_ == '0') {
      ++p_;
      integer = 1;
    } else if ((integer = digits()) == 0) {
      return false;
    }
    if (p_ < end_ && *p_ == '.') {
      ++p_;
      if (digits() == 0) return false;
    }
    size_t exponent = 0;
    if (p_ < end_ && (*p_ == 'e' || *p_ == 'E')) {
      ++p_;
      bool negative = p_ < end_ && *p_ == '-';
      if (p_ < end_ && (*p_ == '+' || *p_ == '-')) ++p_;
      const uint8_t* start = p_;
      if (digits() == 0) return false;
      for (const uint8_t* d = start; d < p_ && !negative && exponent <= kMaxDecimalPlaces; ++d)
        exponent = exponent * 10 + static_cast<size_t>(*d - '0');
    }
    return integer + exponent <= kMaxDecimalPlaces;
  }

  static int hex(uint8_t c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  }

  bool code_unit(uint32_t* unit) {   // the 4 hex digits after "\u"
    if (end_ - p_ < 4) return false;
    uint32_t u = 0;
    for (int i = 0; i < 4; ++i) {
      int h = hex(p_[i]);
      if (h < 0) return false;
      u = u << 4 | static_cast<uint32_t>(h);
    }
    p_ += 4;
    *unit = u;
    return true;
  }

  // A code point as UTF-8 at the cursor *w. An escape takes 2 bytes for ASCII, 6 for up to U+FFFF
  // and 12 for a pair: never more than what it writes, so the text fits in the data's size.
  static void put(uint8_t** w, uint32_t c) {
    uint8_t* o = *w;
    if (c < 0x80) {
      *o++ = static_cast<uint8_t>(c);
    } else if (c < 0x800) {
      *o++ = static_cast<uint8_t>(0xC0 | c >> 6);
      *o++ = static_cast<uint8_t>(0x80 | (c & 0x3F));
    } else if (c < 0x10000) {
      *o++ = static_cast<uint8_t>(0xE0 | c >> 12);
      *o++ = static_cast<uint8_t>(0x80 | (c >> 6 & 0x3F));
      *o++ = static_cast<uint8_t>(0x80 | (c & 0x3F));
    } else {
      *o++ = static_cast<uint8_t>(0xF0 | c >> 18);
      *o++ = static_cast<uint8_t>(0x80 | (c >> 12 & 0x3F));
      *o++ = static_cast<uint8_t>(0x80 | (c >> 6 & 0x3F));
      *o++ = static_cast<uint8_t>(0x80 | (c & 0x3F));
    }
    *w = o;
  }

  bool escape(uint8_t** out) {   // after the backslash
    if (p_ >= end_) return false;
    uint8_t c = *p_++;
    uint32_t code;
    switch (c) {
      case '"': case '\\': case '/': code = c; break;
      case 'b': code = '\b'; break;
      case 'f': code = '\f'; break;
      case 'n': code = '\n'; break;
      case 'r': code = '\r'; break;
      case 't': code = '\t'; break;
      case 'u': {
        if (!code_unit(&code)) return false;
        if (code >= 0xDC00 && code <= 0xDFFF) return false;   // a low surrogate alone
        if (code >= 0xD800 && code <= 0xDBFF) {               // a high one: its low one must follow
          uint32_t low;
          if (end_ - p_ < 2 || p_[0] != '\\' || p_[1] != 'u') return false;
          p_ += 2;
          if (!code_unit(&low) || low < 0xDC00 || low > 0xDFFF) return false;
          code = 0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00);
        }
        break;
      }
      default: return false;
    }
    if (out) put(out, code);
    return true;
  }

  // One UTF-8 sequence of two or more bytes, strictly formed (no overlong form, no surrogate, at most U+10FFFF).
  bool multibyte(uint8_t** out) {
    const uint8_t* s = p_;
    size_t n;
    uint8_t lo = 0x80, hi = 0xBF;
    if (s[0] >= 0xC2 && s[0] <= 0xDF) n = 2;
    else if (s[0] >= 0xE0 && s[0] <= 0xEF) { n = 3; if (s[0] == 0xE0) lo = 0xA0; if (s[0] == 0xED) hi = 0x9F; }
    else if (s[0] >= 0xF0 && s[0] <= 0xF4) { n = 4; if (s[0] == 0xF0) lo = 0x90; if (s[0] == 0xF4) hi = 0x8F; }
    else return false;
    if (static_cast<size_t>(end_ - s) < n || s[1] < lo || s[1] > hi) return false;
    for (size_t i = 2; i < n; ++i)
      if (s[i] < 0x80 || s[i] > 0xBF) return false;
    if (out) {
      std::memcpy(*out, s, n);
      *out += n;
    }
    p_ += n;
    return true;
  }

  // Past the plain ASCII of a string: up to its quote, a backslash, a control byte or a non-ASCII one.
  void plain() {
#if defined(__SSE2__)
    const __m128i quote = _mm_set1_epi8('"'), backslash = _mm_set1_epi8('\\'), space = _mm_set1_epi8(0x20);
    while (end_ - p_ >= 16) {
      __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p_));
      // a signed compare below 0x20 catches the control bytes and, as negative, the non-ASCII ones
      __m128i stop = _mm_or_si128(_mm_or_si128(_mm_cmpeq_epi8(v, quote), _mm_cmpeq_epi8(v, backslash)),
                                  _mm_cmplt_epi8(v, space));
      int mask = _mm_movemask_epi8(stop);
      if (mask != 0) {
        p_ += __builtin_ctz(static_cast<unsigned>(mask));
        return;
      }
      p_ += 16;
    }
#endif
    while (p_ < end_ && *p_ >= 0x20 && *p_ < 0x80 && *p_ != '"' && *p_ != '\\') ++p_;
  }

  // A string at its opening quote, decoded to the cursor *out (unless null) and moved past it.
  bool string(uint8_t** out) {
    if (p_ >= end_ || *p_ != '"') return false;
    ++p_;
    while (p_ < end_) {
      const uint8_t* run = p_;
      plain();
      if (out) {
        std::memcpy(*out, run, static_cast<size_t>(p_ - run));
        *out += p_ - run;
      }
      if (p_ >= end_) return false;
      uint8_t c = *p_;
      if (c == '"') {
        ++p_;
        return true;
      }
      if (c == '\\') {
        ++p_;
        if (!escape(out)) return false;
      } else if (c < 0x20 || !multibyte(out)) {
        return false;
      }
    }
    return false;
  }
};

bool blank(const uint8_t* begin, const uint8_t* end) {   // what bytes.strip() leaves nothing of
  for (const uint8_t* p = begin; p < end; ++p)
    if (!(*p == ' ' || *p == '\t' || *p == '\r' || *p == '\n' || *p == '\x0b' || *p == '\x0c')) return false;
  return true;
}

template <typename T>
py::array_t<T> owned(std::vector<T>&& values) {   // a numpy array over the vector's memory, no copy
  auto* held = new std::vector<T>(std::move(values));
  py::capsule free_it(held, [](void* v) { delete static_cast<std::vector<T>*>(v); });
  return py::array_t<T>({held->size()}, {sizeof(T)}, held->data(), free_it);
}

py::array_t<uint8_t> owned(std::unique_ptr<uint8_t[]>&& bytes, size_t size) {
  uint8_t* held = bytes.release();
  py::capsule free_it(held, [](void* v) { delete[] static_cast<uint8_t*>(v); });
  return py::array_t<uint8_t>({size}, {sizeof(uint8_t)}, held, free_it);
}

py::tuple read(py::buffer data, const std::vector<std::string>& keys) {
  py::buffer_info info = data.request();
  const auto* begin = static_cast<const uint8_t*>(info.ptr);
  const uint8_t* end = begin + info.size * info.itemsize;
  std::vector<uint8_t> status;
  std::vector<int64_t> starts;
  std::vector<Field> fields;
  for (size_t k = 0; k < keys.size(); ++k) fields.emplace_back(static_cast<size_t>(end - begin) + 1);
  {
    py::gil_scoped_release free_gil;
    const uint8_t* line = begin;
    while (line < end) {
      const auto* newline = static_cast<const uint8_t*>(std::memchr(line, '\n', static_cast<size_t>(end - line)));
      const uint8_t* stop = newline ? newline : end;
      starts.push_back(line - begin);
      if (blank(line, stop))
        status.push_back(kBlank);
      else
        status.push_back(Line(line, stop).read(keys, fields) ? kDocument : kDefer);
      line = newline ? newline + 1 : end;
    }
    starts.push_back(end - begin);
  }
  py::list texts;
  for (auto& f : fields) texts.append(py::make_tuple(owned(std::move(f.text), f.used), owned(std::move(f.offsets))));
  return py::make_tuple(owned(std::move(status)), owned(std::move(starts)), texts);
}

}  // namespace jsonl

PYBIND11_MODULE(_jsonl, m) {
  m.doc() = "The text fields of JSON lines, read in native code with the GIL released.";
  m.def("read", &jsonl::read,
        "Lines of ``data`` (split at b'\\n'; a last line without one counts) read for ``keys``: (status per line "
        "(0 a document, 1 blank, 2 left to the caller), each line's start (and the end of the data), and per key "
        "(UTF-8 bytes, offsets) of the documents' texts). A document is a strictly valid JSON object holding each "
        "key once as a non-empty string; anything else that is not blank is left to the caller.",
        py::arg("data"), py::arg("keys"));
}
