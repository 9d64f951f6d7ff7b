// Minimal JSON: a writer for the child's result file and a reader for safetensors headers.
// Only what the ladder's contract needs (objects, arrays, strings, numbers, bools, null).
#pragma once
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace ladder {

struct Json {
  enum Kind { Null, Bool, Number, String, Array, Object } kind = Null;
  bool b = false;
  double num = 0;
  std::string str;
  std::vector<Json> arr;
  std::vector<std::pair<std::string, Json>> obj;  // insertion order kept for readable output

  Json() = default;
  Json(std::nullptr_t) {}
  Json(bool v) : kind(Bool), b(v) {}
  Json(double v) : kind(Number), num(v) {}
  Json(int v) : kind(Number), num(v) {}
  Json(long v) : kind(Number), num(double(v)) {}
  Json(long long v) : kind(Number), num(double(v)) {}
  Json(unsigned long v) : kind(Number), num(double(v)) {}
  Json(unsigned long long v) : kind(Number), num(double(v)) {}
  Json(const char* v) : kind(String), str(v) {}
  Json(std::string v) : kind(String), str(std::move(v)) {}
  Json(const std::vector<double>& v) : kind(Array) { for (double x : v) arr.emplace_back(x); }

  static Json object() { Json j; j.kind = Object; return j; }
  static Json array() { Json j; j.kind = Array; return j; }

  Json& operator[](const std::string& key) {
    if (kind == Null) kind = Object;
    for (auto& kv : obj) if (kv.first == key) return kv.second;
    obj.emplace_back(key, Json());
    return obj.back().second;
  }
  const Json& at(const std::string& key) const {
    for (auto& kv : obj) if (kv.first == key) return kv.second;
    throw std::runtime_error("json: missing key " + key);
  }
  bool has(const std::string& key) const {
    for (auto& kv : obj) if (kv.first == key) return true;
    return false;
  }
  void push_back(Json v) { kind = Array; arr.push_back(std::move(v)); }

  std::string dump() const {
    switch (kind) {
      case Null: return "null";
      case Bool: return b ? "true" : "false";
      case Number: {
        if (!std::isfinite(num)) return "null";
        char buf[32];
        std::snprintf(buf, sizeof buf, "%.17g", num);
        return buf;
      }
      case String: return quote(str);
      case Array: {
        std::string s = "[";
        for (size_t i = 0; i < arr.size(); ++i) s += (i ? "," : "") + arr[i].dump();
        return s + "]";
      }
      case Object: {
        std::string s = "{";
        for (size_t i = 0; i < obj.size(); ++i) s += (i ? "," : "") + quote(obj[i].first) + ":" + obj[i].second.dump();
        return s + "}";
      }
    }
    return "null";
  }

  static std::string quote(const std::string& s) {
    std::string o = "\"";
    for (char c : s) {
      if (c == '"' || c == '\\') { o += '\\'; o += c; }
      else if (c == '\n') o += "\\n";
      else if (static_cast<unsigned char>(c) < 0x20) { char b[8]; std::snprintf(b, sizeof b, "\\u%04x", c); o += b; }
      else o += c;
    }
    return o + "\"";
  }

  static Json parse(const std::string& text) {
    size_t i = 0;
    Json j = parse_value(text, i);
    skip_ws(text, i);
    if (i != text.size()) throw std::runtime_error("json: trailing characters");
    return j;
  }

 private:
  static void skip_ws(const std::string& t, size_t& i) { while (i < t.size() && std::isspace((unsigned char)t[i])) ++i; }
  static void expect(const std::string& t, size_t& i, char c) {
    skip_ws(t, i);
    if (i >= t.size() || t[i] != c) throw std::runtime_error(std::string("json: expected ") + c);
    ++i;
  }
  static std::string parse_string(const std::string& t, size_t& i) {
    expect(t, i, '"');
    std::string s;
    while (i < t.size() && t[i] != '"') {
      if (t[i] == '\\') {
        ++i;
        char e = t.at(i);
        if (e == 'n') s += '\n'; else if (e == 't') s += '\t'; else if (e == 'u') { s += '?'; i += 4; }
        else s += e;
      } else s += t[i];
      ++i;
    }
    expect(t, i, '"');
    return s;
  }
  static Json parse_value(const std::string& t, size_t& i) {
    skip_ws(t, i);
    if (i >= t.size()) throw std::runtime_error("json: unexpected end");
    char c = t[i];
    if (c == '{') {
      Json j = object(); ++i; skip_ws(t, i);
      if (t[i] == '}') { ++i; return j; }
      for (;;) {
        std::string k = parse_string(t, i);
        expect(t, i, ':');
        j.obj.emplace_back(k, parse_value(t, i));
        skip_ws(t, i);
        if (t[i] == ',') { ++i; continue; }
        expect(t, i, '}');
        return j;
      }
    }
    if (c == '[') {
      Json j = array(); ++i; skip_ws(t, i);
      if (t[i] == ']') { ++i; return j; }
      for (;;) {
        j.arr.push_back(parse_value(t, i));
        skip_ws(t, i);
        if (t[i] == ',') { ++i; continue; }
        expect(t, i, ']');
        return j;
      }
    }
    if (c == '"') return Json(parse_string(t, i));
    if (t.compare(i, 4, "true") == 0) { i += 4; return Json(true); }
    if (t.compare(i, 5, "false") == 0) { i += 5; return Json(false); }
    if (t.compare(i, 4, "null") == 0) { i += 4; return Json(); }
    size_t end = i;
    while (end < t.size() && (std::isdigit((unsigned char)t[end]) || std::strchr("+-.eE", t[end]))) ++end;
    if (end == i) throw std::runtime_error("json: bad value");
    Json j(std::stod(t.substr(i, end - i)));
    i = end;
    return j;
  }
};

}  // namespace ladder
