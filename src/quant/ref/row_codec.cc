// encode_row / decode_row: argument checks and the switch on KvDtype, plus the dtypes that
// need no per-row state (16/32-bit storage and fp8 with a per-tensor scale).
//
// fp8_e4m3 / fp8_e5m2: code = encode(x / T) (one fp32 division by the per-tensor scale T),
// decoded = decode(code) * T (one fp32 multiplication).
// float16 / bfloat16: RNE conversion, finite values saturate to the largest finite value,
// inf and NaN kept. float32: the bits as they are.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>

#include "kvq/core/error.h"
#include "kvq/quant/codec.h"
#include "quant/ref/row_formats.h"

namespace kvq::quant {
namespace detail {

uint16_t float_to_fp16_bits_satfinite(float x, bool saturate_inf) {
  uint16_t h = float_to_fp16_bits(x);
  if ((h & 0x7FFFu) == 0x7C00u && (saturate_inf || std::isfinite(x)))
    h = static_cast<uint16_t>((h & 0x8000u) | 0x7BFFu);
  return h;
}

uint16_t float_to_bf16_bits_satfinite(float x) {
  uint16_t b = float_to_bf16_bits(x);
  if ((b & 0x7FFFu) == 0x7F80u && std::isfinite(x))
    b = static_cast<uint16_t>((b & 0x8000u) | 0x7F7Fu);
  return b;
}

}  // namespace detail

namespace {

void check_row(KvDtype dtype, size_t head_dim, float tensor_scale, const void* data,
               const void* scale) {
  const auto& t = traits(dtype);
  if (!t.concrete)
    throw_internal(__FILE__, __LINE__,
                   "row codec called with unresolved KV dtype '" + std::string(t.name) +
                       "'; the planner must resolve it to a concrete dtype first");
  if (head_dim == 0 || head_dim % static_cast<size_t>(t.elems_per_group) != 0 ||
      (t.rotated && (head_dim & (head_dim - 1)) != 0))
    throw_internal(__FILE__, __LINE__,
                   "row codec: head_dim " + std::to_string(head_dim) + " cannot be stored as " +
                       std::string(t.name));
  KVQ_CHECK(data != nullptr, "row codec: null data pointer");
  KVQ_CHECK(t.row_scale_bytes == 0 || scale != nullptr,
            "row codec: " + std::string(t.name) + " needs per-row metadata but scale is null");
  if (t.uses_tensor_scale && !(std::isfinite(tensor_scale) && tensor_scale > 0.0f))
    throw_internal(__FILE__, __LINE__,
                   "row codec: " + std::string(t.name) +
                       " needs a finite positive tensor scale, got " +
                       std::to_string(tensor_scale));
}

template <typename Bits>
void store_bits(std::byte* p, size_t i, Bits v) {
  std::memcpy(p + i * sizeof(Bits), &v, sizeof v);
}
template <typename Bits>
Bits load_bits(const std::byte* p, size_t i) {
  Bits v;
  std::memcpy(&v, p + i * sizeof(Bits), sizeof v);
  return v;
}

}  // namespace

void encode_row(KvDtype dtype, std::span<const float> x, float tensor_scale, std::byte* data,
                std::byte* scale) {
  check_row(dtype, x.size(), tensor_scale, data, scale);
  const size_t n = x.size();
  switch (dtype) {
    case KvDtype::kFloat16:
      for (size_t i = 0; i < n; ++i)
        store_bits(data, i, detail::float_to_fp16_bits_satfinite(x[i], false));
      return;
    case KvDtype::kBFloat16:
      for (size_t i = 0; i < n; ++i)
        store_bits(data, i, detail::float_to_bf16_bits_satfinite(x[i]));
      return;
    case KvDtype::kFloat32:
      std::memcpy(data, x.data(), n * sizeof(float));
      return;
    case KvDtype::kFp8E4M3:
      for (size_t i = 0; i < n; ++i)
        data[i] = static_cast<std::byte>(fp8_e4m3_encode(x[i] / tensor_scale));
      return;
    case KvDtype::kFp8E5M2:
      for (size_t i = 0; i < n; ++i)
        data[i] = static_cast<std::byte>(fp8_e5m2_encode(x[i] / tensor_scale));
      return;
    case KvDtype::kInt8PerTokenHead:
      detail::encode_int8_per_token_head(x, data, scale);
      return;
    case KvDtype::kFp8PerTokenHead:
      detail::encode_fp8_per_token_head(x, data, scale);
      return;
    case KvDtype::kInt4PerTokenHead:
      detail::encode_int4_per_token_head(x, data, scale);
      return;
    case KvDtype::kNvfp4:
      detail::encode_nvfp4(x, tensor_scale, data);
      return;
    case KvDtype::kAuto:
      break;
  }
  throw_internal(__FILE__, __LINE__, "encode_row: unhandled KV dtype");
}

void decode_row(KvDtype dtype, const std::byte* data, const std::byte* scale, float tensor_scale,
                std::span<float> out) {
  check_row(dtype, out.size(), tensor_scale, data, scale);
  const size_t n = out.size();
  switch (dtype) {
    case KvDtype::kFloat16:
      for (size_t i = 0; i < n; ++i) out[i] = fp16_bits_to_float(load_bits<uint16_t>(data, i));
      return;
    case KvDtype::kBFloat16:
      for (size_t i = 0; i < n; ++i) out[i] = bf16_bits_to_float(load_bits<uint16_t>(data, i));
      return;
    case KvDtype::kFloat32:
      std::memcpy(out.data(), data, n * sizeof(float));
      return;
    case KvDtype::kFp8E4M3:
      for (size_t i = 0; i < n; ++i)
        out[i] = fp8_e4m3_decode(static_cast<uint8_t>(data[i])) * tensor_scale;
      return;
    case KvDtype::kFp8E5M2:
      for (size_t i = 0; i < n; ++i)
        out[i] = fp8_e5m2_decode(static_cast<uint8_t>(data[i])) * tensor_scale;
      return;
    case KvDtype::kInt8PerTokenHead:
      detail::decode_int8_per_token_head(data, scale, out);
      return;
    case KvDtype::kFp8PerTokenHead:
      detail::decode_fp8_per_token_head(data, scale, out);
      return;
    case KvDtype::kInt4PerTokenHead:
      detail::decode_int4_per_token_head(data, scale, out);
      return;
    case KvDtype::kNvfp4:
      detail::decode_nvfp4(data, tensor_scale, out);
      return;
    case KvDtype::kAuto:
      break;
  }
  throw_internal(__FILE__, __LINE__, "decode_row: unhandled KV dtype");
}

void decode_row_unrotated(KvDtype dtype, const std::byte* data, const std::byte* scale,
                          float tensor_scale, std::span<float> out) {
  decode_row(dtype, data, scale, tensor_scale, out);
  if (traits(dtype).rotated) hadamard_unrotate(out);
}

}  // namespace kvq::quant
