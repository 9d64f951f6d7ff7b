// The precision of a run: how weights and activations are stored, their cuDNN and CUDA types, and host values
// to and from the storage type.
#pragma once
#include <cudnn.h>
#include <library_types.h>

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace rung {

// How weights and activations are stored; accumulation is fp32 in every case.
enum class Storage { F32, F16, BF16 };

struct Precision {
  std::string name;       // the contract's --dtype: fp32 | tf32 | fp16 | bf16
  Storage storage;
  cudnnDataType_t cudnn;  // storage type for cuDNN
  cudaDataType_t cuda;    // the same for cuBLASLt
  size_t bytes;           // per element
  bool tf32;              // fp32 data, TF32 tensor-core math allowed

  static Precision parse(const std::string& dtype) {
    if (dtype == "fp32") return {dtype, Storage::F32, CUDNN_DATA_FLOAT, CUDA_R_32F, 4, false};
    if (dtype == "tf32") return {dtype, Storage::F32, CUDNN_DATA_FLOAT, CUDA_R_32F, 4, true};
    if (dtype == "fp16") return {dtype, Storage::F16, CUDNN_DATA_HALF, CUDA_R_16F, 2, false};
    if (dtype == "bf16") return {dtype, Storage::BF16, CUDNN_DATA_BFLOAT16, CUDA_R_16BF, 2, false};
    throw std::runtime_error("unknown --dtype " + dtype);
  }
  bool tensor_cores() const { return storage != Storage::F32 || tf32; }
};

// fp32 host values to/from the storage type, rounding to nearest even (what PyTorch's .to(dtype) does).
std::vector<uint8_t> encode(const std::vector<float>& values, Storage storage);
std::vector<float> decode(const void* data, size_t count, Storage storage);

}  // namespace rung
