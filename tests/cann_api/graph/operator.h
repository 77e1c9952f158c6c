// Declarations only (see ../README.md). Source of the facts: metadef inc/external/graph/operator.h.
#ifndef SGDFUSE_TEST_CANN_GRAPH_OPERATOR_H_
#define SGDFUSE_TEST_CANN_GRAPH_OPERATOR_H_
#include <cstdint>
#include <string>
#include "graph/ascend_string.h"
#include "graph/types.h"
namespace ge {
class Operator {
 public:
  Operator() {}
  explicit Operator(const char_t *type);
  Operator(const char_t *name, const char_t *type);
  Operator(const AscendString &name, const AscendString &type);
  virtual ~Operator() = default;

  graphStatus GetName(AscendString &name) const;
  Operator &AddControlInput(const Operator &src_oprt);

  Operator &SetAttr(const char_t *name, int64_t attr_value);
  Operator &SetAttr(const char_t *name, int32_t attr_value);
  Operator &SetAttr(const char_t *name, uint32_t attr_value);
  graphStatus GetAttr(const char_t *name, int64_t &attr_value) const;
  graphStatus GetAttr(const char_t *name, int32_t &attr_value) const;
  graphStatus GetAttr(const char_t *name, uint32_t &attr_value) const;
  Operator &SetAttr(const char_t *name, float32_t attr_value);
  graphStatus GetAttr(const char_t *name, float32_t &attr_value) const;
  Operator &SetAttr(const char_t *name, const char_t *attr_value);
  Operator &SetAttr(const char_t *name, const AscendString &attr_value);
  graphStatus GetAttr(const char_t *name, AscendString &attr_value) const;
  Operator &SetAttr(const char_t *name, bool attr_value);
  graphStatus GetAttr(const char_t *name, bool &attr_value) const;

  SGDFUSE_TEST_DEPRECATED(Operator &SetAttr(const char_t *, int64_t))
  Operator &SetAttr(const std::string &name, int64_t attr_value);
  SGDFUSE_TEST_DEPRECATED(Operator &SetAttr(const char_t *, float32_t))
  Operator &SetAttr(const std::string &name, float32_t attr_value);
  SGDFUSE_TEST_DEPRECATED(Operator &SetAttr(const char_t *, bool))
  Operator &SetAttr(const std::string &name, bool attr_value);
  SGDFUSE_TEST_DEPRECATED(Operator &SetAttr(const char_t *, const AscendString &))
  Operator &SetAttr(const std::string &name, const std::string &attr_value);
  SGDFUSE_TEST_DEPRECATED(graphStatus GetAttr(const char_t *, AscendString &) const)
  graphStatus GetAttr(const std::string &name, std::string &attr_value) const;

 protected:
  void DynamicInputRegister(const char_t *name, const uint32_t num, bool is_push_back = true);
  void DynamicOutputRegister(const char_t *name, const uint32_t num, bool is_push_back = true);
};
}  // namespace ge
#endif
