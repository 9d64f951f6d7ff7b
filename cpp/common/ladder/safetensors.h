// Read and write the safetensors files of the ladder's contract (docs/protocol.md): weights, input, output.
// Format: 8-byte little-endian header length, a JSON header {name: {dtype, shape, data_offsets}}, raw data.
#pragma once
#include <cstdint>
#include <cstring>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "json.h"

namespace ladder {

struct HostTensor {
  std::vector<int64_t> shape;
  std::vector<float> data;  // the contract's files are fp32
  int64_t numel() const { int64_t n = 1; for (auto d : shape) n *= d; return n; }
};

using TensorMap = std::map<std::string, HostTensor>;

inline std::string shape_str(const std::vector<int64_t>& s) {  // "[2, 3]", for messages
  std::string o = "[";
  for (size_t i = 0; i < s.size(); ++i) o += (i ? ", " : "") + std::to_string(s[i]);
  return o + "]";
}

inline TensorMap read_safetensors(const std::string& path) {
  std::ifstream f(path, std::ios::binary | std::ios::ate);
  if (!f) throw std::runtime_error("cannot open " + path);
  const size_t file_bytes = static_cast<size_t>(f.tellg());
  f.seekg(0);
  uint64_t header_len = 0;
  f.read(reinterpret_cast<char*>(&header_len), 8);
  if (!f || 8 + header_len > file_bytes) throw std::runtime_error(path + ": not a safetensors file");
  std::string header(header_len, '\0');
  f.read(header.data(), static_cast<std::streamsize>(header_len));
  Json h = Json::parse(header);
  // One read of the whole data block (a byte iterator took about a second for a batch-256 input).
  std::vector<char> blob(file_bytes - 8 - header_len);
  f.read(blob.data(), static_cast<std::streamsize>(blob.size()));
  if (!f) throw std::runtime_error("cannot read " + path);
  TensorMap out;
  for (auto& kv : h.obj) {
    if (kv.first == "__metadata__") continue;
    const Json& e = kv.second;
    if (e.at("dtype").str != "F32") throw std::runtime_error(path + ": tensor " + kv.first + " is not F32");
    HostTensor t;
    for (auto& d : e.at("shape").arr) t.shape.push_back(static_cast<int64_t>(d.num));
    size_t begin = static_cast<size_t>(e.at("data_offsets").arr.at(0).num);
    size_t end = static_cast<size_t>(e.at("data_offsets").arr.at(1).num);
    if (end - begin != static_cast<size_t>(t.numel()) * 4 || end > blob.size())
      throw std::runtime_error(path + ": bad offsets for " + kv.first);
    t.data.resize(t.numel());
    std::memcpy(t.data.data(), blob.data() + begin, end - begin);
    out.emplace(kv.first, std::move(t));
  }
  return out;
}

inline void write_safetensors(const std::string& path, const TensorMap& tensors) {
  Json h = Json::object();
  size_t offset = 0;
  for (auto& kv : tensors) {
    Json e = Json::object();
    e["dtype"] = "F32";
    Json shape = Json::array();
    for (auto d : kv.second.shape) shape.push_back(Json(static_cast<long long>(d)));
    e["shape"] = shape;
    Json offs = Json::array();
    offs.push_back(Json(static_cast<unsigned long long>(offset)));
    offset += kv.second.data.size() * 4;
    offs.push_back(Json(static_cast<unsigned long long>(offset)));
    e["data_offsets"] = offs;
    h[kv.first] = e;
  }
  std::string header = h.dump();
  while (header.size() % 8) header += ' ';  // the format pads the header to 8 bytes
  std::ofstream f(path, std::ios::binary);
  uint64_t n = header.size();
  f.write(reinterpret_cast<const char*>(&n), 8);
  f.write(header.data(), static_cast<std::streamsize>(n));
  for (auto& kv : tensors)
    f.write(reinterpret_cast<const char*>(kv.second.data.data()), static_cast<std::streamsize>(kv.second.data.size() * 4));
  if (!f) throw std::runtime_error("cannot write " + path);
}

}  // namespace ladder
