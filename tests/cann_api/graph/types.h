// Declarations only (see ../README.md). Source of the facts: metadef inc/external/graph/types.h.
#ifndef SGDFUSE_TEST_CANN_GRAPH_TYPES_H_
#define SGDFUSE_TEST_CANN_GRAPH_TYPES_H_
#include <cstdint>
namespace ge {
using char_t = char;
using float32_t = float;
using graphStatus = uint32_t;
const graphStatus GRAPH_SUCCESS = 0;  // graph/ge_error_codes.h
}  // namespace ge
namespace domi {
enum class ImplyType : unsigned int { BUILDIN = 0, TVM, CUSTOM, AI_CPU, CCE, GELOCAL, HCCL, INVALID = 0xFFFFFFFF };
using char_t = ge::char_t;
using float32_t = ge::float32_t;
}  // namespace domi
#define SGDFUSE_TEST_DEPRECATED(replacement) __attribute__((deprecated("Please use " #replacement " instead.")))
#endif
