// Declarations only (see README.md): the classes REG_OP generates (metadef inc/external/graph/operator_reg.h)
// for the three GE op prototypes the plugin builds (Data and TensorMove from the built-in op prototypes, SGD
// from nn_training_ops.h: inputs parameters, gradient, learning_rate, accum, momentum, stat; attributes
// dampening Float, weight_decay Float, nesterov Bool). Attribute setters take `const Op<Type> &`
// (OpInt = int64_t, OpFloat = float, OpBool = bool); input setters take a non-const `Operator &`.
#ifndef SGDFUSE_TEST_CANN_ALL_OPS_H_
#define SGDFUSE_TEST_CANN_ALL_OPS_H_
#include <cstdint>
#include "graph/operator.h"
namespace ge {
namespace op {
class Data : public Operator {
 public:
  explicit Data(const char *name);
  Data &set_attr_index(const int64_t &v);
};
class TensorMove : public Operator {
 public:
  explicit TensorMove(const char *name);
  TensorMove &set_input_x(Operator &v);
};
class SGD : public Operator {
 public:
  explicit SGD(const char *name);
  SGD &set_input_parameters(Operator &v);
  SGD &set_input_gradient(Operator &v);
  SGD &set_input_learning_rate(Operator &v);
  SGD &set_input_accum(Operator &v);
  SGD &set_input_momentum(Operator &v);
  SGD &set_input_stat(Operator &v);
  SGD &set_attr_dampening(const float &v);
  SGD &set_attr_weight_decay(const float &v);
  SGD &set_attr_nesterov(const bool &v);
};
}  // namespace op
}  // namespace ge
#endif
