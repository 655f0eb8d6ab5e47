// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), the checksum of TFRecord files such as
// TensorBoard's event files; and the masking those files apply to it. Table-driven, a byte at a
// time: the records it checks are a few hundred bytes.
#pragma once

#include <cstddef>
#include <cstdint>

namespace strata {

// CRC-32C of n bytes, continuing from `crc` (0 to start).
uint32_t crc32c(const void* data, size_t n, uint32_t crc = 0);

// TFRecord's masked form: rotate right by 15 bits, add 0xa282ead8 (so that a CRC of data that
// holds CRCs is not trivially related to them).
inline uint32_t mask_crc32c(uint32_t crc) { return ((crc >> 15) | (crc << 17)) + 0xa282ead8u; }

}  // namespace strata
