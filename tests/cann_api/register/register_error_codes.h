// Declarations only (see ../README.md). Source of the facts: metadef inc/external/register/register_error_codes.h.
#ifndef SGDFUSE_TEST_CANN_REGISTER_ERROR_CODES_H_
#define SGDFUSE_TEST_CANN_REGISTER_ERROR_CODES_H_
#include <cstdint>
namespace domi {
using Status = uint32_t;
constexpr Status SUCCESS = 0U;
constexpr Status FAILED = 0xFFFFFFFFU;
}  // namespace domi
#endif
