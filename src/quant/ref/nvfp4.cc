// NVFP4 rows: FP4 E2M1 values with one E4M3 scale per 16 values and the per-tensor fp32
// dequantization scale T (tensor_scale).
//
// Row layout (row_data_bytes = head_dim / 16 * 9):
//   bytes [0, head_dim/2)              packed fp4 codes, byte i = c[2i] | c[2i+1] << 4
//   bytes [head_dim/2, head_dim/16*9)  e4m3 block scale codes, block b covers [16b, 16b+16)
//
// Encoding block b, in fp32 with one rounding per operation:
//   d = 6.0f * T                                   (once per row)
//   block code = fp8_e4m3_encode(absmax_b / d)     (absmax over finite values; saturates)
//   E = fp8_e4m3_decode(block code) * T            (the effective scale, as decoded)
//   c = E == 0 ? 0 : fp4_e2m1_encode(x / E)        (RNE, saturating at +-6, NaN -> +0)
// Decoding: (fp4 value * block scale value) * T. The first product is exact (2 x 4
// significant bits), so there is a single rounding, by the last multiplication.
#include <cstdint>
#include <span>

#include "kvq/quant/codec.h"
#include "quant/ref/row_formats.h"

namespace kvq::quant::detail {

void encode_nvfp4(std::span<const float> x, float tensor_scale, std::byte* data) {
  const size_t n = x.size();
  std::byte* block_scales = data + n / 2;
  const float d = kFp4E2M1Max * tensor_scale;
  for (size_t b = 0; b < n / 16; ++b) {
    const auto block = x.subspan(b * 16, 16);
    const uint8_t sc = fp8_e4m3_encode(finite_absmax(block) / d);
    block_scales[b] = static_cast<std::byte>(sc);
    const float e = fp8_e4m3_decode(sc) * tensor_scale;
    for (size_t i = 0; i < 16; i += 2) {
      const uint8_t c0 = e == 0.0f ? 0 : fp4_e2m1_encode(block[i] / e);
      const uint8_t c1 = e == 0.0f ? 0 : fp4_e2m1_encode(block[i + 1] / e);
      data[(b * 16 + i) / 2] = static_cast<std::byte>(c0 | (c1 << 4));
    }
  }
}

void decode_nvfp4(const std::byte* data, float tensor_scale, std::span<float> out) {
  const size_t n = out.size();
  const std::byte* block_scales = data + n / 2;
  for (size_t i = 0; i < n; i += 2) {
    const float bs = fp8_e4m3_decode(static_cast<uint8_t>(block_scales[i / 16]));
    const auto packed = static_cast<uint8_t>(data[i / 2]);
    out[i] = fp4_e2m1_decode(packed & 0xF) * bs * tensor_scale;
    out[i + 1] = fp4_e2m1_decode(packed >> 4) * bs * tensor_scale;
  }
}

}  // namespace kvq::quant::detail
