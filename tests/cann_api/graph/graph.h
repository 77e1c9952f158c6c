// Declarations only (see ../README.md). Source of the facts: metadef inc/external/graph/graph.h.
#ifndef SGDFUSE_TEST_CANN_GRAPH_GRAPH_H_
#define SGDFUSE_TEST_CANN_GRAPH_GRAPH_H_
#include <cstddef>
#include <utility>
#include <vector>
#include "graph/operator.h"
namespace ge {
class Graph {
 public:
  Graph &SetInputs(const std::vector<Operator> &inputs);
  Graph &SetOutputs(const std::vector<Operator> &outputs);
  Graph &SetOutputs(const std::vector<std::pair<Operator, std::vector<size_t>>> &output_indexs);
  Graph &SetOutputs(const std::vector<std::pair<ge::Operator, AscendString>> &outputs);
};
}  // namespace ge
#endif
