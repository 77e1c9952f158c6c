// Declarations only (see ../README.md). Source of the facts: metadef inc/external/graph/ascend_string.h.
#ifndef SGDFUSE_TEST_CANN_GRAPH_ASCEND_STRING_H_
#define SGDFUSE_TEST_CANN_GRAPH_ASCEND_STRING_H_
#include <cstddef>
#include "graph/types.h"
namespace ge {
class AscendString {
 public:
  AscendString() = default;
  ~AscendString() = default;
  AscendString(const char_t *const name);
  AscendString(const char_t *const name, size_t length);
  const char_t *GetString() const;
  size_t GetLength() const;
};
}  // namespace ge
#endif
