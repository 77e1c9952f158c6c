// Declarations only (see ../README.md). Source of the facts: metadef inc/external/register/register.h.
#ifndef SGDFUSE_TEST_CANN_REGISTER_REGISTER_H_
#define SGDFUSE_TEST_CANN_REGISTER_REGISTER_H_
#include <cstdint>
#include <functional>
#include <vector>
#include "graph/graph.h"
#include "graph/operator.h"
#include "graph/types.h"
#include "register/register_error_codes.h"
#include "register/register_fmk_types.h"
namespace domi {
enum DynamicType : int16_t { kInvalid = 0, kInput = 1, kOutput = 2 };
struct DynamicInputOutputInfo {
  DynamicType type;
  const char_t *port_name;
  int64_t port_name_len;
  const char_t *attr_name;
  int64_t attr_name_len;
  DynamicInputOutputInfo(const DynamicType type_instance, const char_t *const port_name_instance,
                         const int64_t port_name_len_instance, const char_t *const attr_name_instance,
                         const int64_t attr_name_len_instance);
  DynamicInputOutputInfo();
};
Status AutoMappingByOpFn(const ge::Operator &op_src, ge::Operator &op);
Status AutoMappingByOpFnDynamic(const ge::Operator &op_src, ge::Operator &op,
                                const std::vector<DynamicInputOutputInfo> &dynamic_name_attr_value);

using ParseParamByOpFunc = std::function<domi::Status(const ge::Operator &, ge::Operator &)>;
using ParseOpToGraphFunc = std::function<Status(const ge::Operator &, ge::Graph &)>;

class OpRegistrationData {
 public:
  OpRegistrationData(const char_t *om_optype);
  ~OpRegistrationData();
  OpRegistrationData &FrameworkType(const domi::FrameworkType &fmk_type);
  OpRegistrationData &OriginOpType(const char_t *ori_op_type);
  OpRegistrationData &ParseParamsByOperatorFn(const ParseParamByOpFunc &parse_param_by_op_fn);
  OpRegistrationData &ParseOpToGraphFn(const ParseOpToGraphFunc &parse_op_to_graph_fn);
  OpRegistrationData &ImplyType(const domi::ImplyType &imply_type);
};

class OpReceiver {
 public:
  OpReceiver(OpRegistrationData &reg_data);
  ~OpReceiver() = default;
};
}  // namespace domi

#define REGISTER_CUSTOM_OP(name) REGISTER_CUSTOM_OP_UNIQ_HELPER(__COUNTER__, (name))
#define REGISTER_CUSTOM_OP_UNIQ_HELPER(ctr, name) REGISTER_CUSTOM_OP_UNIQ(ctr, (name))
#define REGISTER_CUSTOM_OP_UNIQ(ctr, name) \
  static OpReceiver register_op##ctr __attribute__((unused)) = OpRegistrationData(name)
#endif
