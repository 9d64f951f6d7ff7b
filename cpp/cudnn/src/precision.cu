// Host values to and from the storage type (precision.h), rounding as PyTorch's .to(dtype) does.
#include "device_helpers.cuh"
#include "precision.h"

namespace rung {

std::vector<uint8_t> encode(const std::vector<float>& values, Storage storage) {
  std::vector<uint8_t> out;
  with_type(storage, [&](auto t) {
    using T = decltype(t);
    out.resize(values.size() * sizeof(T));
    T* p = reinterpret_cast<T*>(out.data());
    for (size_t i = 0; i < values.size(); ++i) p[i] = from_float<T>(values[i]);
  });
  return out;
}

std::vector<float> decode(const void* data, size_t count, Storage storage) {
  std::vector<float> out(count);
  with_type(storage, [&](auto t) {
    using T = decltype(t);
    const T* p = static_cast<const T*>(data);
    for (size_t i = 0; i < count; ++i) out[i] = to_float(p[i]);
  });
  return out;
}

}  // namespace rung
