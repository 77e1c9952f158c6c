// sgdfuse: a MindSpore FULL_GRAPH custom pass that fuses mindspore.mint.optim.SGD updates into one SGD op.
//
// What mint.optim.SGD compiles to, per parameter w with momentum buffer buf and gradient g (frontend IR,
// after type inference and before auto_monad_reorder, which is where FULL_GRAPH passes run):
//
//   g'   = AddExt(g, Load(w, U), wd)                       only when weight_decay != 0
//   cond = EqScalar(Load(step_t, U), 0)                    shared by every parameter of the optimizer
//   call = Switch(cond, Partial(first, buf, g', u), Partial(later, buf, g', u))()
//          first: InplaceCopy(buf, g') [InplaceCopy(buf, buf)]           -> buf = g'
//          later: InplaceMuls(buf, m); InplaceAddExt(buf, g', 1 - d)       -> buf = m*buf + (1-d)*g'
//          nesterov: both branches return AddExt(g', Load(buf), m) instead of buf
//   U1   = UpdateState(u, call)
//   P    = InplaceAddExt(w, call, -lr, U1)
//   U2   = UpdateState(U1, P)
//
// The branches are not matched as fixed op lists: each branch is evaluated symbolically, in the order of its
// monad chain, to a pair of linear forms over (old buf, g') -- the new buffer and the returned value -- and
// those are solved for momentum, dampening and nesterov (docs/design.md: matching is algebraic).
//
// The rewrite, per matched update:
//   stat = BroadcastTo(Cast(cond, dtype(w)), shape(w))     1 on the first step (step_t == 0), else 0
//   A    = Assign(buf, MaskedFill(Load(buf), cond, 0))     the buffer zeroed on the first step
//   S    = SGD(w, g, lr, buf, m, stat, UpdateState(U1', A))  {dampening=d, weight_decay=wd, nesterov}
// S takes P's place in the monad chain (U2 = UpdateState(.., S)), so every read of w or buf that was
// ordered after P is ordered after S. The Switch, both branch graphs, the Partials and the weight-decay
// AddExt (folded into the weight_decay attribute) become dead. lr is a constant, or the one-element tensor
// mint reads -lr from at run time (a learning rate held in a Parameter).
//
// stat derivation, and why it is exact: with stat = 1 the Ascend contract computes accum*m + grad with no
// dampening; with the buffer zeroed first that is mint's first-step buf = grad, whatever the buffer held
// (step_t reset by a schedule, buffers restored without step_t). MindSpore's CPU kernel sets accum = grad
// outright where stat > 0. With stat = 0 both compute m*accum + (1-d)*grad.
//
// Weight decay grad + wd*w read before the update is folded into the attribute only when nothing but this
// update can write w in the step (followed through every graph w is passed into): the op reads w when it
// runs. Otherwise the term stays in the gradient as computed (a SAM-style step moves w between the two).
//
// With many parameters MindSpore does not inline mint's per-parameter body: it keeps one graph per
// parameter signature, called as f(Load(step_t), w, buf, g', u), with the weight decay computed by the caller
// -- with parameter groups through each group's hyper_map graph, which passes its own parameters down.
// The same rewrite applies inside such a graph: what each graph parameter stands for is followed through
// every chain of call sites up to the top graph (the step counter, the real Parameters for the report and
// for the writes check, the callers' weight decay, folded in); the graph is then straight-line and is
// inlined at its call sites, innermost first.
// Finally each run of consecutive fused updates is moved into one no_inline subgraph (OutlineUpdateRuns says
// why: in-place weight writes inside the backward's kernel graph slow MindSpore's CPU runtime down).
//
// Results go to the JSON-lines file named by SGDFUSE_MINDSPORE_REPORT (one record per candidate, see
// sgdfuse/mindspore/plugin.py); SGDFUSE_MINDSPORE_DISABLE=1 makes the pass a no-op for graphs compiled
// while it is set (SGDFUSE_MINDSPORE_OUTLINE=0 skips step 3, for measurements). The pass never throws into
// MindSpore: every match is planned before anything is edited, and an exception is reported as an error
// record (an exception during analysis leaves the graph untouched).

#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "mindspore/include/custom_pass_api.h"
#include "ir/func_graph.h"
#include "ir/func_graph_cloner.h"
#include "ir/func_graph_flag.h"
#include "ir/graph_utils.h"
#include "ir/manager.h"
#include "ir/tensor_new.h"
#include "abstract/abstract_value.h"

namespace sgdfuse_ms {
using mindspore::AnfNodePtr;
using mindspore::CNode;
using mindspore::CNodePtr;
using mindspore::FuncGraphManagerPtr;
using mindspore::FuncGraphPtr;
using mindspore::Parameter;
using mindspore::ParameterPtr;
using mindspore::PrimitivePtr;
using mindspore::ShapeVector;
using mindspore::TypeId;
using mindspore::ValueNode;
using mindspore::ValuePtr;

constexpr char kPassName[] = "sgdfuse_mint_sgd";
constexpr char kPluginName[] = "SgdfusePlugin";
constexpr char kFusedMark[] = "sgdfuse_fused";
constexpr char kDoneFlag[] = "sgdfuse_pass_done";

// ---------------------------------------------------------------------------------------------------------
// Small helpers over the IR.

std::string PrimName(const AnfNodePtr &node) {
  auto prim = mindspore::GetCNodePrimitive(node);
  return prim == nullptr ? std::string() : prim->name();
}

bool IsPrim(const AnfNodePtr &node, const char *name) { return PrimName(node) == name; }

CNodePtr AsCNode(const AnfNodePtr &node) { return node == nullptr ? nullptr : node->cast<CNodePtr>(); }

// A compile-time scalar: an immediate (float, int, bool) or a 0-d/1-element constant tensor.
bool ScalarValue(const AnfNodePtr &node, double *out) {
  if (node == nullptr || !node->isa<ValueNode>()) return false;
  ValuePtr v = node->cast<mindspore::ValueNodePtr>()->value();
  if (v == nullptr) return false;
  if (v->isa<mindspore::FP32Imm>()) {
    *out = static_cast<double>(v->cast<mindspore::FP32ImmPtr>()->value());
  } else if (v->isa<mindspore::FP64Imm>()) {
    *out = v->cast<mindspore::FP64ImmPtr>()->value();
  } else if (v->isa<mindspore::Int64Imm>()) {
    *out = static_cast<double>(v->cast<mindspore::Int64ImmPtr>()->value());
  } else if (v->isa<mindspore::Int32Imm>()) {
    *out = static_cast<double>(v->cast<mindspore::Int32ImmPtr>()->value());
  } else if (v->isa<mindspore::BoolImm>()) {
    *out = v->cast<mindspore::BoolImmPtr>()->value() ? 1.0 : 0.0;
  } else if (v->isa<mindspore::tensor::Tensor>()) {
    auto t = v->cast<mindspore::tensor::TensorPtr>();
    if (t->DataSize() != 1) return false;
    auto cpu = t->cpu();
    if (cpu == nullptr || cpu->data_c() == nullptr) return false;
    switch (cpu->data_type()) {
      case mindspore::kNumberTypeFloat32: *out = *static_cast<const float *>(cpu->data_c()); break;
      case mindspore::kNumberTypeFloat64: *out = *static_cast<const double *>(cpu->data_c()); break;
      case mindspore::kNumberTypeInt32: *out = *static_cast<const int32_t *>(cpu->data_c()); break;
      case mindspore::kNumberTypeInt64: *out = static_cast<double>(*static_cast<const int64_t *>(cpu->data_c())); break;
      default: return false;
    }
  } else {
    return false;
  }
  return true;
}

bool IsUMonad(const AnfNodePtr &node) { return node != nullptr && mindspore::HasAbstractUMonad(node); }

// A weight-like Parameter: a graph parameter holding a default value (a Ref in the IR).
ParameterPtr AsWeight(const AnfNodePtr &node) {
  if (node == nullptr || !node->isa<Parameter>()) return nullptr;
  auto p = node->cast<ParameterPtr>();
  return p->has_default() ? p : nullptr;
}

// A Parameter carrying a Ref: a weight of the top graph, or a parameter of a graph that MindSpore shares
// between several weights of one shape (with many parameters, hyper_map's per-parameter body is not
// inlined: one graph per signature is called once per parameter with (step, w, buf, grad, u)).
bool IsRefParam(const AnfNodePtr &node) {
  if (node == nullptr || !node->isa<Parameter>()) return false;
  if (AsWeight(node) != nullptr) return true;
  auto abs = node->abstract();
  return abs != nullptr && abs->isa<mindspore::abstract::AbstractRefTensor>();
}

using CallSites = std::map<const mindspore::FuncGraph *, std::vector<CNodePtr>>;

bool TensorInfo(const AnfNodePtr &node, TypeId *dtype, ShapeVector *shape) {
  auto abs = node == nullptr ? nullptr : node->abstract();
  if (abs == nullptr || !abs->isa<mindspore::abstract::AbstractTensor>()) return false;
  auto t = abs->cast<mindspore::abstract::AbstractTensorPtr>();
  auto elem = t->element();
  if (elem == nullptr || elem->BuildType() == nullptr) return false;
  *dtype = elem->BuildType()->type_id();
  auto s = t->GetShape();
  if (s == nullptr || s->IsDynamic()) return false;
  *shape = s->GetShapeVector();
  return true;
}

std::string DtypeName(TypeId t) {
  switch (t) {
    case mindspore::kNumberTypeFloat32: return "FLOAT";
    case mindspore::kNumberTypeFloat16: return "FLOAT16";
    case mindspore::kNumberTypeBFloat16: return "BFLOAT16";
    case mindspore::kNumberTypeFloat64: return "DOUBLE";
    default: return "type#" + std::to_string(static_cast<int>(t));
  }
}

std::string NodeName(const AnfNodePtr &node) {
  if (node == nullptr) return "?";
  if (node->isa<Parameter>()) {
    auto name = node->cast<ParameterPtr>()->name();
    return name.empty() ? node->DebugString() : name;
  }
  if (node->isa<CNode>()) {
    auto name = PrimName(node);
    return (name.empty() ? std::string("call") : name) + "@" + node->fullname_with_scope();
  }
  return node->ToString();
}

std::string Json(const std::string &s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\u%04x", c);
          out += buf;
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  return out + "\"";
}

std::string Num(double v) {
  char buf[40];
  // Shortest round-trip of the float32 the value is stored as (attributes and scalars are FLOAT).
  float f = static_cast<float>(v);
  for (int precision = 6; precision <= 9; ++precision) {
    std::snprintf(buf, sizeof(buf), "%.*g", precision, static_cast<double>(f));
    if (std::strtof(buf, nullptr) == f) break;
  }
  return buf;
}

// ---------------------------------------------------------------------------------------------------------
// Symbolic evaluation of one branch graph to linear forms over (old buffer, gradient).

struct Lin {
  double b = 0.0;  // coefficient of the buffer's value on entry
  double g = 0.0;  // coefficient of the gradient
};

Lin Add(const Lin &x, const Lin &y, double alpha) { return Lin{x.b + alpha * y.b, x.g + alpha * y.g}; }
Lin Scale(const Lin &x, double s) { return Lin{x.b * s, x.g * s}; }

bool Close(double x, double y) { return std::fabs(x - y) <= 1e-12 * std::max(1.0, std::max(std::fabs(x), std::fabs(y))); }
bool Same(const Lin &x, const Lin &y) { return Close(x.b, y.b) && Close(x.g, y.g); }

struct BranchEffect {
  Lin buf;               // the buffer after the branch
  Lin ret;               // what the branch returns
  int inplace_ops = 0;   // writes to the buffer
  int nodes = 0;         // CNodes in the branch
};

class BranchEvaluator {
 public:
  BranchEvaluator(const AnfNodePtr &buf, const AnfNodePtr &grad, const AnfNodePtr &monad)
      : buf_(buf), grad_(grad) {
    state_[monad.get()] = Lin{1.0, 0.0};
  }

  // Returns "" on success, else why the branch is not a momentum-buffer update.
  std::string Run(const FuncGraphPtr &fg, BranchEffect *out) {
    auto ret = fg->get_return();
    if (ret == nullptr) return "branch graph has no return";
    for (auto &node : mindspore::TopoSort(ret)) {
      auto cnode = AsCNode(node);
      if (cnode == nullptr) continue;
      out->nodes++;
      auto err = Step(cnode, out);
      if (!err.empty()) return err;
    }
    auto ret_cnode = ret->cast<CNodePtr>();
    if (ret_cnode->size() != 2) return "unexpected return";
    AnfNodePtr result = ret_cnode->input(1);
    AnfNodePtr final_monad = nullptr;
    if (IsPrim(result, "Depend")) {
      auto dep = result->cast<CNodePtr>();
      final_monad = dep->input(2);
      result = dep->input(1);
    }
    if (final_monad == nullptr || state_.count(final_monad.get()) == 0) {
      return "the branch's writes are not all ordered before its result";
    }
    out->buf = state_[final_monad.get()];
    if (chained_writes_ != out->inplace_ops) return "a write to the buffer is not on the branch's monad chain";
    if (result == buf_) {
      out->ret = out->buf;
    } else if (values_.count(result.get())) {
      out->ret = values_[result.get()];
    } else {
      return "the branch returns a value that is not a linear form of the buffer and gradient";
    }
    return "";
  }

 private:
  // The value of a pure operand: the gradient, a Load of the buffer, or a pure node already evaluated.
  bool Value(const AnfNodePtr &node, Lin *out) {
    if (node == grad_) {
      *out = Lin{0.0, 1.0};
      return true;
    }
    auto it = values_.find(node.get());
    if (it == values_.end()) return false;
    *out = it->second;
    return true;
  }

  std::string Step(const CNodePtr &node, BranchEffect *out) {
    const std::string op = PrimName(node);
    const size_t n = node->size();
    auto monad_state = [&](const AnfNodePtr &u, Lin *s) {
      auto it = state_.find(u.get());
      if (it == state_.end()) return false;
      *s = it->second;
      return true;
    };
    if (op == "InplaceCopy" || op == "InplaceMuls" || op == "InplaceAddExt" || op == "InplaceSubExt" ||
        op == "InplaceMul" || op == "InplaceAdd" || op == "InplaceSub") {
      if (node->input(1) != buf_) return op + " writes something other than the momentum buffer";
      Lin before;
      if (!monad_state(node->input(n - 1), &before)) return op + " is not ordered on the branch's monad chain";
      auto operand = [&](const AnfNodePtr &x, Lin *v) {
        if (x == buf_) {
          *v = before;  // a Ref read by an in-place op reads the value at that op's place in the chain
          return true;
        }
        return Value(x, v);
      };
      Lin after;
      if (op == "InplaceCopy") {
        Lin src;
        if (n != 5 || !operand(node->input(2), &src)) return "InplaceCopy of an unsupported source";
        after = src;
      } else if (op == "InplaceMuls") {
        double s;
        if (n != 4 || !ScalarValue(node->input(2), &s)) return "InplaceMuls by a non-constant";
        after = Scale(before, s);
      } else if (op == "InplaceAddExt" || op == "InplaceSubExt") {
        Lin x;
        double alpha;
        if (n != 5 || !operand(node->input(2), &x) || !ScalarValue(node->input(3), &alpha)) {
          return op + " with an unsupported operand or a non-constant alpha";
        }
        after = Add(before, x, op == "InplaceAddExt" ? alpha : -alpha);
      } else {
        return op + " on the buffer is not part of mint.optim.SGD's update";
      }
      effects_[node.get()] = after;
      out->inplace_ops++;
      return "";
    }
    if (op == "UpdateState") {
      Lin s;
      if (!monad_state(node->input(1), &s)) return "UpdateState off the branch's monad chain";
      int writes = 0;
      for (size_t i = 2; i < n; ++i) {
        auto it = effects_.find(node->input(i).get());
        if (it != effects_.end()) {
          s = it->second;
          writes++;
        }
      }
      if (writes > 1) return "two buffer writes attached to one UpdateState";
      chained_writes_ += writes;
      state_[node.get()] = s;
      return "";
    }
    if (op == "Load") {
      if (node->input(1) != buf_) return "Load of something other than the momentum buffer";
      Lin s;
      if (!monad_state(node->input(2), &s)) return "Load off the branch's monad chain";
      values_[node.get()] = s;
      return "";
    }
    if (op == "Depend" || op == "Return") return "";  // handled by Run
    // Pure arithmetic over linear forms. A raw Ref operand (no Load) has no defined read point: refuse.
    if (op == "AddExt" || op == "SubExt") {
      Lin x, y;
      double alpha;
      if (n != 4 || !Value(node->input(1), &x) || !Value(node->input(2), &y) || !ScalarValue(node->input(3), &alpha)) {
        return op + " over unsupported operands";
      }
      values_[node.get()] = Add(x, y, op == "AddExt" ? alpha : -alpha);
      return "";
    }
    if (op == "Muls") {
      Lin x;
      double s;
      if (n != 3 || !Value(node->input(1), &x) || !ScalarValue(node->input(2), &s)) return "Muls over unsupported operands";
      values_[node.get()] = Scale(x, s);
      return "";
    }
    if (op == "Neg") {
      Lin x;
      if (n != 2 || !Value(node->input(1), &x)) return "Neg over an unsupported operand";
      values_[node.get()] = Scale(x, -1.0);
      return "";
    }
    return "op " + (op.empty() ? std::string("call") : op) + " in a branch is not part of mint.optim.SGD's update";
  }

  AnfNodePtr buf_;
  AnfNodePtr grad_;
  std::map<const mindspore::AnfNode *, Lin> state_;    // buffer value after each monad
  std::map<const mindspore::AnfNode *, Lin> effects_;  // buffer value written by each in-place op
  std::map<const mindspore::AnfNode *, Lin> values_;   // pure values
  int chained_writes_ = 0;
};

// A graph without calls, closures or nested control flow.
bool IsStraightLine(const FuncGraphPtr &fg) {
  if (fg->get_return() == nullptr) return false;
  for (auto &node : mindspore::TopoSort(fg->get_return())) {
    auto c = AsCNode(node);
    if (c == nullptr) continue;
    for (size_t i = 0; i < c->size(); ++i) {
      if (mindspore::GetValueNode<FuncGraphPtr>(c->input(i)) != nullptr) return false;  // calls or closures
      if (i == 0 && c->input(0)->isa<CNode>()) return false;  // a call of a computed function
    }
  }
  return true;
}

// ---------------------------------------------------------------------------------------------------------
// Where graphs are entered, and what a graph parameter stands for in its callers.

// A graph is entered by a direct call `fg(args)` (arguments from input 1) or through `Partial(fg, args)`
// (arguments from input 2: mint's two branches, the bodies of a user's `if`, the code after an `if`).
struct Site {
  CNodePtr node;
  size_t offset;
};

struct Bindings {
  std::map<const mindspore::FuncGraph *, std::vector<Site>> sites;
  std::set<const mindspore::FuncGraph *> escaped;  // also used as a plain value: its callers are unknown
};

// A chain of sites from a graph nobody enters (the compiled top graph) down to one graph, outermost first.
// MindSpore shares mint's per-parameter update graph between same-shaped parameters, and with several
// parameter groups reaches it through each group's hyper_map graph: top -> hyper_map_k -> update graph.
using Path = std::vector<Site>;

// One level of what a node stands for: `node` is a parameter of `graph`, and `user` -- a site of `graph`, one
// level up -- passes its argument at input `index` (the next link's node). The last link has no user.
struct Link {
  AnfNodePtr node;
  FuncGraphPtr graph;
  CNodePtr user;
  int index;
};

int ParamIndex(const FuncGraphPtr &fg, const AnfNodePtr &node) {
  auto &params = fg->parameters();
  for (size_t i = 0; i < params.size(); ++i) {
    if (params[i] == node) return static_cast<int>(i);
  }
  return -1;
}

// Value-preserving wrappers MindSpore may put around a loaded value (a TensorMove copy, a Depend).
AnfNodePtr Unwrap(AnfNodePtr value) {
  while ((IsPrim(value, "TensorMove") || IsPrim(value, "Depend")) && value->cast<CNodePtr>()->size() >= 2) {
    value = value->cast<CNodePtr>()->input(1);
  }
  return value;
}

// What `node` of graph `fg` is along `path`: while it is a parameter of the graph it sits in, the argument
// the site passes for it, one level up.
std::vector<Link> Chain(FuncGraphPtr g, AnfNodePtr node, const Path &path, bool unwrap) {
  std::vector<Link> out;
  for (auto it = path.rbegin(); it != path.rend(); ++it) {
    if (unwrap) node = Unwrap(node);
    const int i = ParamIndex(g, node);
    const size_t at = it->offset + static_cast<size_t>(i);
    if (i < 0 || at >= it->node->size()) break;
    out.push_back({node, g, it->node, static_cast<int>(at)});
    node = it->node->input(at);
    g = it->node->func_graph();
  }
  if (unwrap) node = Unwrap(node);
  out.push_back({node, g, nullptr, -1});
  return out;
}

AnfNodePtr Resolve(const FuncGraphPtr &fg, const AnfNodePtr &node, const Path &path) {
  return Chain(fg, node, path, false).back().node;
}

// ---------------------------------------------------------------------------------------------------------
// Matching one Switch call.

struct Plan {
  FuncGraphPtr graph;
  CNodePtr call;                  // Switch(...)()
  CNodePtr update;                // InplaceAddExt(w, ...)
  CNodePtr outer_nesterov;        // AddExt(g, call, m) between call and update, or null
  AnfNodePtr weight, buf, grad, cond, step;
  double lr = 0, momentum = 0, dampening = 0, weight_decay = 0;
  AnfNodePtr lr_tensor;            // a learning rate read at run time (a one-element tensor), else null
  std::vector<std::string> lr_names;  // per use: what lr_tensor stands for
  bool nesterov = false, maximize = false;
  TypeId dtype = mindspore::kTypeUnknown;
  ShapeVector shape;
  int matched_nodes = 0;
  // What the update is applied to: (parameter, gradient, buffer) names, once per parameter. One entry in the
  // top graph; one per parameter when the update sits in a graph MindSpore shares between parameters.
  std::vector<std::vector<std::string>> uses;
  // Why a weight-decay term was left in the gradient (empty: folded, or none).
  std::string decay_kept;
  // Weight decay folded from the callers of a shared graph: (site, input index, AddExt) per site.
  std::vector<std::tuple<CNodePtr, size_t, CNodePtr>> caller_decay;
};

struct Refusal {
  std::string reason, detail;
  std::vector<std::string> candidates;  // the parameters it stands for, once each
};

class Matcher {
 public:
  Matcher(const FuncGraphManagerPtr &manager, const std::string &device, const Bindings &bindings)
      : manager_(manager), device_(device), bindings_(bindings) {}

  // Returns true and fills plan, or false and fills refusal (refusal.reason empty: not a candidate at all).
  bool Match(const FuncGraphPtr &fg, const CNodePtr &call, Plan *plan, Refusal *refusal) {
    auto sw = AsCNode(call->input(0));
    if (sw == nullptr || !IsPrim(sw, "Switch") || call->size() != 1 || sw->size() != 4) return false;
    auto pt = AsCNode(sw->input(2)), pf = AsCNode(sw->input(3));
    if (!IsPrim(pt, "Partial") || !IsPrim(pf, "Partial")) return false;
    auto ft = mindspore::GetValueNode<FuncGraphPtr>(pt->input(1));
    auto ff = mindspore::GetValueNode<FuncGraphPtr>(pf->input(1));
    if (ft == nullptr || ff == nullptr) return false;
    // Optimizer-like candidates only: straight-line branches that write one argument in place. A user's
    // `if flag: opt(grads)` has branches that call graphs and write many arguments: the updates inside are
    // candidates of their own, the `if` is not.
    if (!IsStraightLine(ft) || !IsStraightLine(ff)) return false;
    const int written = WrittenArgument(ft, ff);
    if (written < 0) return false;

    std::vector<Path> paths;
    const bool paths_known = Paths(fg, &paths);
    refusal->candidates = CandidateNames(fg, call, pt, written, paths_known ? paths : std::vector<Path>(1));
    auto refuse = [&](const std::string &reason, const std::string &detail) {
      refusal->reason = reason;
      refusal->detail = detail;
      return false;
    };
    if (pt->size() != pf->size()) return refuse("branch-arguments", "the two branches take different arguments");
    for (size_t i = 2; i < pt->size(); ++i) {
      if (pt->input(i) != pf->input(i)) return refuse("branch-arguments", "the two branches take different arguments");
    }
    // Arguments: the momentum buffer (a weight Parameter), the gradient (a tensor), the monad.
    AnfNodePtr buf, grad, monad;
    int buf_index = -1, grad_index = -1, monad_index = -1;
    for (size_t i = 2; i < pt->size(); ++i) {
      auto a = pt->input(i);
      if (IsUMonad(a)) {
        monad = a;
        monad_index = static_cast<int>(i) - 2;
      } else if (static_cast<int>(i) - 2 == written && IsRefParam(a)) {
        buf = a;
        buf_index = static_cast<int>(i) - 2;
      } else if (grad == nullptr) {
        grad = a;
        grad_index = static_cast<int>(i) - 2;
      } else {
        return refuse("branch-arguments", "the branches capture more than a buffer, a gradient and a monad");
      }
    }
    if (buf == nullptr || grad == nullptr || monad == nullptr) {
      return refuse("branch-arguments", "the branches do not take a buffer Parameter, a gradient and a monad");
    }
    if (!paths_known) {
      return refuse("condition", "the update sits in a graph MindSpore also passes around as a value; its callers, "
                                 "and so its step counter and parameters, cannot be followed");
    }

    // The condition: step_t == 0, over a step counter Parameter loaded here or in a caller on every path.
    auto cond = AsCNode(sw->input(1));
    double zero = -1;
    AnfNodePtr step;
    if (cond != nullptr && (IsPrim(cond, "EqScalar") || IsPrim(cond, "Equal")) && cond->size() == 3 &&
        ScalarValue(cond->input(2), &zero) && zero == 0.0) {
      step = StepCounter(fg, cond->input(1), paths);
    }
    if (step == nullptr) {
      return refuse("condition", "the branch condition is not `step_t == 0` over a step counter Parameter");
    }

    // Which branch is which is decided by the algebra, not by the Switch's operand order alone:
    // the true branch must be the first step (buf = g) and the false one the momentum step.
    BranchEffect first, later;
    std::string err = Evaluate(ft, buf_index, grad_index, monad_index, &first);
    if (!err.empty()) return refuse("branch-form", "first-step branch: " + err);
    err = Evaluate(ff, buf_index, grad_index, monad_index, &later);
    if (!err.empty()) return refuse("branch-form", "momentum branch: " + err);
    if (!Same(first.buf, Lin{0.0, 1.0})) {
      return refuse("first-step", "the step_t == 0 branch does not set buf = grad (found buf = " + Form(first.buf) + ")");
    }
    const double m = later.buf.b;
    const double one_minus_d = later.buf.g;
    if (!(m > 0.0)) {
      return refuse("momentum", "momentum " + Num(m) + " is not > 0; the contract's momentum path needs m > 0");
    }
    bool nesterov;
    if (Same(first.ret, first.buf) && Same(later.ret, later.buf)) {
      nesterov = false;
    } else if (Same(first.ret, Add(Lin{0.0, 1.0}, first.buf, m)) && Same(later.ret, Add(Lin{0.0, 1.0}, later.buf, m))) {
      nesterov = true;
    } else {
      return refuse("update-form", "the branches return " + Form(first.ret) + " / " + Form(later.ret) +
                                       ", neither the new buffer nor grad + m*buffer (Nesterov)");
    }

    // Users of the call: UpdateStates (ordering only) and the one value path to the parameter update.
    CNodePtr update, outer_nesterov;
    auto &users = manager_->node_users();
    for (auto &use : users[call]) {
      auto user = AsCNode(use.first);
      if (IsPrim(user, "UpdateState")) continue;
      if (IsPrim(user, "InplaceAddExt") && use.second == 2 && update == nullptr) {
        update = user;
      } else if (IsPrim(user, "AddExt") && use.second == 2 && outer_nesterov == nullptr && !nesterov) {
        outer_nesterov = user;
      } else {
        return refuse("extra-consumer", "the updated buffer is also read by " + NodeName(user));
      }
    }
    if (outer_nesterov != nullptr) {
      double m2;
      if (update != nullptr || outer_nesterov->input(1) != grad || !ScalarValue(outer_nesterov->input(3), &m2) ||
          !Close(m2, m)) {
        return refuse("update-form", "the buffer feeds an AddExt that is not grad + m*buffer");
      }
      for (auto &use : users[outer_nesterov]) {
        auto user = AsCNode(use.first);
        if (IsPrim(user, "InplaceAddExt") && use.second == 2 && update == nullptr) {
          update = user;
        } else {
          return refuse("extra-consumer", "the Nesterov step is also read by " + NodeName(user));
        }
      }
      nesterov = true;
    }
    if (update == nullptr) return refuse("no-parameter-update", "no InplaceAddExt(w, buffer, -lr) consumes the buffer");
    double alpha = 0.0;
    AnfNodePtr lr_tensor;
    if (update->size() != 5) return refuse("no-parameter-update", "the parameter update has an unexpected form");
    if (!ScalarValue(update->input(3), &alpha)) {
      // A learning rate held in a Parameter (the way to change it between compiled steps): the op takes the
      // learning rate as a tensor input, so feed it that tensor.
      std::string why;
      lr_tensor = RuntimeLearningRate(update->input(3), update->input(1), &why);
      if (lr_tensor == nullptr) return refuse("learning-rate", why);
    }
    auto weight = update->input(1);
    if (!IsRefParam(weight) || weight == buf) {
      return refuse("no-parameter-update", "the updated tensor is not a Parameter distinct from the buffer");
    }
    for (auto &use : users[update]) {
      if (!IsPrim(use.first, "UpdateState")) {
        return refuse("extra-consumer", "the updated parameter's value is read by " + NodeName(use.first));
      }
    }
    // The buffer: read and written by the two branches only (followed to the real Parameter).
    const std::set<std::pair<const mindspore::AnfNode *, int>> branch_uses{{pt.get(), buf_index + 2}, {pf.get(), buf_index + 2}};
    if (!OnlyOurWrites(fg, buf, branch_uses, paths)) {
      return refuse("other-writes", "the momentum buffer is written by another op of the step");
    }

    // Weight decay: a term grad + c*w read before the update is folded into the op's attribute only when
    // nothing but this update can write w (on any path to the real Parameter): the op reads w when it runs,
    // the term read it earlier. Otherwise the term stays part of the gradient, as computed.
    AnfNodePtr gradient = grad;
    double wd = 0.0;
    const bool only_ours = OnlyOurWrites(fg, weight, {{update.get(), 1}}, paths);
    if (IsPrim(grad, "AddExt")) {
      auto add = grad->cast<CNodePtr>();
      double c;
      auto load = AsCNode(add->input(2));
      if (add->size() == 4 && ScalarValue(add->input(3), &c) && c > 0.0 && IsPrim(load, "Load") &&
          load->input(1) == weight && OnlyReadByMatch(grad, pt, pf, outer_nesterov)) {
        if (only_ours) {
          gradient = add->input(1);
          wd = c;
        } else {
          plan->decay_kept = "kept in the gradient: the parameter is also written by another op";
        }
      }
    } else if (ParamIndex(fg, grad) >= 0) {
      // In a shared update graph the weight decay is computed by the callers: fold it when every path
      // passes AddExt(g_i, Load(w_i), wd) for its own w_i, with one wd, read by nothing but that site.
      std::vector<std::tuple<CNodePtr, size_t, CNodePtr>> sites;
      const double c = CallerDecay(fg, weight, grad, paths, &sites);
      if (c > 0.0 && only_ours) {
        wd = c;
        plan->caller_decay = sites;
      } else if (c > 0.0) {
        plan->decay_kept = "kept in the gradient: the parameter is also written by another op";
      }
    }

    TypeId dtype, gdtype, bdtype;
    ShapeVector shape, gshape, bshape;
    if (!TensorInfo(weight, &dtype, &shape) || !TensorInfo(gradient, &gdtype, &gshape) || !TensorInfo(buf, &bdtype, &bshape)) {
      return refuse("shape", "the parameter, gradient or buffer has no static tensor shape");
    }
    if (gdtype != dtype || bdtype != dtype || gshape != shape || bshape != shape) {
      return refuse("shape", "parameter, gradient and buffer differ in dtype or shape");
    }
    bool dtype_ok = dtype == mindspore::kNumberTypeFloat32 || dtype == mindspore::kNumberTypeFloat16 ||
                    (dtype == mindspore::kNumberTypeBFloat16 && device_ != "CPU");
    if (!dtype_ok) {
      return refuse("dtype", DtypeName(dtype) + " is not supported by the SGD kernel on " + device_ +
                                 " (contract: FLOAT, FLOAT16, BFLOAT16; MindSpore's CPU kernel: FLOAT, FLOAT16)");
    }
    if (shape.empty() || shape.size() > 8) return refuse("shape", "the contract needs rank 1..8");
    for (auto d : shape) {
      if (d <= 0) return refuse("shape", "the contract does not support empty tensors");
    }
    const double d = 1.0 - one_minus_d;
    if (nesterov && !Close(d, 0.0)) {
      return refuse("nesterov-dampening", "Nesterov with dampening " + Num(d) + " (contract: dampening must be 0)");
    }

    plan->graph = fg;
    plan->call = call;
    plan->update = update;
    plan->outer_nesterov = outer_nesterov;
    plan->weight = weight;
    plan->buf = buf;
    plan->grad = gradient;
    plan->cond = cond;
    plan->step = step;
    plan->lr = -alpha;
    plan->lr_tensor = lr_tensor;
    if (lr_tensor != nullptr) {
      auto lr_ref = IsPrim(lr_tensor, "Load") ? lr_tensor->cast<CNodePtr>()->input(1) : lr_tensor;
      std::set<std::string> seen;
      for (auto &path : paths) {
        auto name = NodeName(Resolve(fg, lr_ref, path));
        if (seen.insert(name).second) plan->lr_names.push_back(name);
      }
    }
    plan->momentum = m;
    plan->dampening = d;
    plan->weight_decay = wd;
    plan->nesterov = nesterov;
    plan->maximize = IsPrim(gradient, "Neg");
    plan->dtype = dtype;
    plan->shape = shape;
    plan->matched_nodes = first.nodes + later.nodes + 5 + (outer_nesterov ? 1 : 0) + (wd > 0 ? 1 : 0);
    plan->uses = Uses(fg, {weight, gradient, buf}, paths, plan->caller_decay);
    return true;
  }

  // The learning rate behind an alpha read at run time: alpha = TensorToScalar([Cast to FLOAT64](Neg(t))),
  // as mint builds -lr from a group's lr held in a one-element tensor t of the weight's dtype. Returns t,
  // or null with `why` set.
  static AnfNodePtr RuntimeLearningRate(const AnfNodePtr &alpha, const AnfNodePtr &weight, std::string *why) {
    *why = "the parameter update's alpha (-lr) is neither a compile-time constant nor -t for a one-element tensor t";
    auto scalar = AsCNode(alpha);
    if (!IsPrim(scalar, "TensorToScalar") || scalar->size() != 2) return nullptr;
    AnfNodePtr t = scalar->input(1);
    // Widening casts only (FLOAT/FLOAT16 to FLOAT64): exact, so the op may read the tensor before them.
    while (IsPrim(t, "Cast")) {
      TypeId from, to;
      ShapeVector s1, s2;
      auto cast = t->cast<CNodePtr>();
      if (!TensorInfo(cast->input(1), &from, &s1) || !TensorInfo(cast, &to, &s2) || to != mindspore::kNumberTypeFloat64 ||
          (from != mindspore::kNumberTypeFloat32 && from != mindspore::kNumberTypeFloat16 && from != mindspore::kNumberTypeFloat64)) {
        return nullptr;
      }
      t = cast->input(1);
    }
    if (!IsPrim(t, "Neg") || t->cast<CNodePtr>()->size() != 2) return nullptr;
    auto lr = t->cast<CNodePtr>()->input(1);
    TypeId lr_dtype, w_dtype;
    ShapeVector lr_shape, w_shape;
    if (!TensorInfo(lr, &lr_dtype, &lr_shape) || !TensorInfo(weight, &w_dtype, &w_shape)) return nullptr;
    int64_t elements = 1;
    for (auto d : lr_shape) elements *= d;
    if (elements != 1) {
      *why = "the learning rate tensor has " + std::to_string(elements) + " elements (the op takes exactly one)";
      return nullptr;
    }
    if (lr_dtype != w_dtype) {
      *why = "the learning rate tensor is " + DtypeName(lr_dtype) + ", the parameter " + DtypeName(w_dtype) +
             " (the op takes both in one dtype)";
      return nullptr;
    }
    return lr;
  }

  // A parameter update without a momentum buffer, w += alpha*x (mint with momentum 0): left alone, and listed.
  bool PlainUpdate(const FuncGraphPtr &fg, const CNodePtr &node, Refusal *refusal) {
    double alpha;
    if (!IsPrim(node, "InplaceAddExt") || node->size() != 5 || !IsRefParam(node->input(1)) ||
        !ScalarValue(node->input(3), &alpha) || !(alpha < 0.0)) {
      return false;
    }
    TypeId dtype;
    ShapeVector shape;
    if (!TensorInfo(node->input(1), &dtype, &shape) ||
        (dtype != mindspore::kNumberTypeFloat32 && dtype != mindspore::kNumberTypeFloat16 &&
         dtype != mindspore::kNumberTypeBFloat16)) {
      return false;
    }
    // A momentum update's value is the branch call (or grad + m*call): that is a candidate of its own.
    auto value = AsCNode(node->input(2));
    if (IsPrim(value, "AddExt")) value = AsCNode(value->input(2));
    if (value != nullptr && value->size() >= 1 && IsPrim(value->input(0), "Switch")) return false;
    std::vector<Path> paths;
    if (!Paths(fg, &paths)) paths = std::vector<Path>(1);
    std::set<std::string> seen;
    for (auto &path : paths) {
      auto name = NodeName(Resolve(fg, node->input(1), path));
      if (seen.insert(name).second) refusal->candidates.push_back(name);
    }
    refusal->reason = "momentum";
    refusal->detail = "momentum 0: w <- w - " + Num(-alpha) + "*grad has no momentum buffer for the SGD op to keep";
    return true;
  }

 private:
  static std::string Form(const Lin &x) { return Num(x.b) + "*buf + " + Num(x.g) + "*grad"; }

  // Every chain of sites through which `fg` is entered from the top graph (one empty path for the top graph
  // itself). False when a graph on the way is also used as a plain value, so that its callers are unknown.
  bool Paths(const FuncGraphPtr &fg, std::vector<Path> *out, int depth = 0) {
    if (depth > 16 || out->size() > 4096 || bindings_.escaped.count(fg.get()) > 0) return false;
    auto it = bindings_.sites.find(fg.get());
    if (it == bindings_.sites.end() || it->second.empty()) {
      out->push_back({});
      return true;
    }
    for (auto &site : it->second) {
      auto caller = site.node->func_graph();
      std::vector<Path> up;
      if (caller == nullptr || caller == fg || !Paths(caller, &up, depth + 1)) return false;
      for (auto &p : up) {
        p.push_back(site);
        out->push_back(p);
      }
      if (out->size() > 4096) return false;
    }
    return true;
  }

  // The parameters a candidate stands for, for its refusal record: the tensor the buffer's value updates in
  // place (InplaceAddExt(w, call) or its Nesterov form), else the buffer, resolved to the real Parameters.
  std::vector<std::string> CandidateNames(const FuncGraphPtr &fg, const CNodePtr &call, const CNodePtr &partial,
                                          int written, const std::vector<Path> &paths) {
    AnfNodePtr named;
    auto &users = manager_->node_users();
    for (auto &use : users[call]) {
      auto user = AsCNode(use.first);
      if (IsPrim(user, "InplaceAddExt") && use.second == 2) named = user->input(1);
      if (IsPrim(user, "AddExt") && named == nullptr) {
        for (auto &next : users[user]) {
          if (IsPrim(next.first, "InplaceAddExt") && next.second == 2) named = next.first->cast<CNodePtr>()->input(1);
        }
      }
    }
    if (named == nullptr && static_cast<size_t>(written) + 2 < partial->size()) named = partial->input(written + 2);
    std::vector<std::string> names;
    std::set<std::string> seen;
    for (auto &path : paths) {
      auto name = named == nullptr ? NodeName(call) : NodeName(Resolve(fg, named, path));
      if (seen.insert(name).second) names.push_back(name);
    }
    return names;
  }

  // The weight decay every path into shared graph `fg` applies to the gradient argument, or 0 when they do
  // not all pass AddExt(g, Load(w), wd) with w what that path passes for the weight, and one wd. Every
  // graph parameter between the AddExt and `fg` must be read by nothing but the next call down.
  double CallerDecay(const FuncGraphPtr &fg, const AnfNodePtr &weight, const AnfNodePtr &grad,
                     const std::vector<Path> &paths, std::vector<std::tuple<CNodePtr, size_t, CNodePtr>> *sites) {
    double wd = -1.0;
    std::vector<std::tuple<CNodePtr, size_t, CNodePtr>> found;
    std::set<std::pair<const mindspore::AnfNode *, int>> passed;
    std::set<CNodePtr> adds;
    for (auto &path : paths) {
      if (path.empty()) return 0.0;
      auto chain = Chain(fg, grad, path, false);
      if (chain.size() < 2) return 0.0;
      auto add = AsCNode(chain.back().node);
      double c;
      if (!IsPrim(add, "AddExt") || add->size() != 4 || !ScalarValue(add->input(3), &c) || !(c > 0.0)) return 0.0;
      auto load = AsCNode(add->input(2));
      if (!IsPrim(load, "Load")) return 0.0;
      // The term must read the weight this path updates, resolved from the AddExt's level.
      auto weight_chain = Chain(fg, weight, path, false);
      if (weight_chain.size() < chain.size() || weight_chain[chain.size() - 1].node != load->input(1)) return 0.0;
      if (wd >= 0.0 && c != wd) return 0.0;
      wd = c;
      // chain[k + 1].node is what chain[k].user passes at chain[k].index for chain[k].node.
      for (size_t k = 0; k + 1 < chain.size(); ++k) {
        passed.insert({chain[k].user.get(), chain[k].index});
        if (k > 0) {
          const auto &down = chain[k - 1];
          for (auto &use : manager_->node_users()[chain[k].node]) {
            if (!(use.first == down.user && use.second == down.index) && !IsPrim(use.first, "UpdateState")) return 0.0;
          }
        }
      }
      const auto &outer = chain[chain.size() - 2];
      adds.insert(add);
      found.emplace_back(outer.user, static_cast<size_t>(outer.index), add);
    }
    for (auto &add : adds) {
      for (auto &use : manager_->node_users()[add]) {
        if (!passed.count({use.first.get(), use.second}) && !IsPrim(use.first, "UpdateState")) return 0.0;
      }
    }
    // One edit per site (several paths can share the outermost site).
    std::set<std::pair<const mindspore::AnfNode *, size_t>> unique;
    sites->clear();
    for (auto &f : found) {
      if (unique.insert({std::get<0>(f).get(), std::get<1>(f)}).second) sites->push_back(f);
    }
    return wd;
  }

  // Names of (parameter, gradient, buffer) along every path, once per parameter.
  std::vector<std::vector<std::string>> Uses(const FuncGraphPtr &fg, const std::vector<AnfNodePtr> &nodes,
                                             const std::vector<Path> &paths,
                                             const std::vector<std::tuple<CNodePtr, size_t, CNodePtr>> &decay) {
    std::set<const mindspore::AnfNode *> folded;
    for (auto &site : decay) folded.insert(std::get<2>(site).get());
    std::vector<std::vector<std::string>> uses;
    std::set<std::string> seen;
    for (auto &path : paths) {
      std::vector<std::string> names;
      for (auto &n : nodes) {
        auto r = Resolve(fg, n, path);
        // The callers of a shared graph now pass their raw gradients: name those.
        if (folded.count(r.get()) > 0) r = r->cast<CNodePtr>()->input(1);
        names.push_back(NodeName(r));
      }
      if (seen.insert(names[0]).second) uses.push_back(names);
    }
    return uses;
  }

  // The index of the branch parameter both branches write in place (the momentum buffer), or -1.
  static int WrittenArgument(const FuncGraphPtr &ft, const FuncGraphPtr &ff) {
    int found = -1;
    for (auto &fg : {ft, ff}) {
      if (fg->get_return() == nullptr) return -1;
      auto &params = fg->parameters();
      for (auto &node : mindspore::TopoSort(fg->get_return())) {
        auto c = AsCNode(node);
        if (c == nullptr || c->size() < 2 || PrimName(c).rfind("Inplace", 0) != 0) continue;
        for (size_t i = 0; i < params.size(); ++i) {
          if (c->input(1) != params[i]) continue;
          if (found != -1 && found != static_cast<int>(i)) return -1;
          found = static_cast<int>(i);
        }
      }
    }
    return found;
  }

  // The step counter Parameter whose Load `value` is on every path (loaded in this graph, or in a caller
  // that passes it down through graph parameters). Null otherwise.
  AnfNodePtr StepCounter(const FuncGraphPtr &fg, const AnfNodePtr &value, const std::vector<Path> &paths) {
    AnfNodePtr step;
    for (auto &path : paths) {
      auto chain = Chain(fg, value, path, true);
      auto load = AsCNode(chain.back().node);
      if (!IsPrim(load, "Load")) return nullptr;
      // The Load sits at level chain.size() - 1; its Ref may again be a parameter passed from further up.
      const size_t level = chain.size() - 1;
      Path rest(path.begin(), path.end() - static_cast<std::ptrdiff_t>(level));
      auto ref = Resolve(chain.back().graph, load->input(1), rest);
      if (AsWeight(ref) == nullptr || (step != nullptr && ref != step)) return nullptr;
      step = ref;
    }
    return step;
  }

  std::string Evaluate(const FuncGraphPtr &fg, int buf_index, int grad_index, int monad_index, BranchEffect *out) {
    auto &params = fg->parameters();
    int need = std::max(buf_index, std::max(grad_index, monad_index)) + 1;
    if (static_cast<int>(params.size()) != need) return "unexpected parameter count";
    BranchEvaluator eval(params[buf_index], params[grad_index], params[monad_index]);
    return eval.Run(fg, out);
  }

  // True when the ops in `ours` (node, input index) are the only ones that can write the tensor `node` (of
  // `fg`) stands for: on every path,
  // each graph parameter and the real Parameter it stands for is only loaded, ordered (UpdateState, the
  // second input of Depend) or passed down to the next graph of the path. Anything else -- Assign,
  // AssignAdd, an in-place op, another optimizer, a call of a graph that might write it -- counts as a write.
  bool OnlyOurWrites(const FuncGraphPtr &fg, const AnfNodePtr &node,
                     const std::set<std::pair<const mindspore::AnfNode *, int>> &ours, const std::vector<Path> &paths) {
    std::set<std::pair<const mindspore::AnfNode *, int>> allowed = ours;
    std::vector<AnfNodePtr> nodes;
    for (auto &path : paths) {
      for (auto &link : Chain(fg, node, path, false)) {
        nodes.push_back(link.node);
        if (link.user != nullptr) allowed.insert({link.user.get(), link.index});
      }
    }
    for (auto &n : nodes) {
      if (!n->isa<Parameter>()) return false;  // a Ref computed by some op: its writers cannot be followed
      for (auto &use : manager_->node_users()[n]) {
        auto user = AsCNode(use.first);
        if (user == nullptr) return false;
        if (allowed.count({user.get(), use.second}) > 0 || IsPrim(user, "UpdateState")) continue;
        if ((IsPrim(user, "Load") && use.second == 1) || (IsPrim(user, "Depend") && use.second == 2)) continue;
        return false;
      }
    }
    return true;
  }

  bool OnlyReadByMatch(const AnfNodePtr &value, const CNodePtr &pt, const CNodePtr &pf, const CNodePtr &outer) {
    for (auto &use : manager_->node_users()[value]) {
      auto user = use.first;
      if (user == pt || user == pf || (outer != nullptr && user == outer) || IsPrim(user, "UpdateState")) continue;
      return false;
    }
    return true;
  }

  FuncGraphManagerPtr manager_;
  std::string device_;
  const Bindings &bindings_;
};

// ---------------------------------------------------------------------------------------------------------
// The rewrite.

mindspore::abstract::AbstractBasePtr TensorAbstract(TypeId dtype, const ShapeVector &shape) {
  return std::make_shared<mindspore::abstract::AbstractTensor>(mindspore::TypeIdToType(dtype), shape);
}

AnfNodePtr ScalarTensorNode(double value, TypeId dtype) {
  float v = static_cast<float>(value);
  auto tensor = mindspore::tensor::from_buffer(dtype, ShapeVector{}, &v, mindspore::kNumberTypeFloat32);
  auto node = mindspore::NewValueNode(tensor);
  node->set_abstract(tensor->ToAbstract());
  return node;
}

AnfNodePtr ImmNode(const ValuePtr &value) {
  auto node = mindspore::NewValueNode(value);
  node->set_abstract(value->ToAbstract());
  return node;
}

AnfNodePtr PrimNode(const char *name, bool side_effect = false) {
  auto prim = std::make_shared<mindspore::Primitive>(name);
  if (side_effect) {
    prim->AddAttr("side_effect_mem", mindspore::MakeValue(true));
    prim->AddAttr(kFusedMark, mindspore::MakeValue(true));
  }
  return mindspore::NewValueNode(prim);
}

TypeId TypeIdOf(const AnfNodePtr &node) {
  TypeId dtype = mindspore::kTypeUnknown;
  ShapeVector shape;
  TensorInfo(node, &dtype, &shape);
  return dtype;
}

// Whether the rewrite zeroes the buffer before the op on the first step (EmitUpdate says why): on every
// device but CPU, whose kernel does it itself. SGDFUSE_MINDSPORE_FIRST_STEP_ZERO=1 zeroes on CPU too (the
// graph the contract needs, e.g. to check it on a CPU install), =0 never.
bool ZeroFirstStep(const std::string &device) {
  const char *knob = std::getenv("SGDFUSE_MINDSPORE_FIRST_STEP_ZERO");
  if (knob != nullptr && std::string(knob) == "1") return true;
  if (knob != nullptr && std::string(knob) == "0") return false;
  return device != "CPU";
}

// The inputs of one fused update (the rewrite emits it, the outlining re-emits it in a subgraph).
struct UpdateInputs {
  AnfNodePtr weight, grad, lr, buf, momentum, stat, mask;
};

// Emits, ordered after `monad`:
//   A  = Assign(buf, MaskedFill(Load(buf, monad), mask, 0), monad)      mask: step_t == 0
//   Ua = UpdateState(monad, A)
//   S  = SGD(w, g, lr, buf, m, stat, Ua)
// and returns S (the caller chains UpdateState(Ua, S) after it).
//
// Why the buffer is zeroed on the first step: mint's first step sets buf = grad whatever buf holds, and so
// does MindSpore's CPU SGD kernel where stat > 0; the contract computes accum*m + grad with stat = 1. They
// agree only while the buffer is zero at step_t == 0, which a schedule that resets step_t, or a checkpoint
// that restores the buffers but not step_t, breaks. MaskedFill, not a multiplication by 1 - stat: a
// non-finite buffer times 0 is NaN, and mint overwrites it.
//
// MindSpore's CPU SGD kernel already sets accum = grad where stat > 0, so on CPU (in.mask null, see
// ZeroFirstStep) the update is S = SGD(w, g, lr, buf, m, stat, monad) alone: the three extra kernels per
// parameter and step would cost ~30 ms of a 65 ms update (100 parameters, 3.3M elements) for nothing.
//
// Node names (kept in MindSpore's kernel names and data dumps): sgdfuse/SGD/<w>, sgdfuse/first_step_zero/<w>.
CNodePtr EmitUpdate(const FuncGraphPtr &fg, const UpdateInputs &in, const AnfNodePtr &sgd_prim,
                    const mindspore::abstract::AbstractBasePtr &tensor, TypeId dtype, const AnfNodePtr &monad,
                    const std::string &name) {
  if (in.mask == nullptr) {
    auto sgd = fg->NewCNode({sgd_prim, in.weight, in.grad, in.lr, in.buf, in.momentum, in.stat, monad});
    sgd->set_abstract(tensor->Clone());
    sgd->set_fullname_with_scope("sgdfuse/SGD/" + name);
    return sgd;
  }
  auto load = fg->NewCNode({PrimNode("Load"), in.buf, monad});
  load->set_abstract(tensor->Clone());
  auto zero = ScalarTensorNode(0.0, dtype);
  auto fill = fg->NewCNode({PrimNode("MaskedFill"), load, in.mask, zero});
  fill->set_abstract(tensor->Clone());
  auto assign = fg->NewCNode({PrimNode("Assign", true), in.buf, fill, monad});
  assign->set_abstract(in.buf->abstract());
  fill->set_fullname_with_scope("sgdfuse/first_step_zero/" + name);
  assign->set_fullname_with_scope("sgdfuse/first_step_zero/" + name);
  auto ua = fg->NewCNode({PrimNode("UpdateState"), monad, assign});
  ua->set_abstract(monad->abstract());
  auto sgd = fg->NewCNode({sgd_prim, in.weight, in.grad, in.lr, in.buf, in.momentum, in.stat, ua});
  sgd->set_abstract(tensor->Clone());
  sgd->set_fullname_with_scope("sgdfuse/SGD/" + name);
  return sgd;
}

class Rewriter {
 public:
  Rewriter(const FuncGraphManagerPtr &manager, bool zero_first_step) : manager_(manager), zero_(zero_first_step) {}

  void Apply(const Plan &p) {
    auto fg = p.graph;
    // stat = BroadcastTo(Cast(step_t == 0, dtype), shape); the Cast is shared per condition and dtype.
    auto key = std::make_pair(p.cond.get(), static_cast<int>(p.dtype));
    AnfNodePtr stat_scalar = casts_[key];
    if (stat_scalar == nullptr) {
      auto cast = fg->NewCNode({mindspore::NewValueNode(std::make_shared<mindspore::Primitive>("Cast")), p.cond,
                                ImmNode(mindspore::MakeValue(static_cast<int64_t>(p.dtype)))});
      cast->set_abstract(TensorAbstract(p.dtype, ShapeVector{}));
      stat_scalar = cast;
      casts_[key] = cast;
    }
    std::vector<ValuePtr> dims;
    for (auto d : p.shape) dims.push_back(mindspore::MakeValue(static_cast<int64_t>(d)));
    auto stat = fg->NewCNode({mindspore::NewValueNode(std::make_shared<mindspore::Primitive>("BroadcastTo")), stat_scalar,
                              ImmNode(std::make_shared<mindspore::ValueTuple>(dims))});
    stat->set_abstract(TensorAbstract(p.dtype, p.shape));
    stat->set_fullname_with_scope("sgdfuse/stat/" + p.weight->cast<ParameterPtr>()->name());

    // Detach the call from every UpdateState that carried it (the buffer write now happens in SGD, which
    // takes the parameter update's place in the chain).
    DetachFromUpdateStates(p.call);

    auto prim = std::make_shared<mindspore::Primitive>("SGD");
    prim->AddAttr("dampening", mindspore::MakeValue(static_cast<float>(p.dampening)));
    prim->AddAttr("weight_decay", mindspore::MakeValue(static_cast<float>(p.weight_decay)));
    prim->AddAttr("nesterov", mindspore::MakeValue(p.nesterov));
    prim->AddAttr("side_effect_mem", mindspore::MakeValue(true));
    prim->AddAttr(kFusedMark, mindspore::MakeValue(true));  // survives inlining, unlike node names
    prim->AddAttr("input_names", mindspore::MakeValue(std::vector<std::string>{
                                     "parameters", "gradient", "learning_rate", "accum", "momentum", "stat"}));
    prim->AddAttr("output_names", mindspore::MakeValue(std::vector<std::string>{"output"}));
    // mask = Cast(step_t == 0, bool): which steps zero the buffer first (see EmitUpdate).
    AnfNodePtr mask = zero_ ? masks_[p.cond.get()] : nullptr;
    if (zero_ && mask == nullptr) {
      auto cast = fg->NewCNode({mindspore::NewValueNode(std::make_shared<mindspore::Primitive>("Cast")), p.cond,
                                ImmNode(mindspore::MakeValue(static_cast<int64_t>(mindspore::kNumberTypeBool)))});
      cast->set_abstract(TensorAbstract(mindspore::kNumberTypeBool, ShapeVector{}));
      mask = cast;
      masks_[p.cond.get()] = cast;
    }
    auto monad = p.update->input(4);  // the parameter update's monad, already detached from the call
    AnfNodePtr lr = p.lr_tensor != nullptr ? p.lr_tensor : ScalarTensorNode(p.lr, p.dtype);
    if (IsPrim(lr, "Load")) {  // read the learning rate where the update starts (so the update can move as one)
      auto load = fg->NewCNode({PrimNode("Load"), lr->cast<CNodePtr>()->input(1), monad});
      load->set_abstract(lr->abstract());
      lr = load;
    }
    UpdateInputs in{p.weight, p.grad, lr, p.buf, ScalarTensorNode(p.momentum, p.dtype), stat, mask};
    auto sgd = EmitUpdate(fg, in, mindspore::NewValueNode(prim), TensorAbstract(p.dtype, p.shape), p.dtype, monad,
                          p.weight->cast<ParameterPtr>()->name());
    manager_->Replace(p.update, sgd);
    // The UpdateState that carried the parameter update now follows the zeroing too: UpdateState(Ua, S).
    auto users = manager_->node_users()[sgd];  // copy: edited below
    for (auto &use : users) {
      auto us = AsCNode(use.first);
      if (IsPrim(us, "UpdateState") && us->size() == 3 && use.second == 2 && us->input(1) == monad) {
        manager_->SetEdge(us, 1, sgd->input(7));
      }
    }
    // The learning rate's own read (mint's Load for -lr) is now only ordered, not used: drop it from the chain.
    if (IsPrim(p.lr_tensor, "Load")) {
      bool only_ordered = true;
      for (auto &use : manager_->node_users()[p.lr_tensor]) only_ordered = only_ordered && IsPrim(use.first, "UpdateState");
      if (only_ordered) DetachFromUpdateStates(p.lr_tensor);
    }
    // Callers of a shared graph now pass the raw gradient: the SGD op applies the weight decay.
    for (auto &[call, index, add] : p.caller_decay) {
      manager_->SetEdge(call, static_cast<int>(index), add->input(1));
      DetachFromUpdateStates(add);
    }
  }

 private:
  void DetachFromUpdateStates(const AnfNodePtr &value) {
    auto users = manager_->node_users()[value];  // copy: edited below
    for (auto &use : users) {
      auto us = AsCNode(use.first);
      if (!IsPrim(us, "UpdateState")) continue;
      if (us->size() == 3) {
        manager_->Replace(us, us->input(1));
      } else {
        std::vector<AnfNodePtr> inputs;
        for (size_t i = 0; i < us->size(); ++i) {
          if (static_cast<int>(i) != use.second) inputs.push_back(us->input(i));
        }
        auto replacement = us->func_graph()->NewCNode(inputs);
        replacement->set_abstract(us->abstract());
        manager_->Replace(us, replacement);
      }
    }
  }

  FuncGraphManagerPtr manager_;
  std::map<std::pair<const mindspore::AnfNode *, int>, AnfNodePtr> casts_;
  std::map<const mindspore::AnfNode *, AnfNodePtr> masks_;
  bool zero_;
};

// ---------------------------------------------------------------------------------------------------------
// Reporting.

class ReportWriter {
 public:
  ReportWriter() {
    const char *path = std::getenv("SGDFUSE_MINDSPORE_REPORT");
    if (path != nullptr && *path != '\0') out_.open(path, std::ios::app);
  }
  void Fused(const std::string &graph, const Plan &p, const std::string &device, std::set<std::string> *names) {
    std::ostringstream s;
    std::string shape = "[";
    for (size_t i = 0; i < p.shape.size(); ++i) shape += (i ? ", " : "") + std::to_string(p.shape[i]);
    shape += "]";
    const std::string m = Num(p.momentum), d = Num(p.dampening);
    std::string lr = Num(p.lr), lr_json = lr, lr_input = "\"constant\"";
    if (p.lr_tensor != nullptr) {
      std::string names;
      for (size_t i = 0; i < p.lr_names.size(); ++i) names += (i ? " | " : "") + p.lr_names[i];
      lr = names;
      lr_json = Json(names);
      lr_input = Json(names);
    }
    std::string accum_eq = "accum <- " + m + "*accum + " + Num(1.0 - p.dampening) + "*grad (first step: accum <- grad)";
    std::string param_eq = p.nesterov ? "p <- p - " + lr + "*(grad + " + m + "*accum)" : "p <- p - " + lr + "*accum";
    if (p.weight_decay > 0) {
      accum_eq += ", grad = gradient + " + Num(p.weight_decay) + "*p";
    }
    for (auto &use : p.uses) {
    if (!names->insert(use[0]).second) continue;
    s << "{\"event\": \"fused\", \"graph\": " << Json(graph) << ", \"device\": " << Json(device)
      << ", \"shared_graph\": " << (AsWeight(p.weight) == nullptr ? Json(p.graph->ToString()) : std::string("null"))
      << ", \"parameters\": " << Json(use[0]) << ", \"gradient\": " << Json(use[1])
      << ", \"accum\": " << Json(use[2]) << ", \"step\": " << Json(NodeName(p.step))
      << ", \"learning_rate\": " << lr_json << ", \"learning_rate_input\": " << lr_input << ", \"momentum\": " << m << ", \"dampening\": " << d
      << ", \"weight_decay\": " << Num(p.weight_decay) << ", \"nesterov\": " << (p.nesterov ? "true" : "false")
      << ", \"maximize\": " << (p.maximize ? "true" : "false") << ", \"dtype\": " << Json(DtypeName(p.dtype))
      << ", \"shape\": " << shape << ", \"parameter_equation\": " << Json(param_eq)
      << ", \"accum_equation\": " << Json(accum_eq) << ", \"matched_nodes\": " << p.matched_nodes
      << ", \"note\": " << Json(p.decay_kept) << "}\n";
    }
    if (!out_.is_open()) return;
    out_ << s.str();
    out_.flush();
  }
  void Refused(const std::string &graph, const Refusal &r, const std::set<std::string> &fused,
               std::set<std::string> *names) {
    for (auto &name : r.candidates) {
      // A parameter fused elsewhere in this graph (the other copy of the code after an `if`) is fused.
      if (fused.count(name) > 0 || !names->insert(name).second) continue;
      if (!out_.is_open()) continue;
      out_ << "{\"event\": \"refused\", \"graph\": " << Json(graph) << ", \"candidate\": " << Json(name)
           << ", \"reason\": " << Json(r.reason) << ", \"detail\": " << Json(r.detail) << "}\n";
    }
    out_.flush();
  }
  void Summary(const std::string &graph, size_t fused, size_t refused, std::pair<size_t, size_t> before,
               std::pair<size_t, size_t> after, size_t inlined, size_t outlined) {
    if (!out_.is_open()) return;
    out_ << "{\"event\": \"graph\", \"graph\": " << Json(graph) << ", \"fused\": " << fused << ", \"refused\": " << refused
         << ", \"switch_calls_before\": " << before.first << ", \"switch_calls_after\": " << after.first
         << ", \"nodes_before\": " << before.second << ", \"nodes_after\": " << after.second
         << ", \"inlined_calls\": " << inlined << ", \"outlined_update_runs\": " << outlined << "}\n";
    out_.flush();
  }
  void Skipped(const std::string &graph, const std::string &device, const std::string &registered) {
    if (!out_.is_open()) return;
    out_ << "{\"event\": \"skipped\", \"graph\": " << Json(graph) << ", \"device\": " << Json(device)
         << ", \"registered\": " << Json(registered) << "}\n";
    out_.flush();
  }
  void Error(const std::string &graph, const std::string &what) {
    if (!out_.is_open()) return;
    out_ << "{\"event\": \"error\", \"graph\": " << Json(graph) << ", \"detail\": " << Json(what) << "}\n";
    out_.flush();
  }

 private:
  std::ofstream out_;
};

// Switch calls and CNodes over every graph the manager holds (the top graph and its branch graphs).
std::pair<size_t, size_t> CountNodes(const FuncGraphManagerPtr &manager) {
  size_t switches = 0, cnodes = 0;
  for (auto &g : manager->func_graphs()) {
    if (g->get_return() == nullptr) continue;
    for (auto &node : mindspore::TopoSort(g->get_return())) {
      auto c = AsCNode(node);
      if (c == nullptr) continue;
      cnodes++;
      if (IsPrim(c->input(0), "Switch")) switches++;
    }
  }
  return {switches, cnodes};
}

// One fused update as EmitUpdate left it: [Load, MaskedFill, Assign, Ua,] SGD and its carrier
// UpdateState(Ua or start, SGD), with every intermediate node used by nothing but the next (so the unit can
// move as a whole).
struct Unit {
  CNodePtr sgd, carrier;
  CNodePtr ua, assign, fill, load;  // the first-step zeroing, or null
  CNodePtr lr_load;  // Load(lr, start) of a learning rate read at run time, or null
  AnfNodePtr start;  // the monad the unit is ordered after
};

bool FindUnit(const FuncGraphManagerPtr &manager, const CNodePtr &sgd, Unit *unit) {
  if (sgd == nullptr) return false;
  auto &users = manager->node_users();
  auto prim = mindspore::GetCNodePrimitive(sgd);
  if (prim == nullptr || prim->name() != "SGD" || sgd->size() != 8 || !prim->HasAttr(kFusedMark)) return false;
  auto only_user = [&](const AnfNodePtr &n, const AnfNodePtr &user) {
    auto &u = users[n];
    return u.size() == 1 && u.begin()->first == user;
  };
  Unit x;
  x.sgd = sgd;
  x.start = sgd->input(7);
  auto ua = AsCNode(sgd->input(7));
  auto assign = IsPrim(ua, "UpdateState") && ua->size() == 3 ? AsCNode(ua->input(2)) : nullptr;
  auto aprim = mindspore::GetCNodePrimitive(assign);
  if (aprim != nullptr && aprim->name() == "Assign" && aprim->HasAttr(kFusedMark)) {  // the first-step zeroing
    x.ua = ua;
    x.assign = assign;
    if (x.assign->size() != 4) return false;
    x.start = x.ua->input(1);
    x.fill = AsCNode(x.assign->input(2));
    if (!IsPrim(x.fill, "MaskedFill") || x.assign->input(3) != x.start) return false;
    x.load = AsCNode(x.fill->input(1));
    if (!IsPrim(x.load, "Load") || x.load->input(2) != x.start) return false;
    if (!only_user(x.load, x.fill) || !only_user(x.fill, x.assign) || !only_user(x.assign, x.ua)) return false;
    if (users[x.ua].size() != 2) return false;  // the SGD and the carrier
  }
  const AnfNodePtr before_sgd = x.ua != nullptr ? AnfNodePtr(x.ua) : x.start;
  auto &su = users[sgd];
  if (su.size() != 1) return false;
  x.carrier = AsCNode(su.begin()->first);
  if (!IsPrim(x.carrier, "UpdateState") || su.begin()->second != 2 || x.carrier->input(1) != before_sgd) return false;
  auto lr = AsCNode(sgd->input(3));
  if (IsPrim(lr, "Load")) {
    if (lr->input(2) != x.start || !only_user(lr, sgd)) return false;
    x.lr_load = lr;
  }
  *unit = x;
  return true;
}

// The uses of a unit's start monad inside the unit: the SGD (or the zeroing's Load, Assign and Ua) and the
// SGD's carrier when there is no zeroing, plus the learning rate's Load.
size_t StartUses(const Unit &x) { return (x.ua != nullptr ? 3 : 2) + (x.lr_load != nullptr ? 1 : 0); }

// A graph that MindSpore shares between same-shaped parameters stays a called subgraph after the rewrite;
// MindSpore's own inlining ran before this pass, and the backend runs every call of a subgraph through its
// control-flow actors (measured: a 100-parameter update stayed at 77 ms fused against 92 ms unfused, while
// the same SGD ops inline run in 22 ms). Now that the rewrite removed the Switch, the shared graph is
// straight-line code: inline it at every call site, then merge the step_t == 0 conditions and casts the
// inlining duplicated (pure ops on the same inputs).

std::string CseKey(const CNodePtr &c) {
  std::ostringstream key;
  key << PrimName(c);
  for (size_t i = 1; i < c->size(); ++i) {
    auto in = c->input(i);
    if (in->isa<ValueNode>()) {
      key << "|v:" << in->cast<mindspore::ValueNodePtr>()->value()->ToString();
    } else {
      key << "|n:" << in.get();
    }
  }
  return key.str();
}

size_t InlineSharedGraphs(const FuncGraphManagerPtr &manager, const std::vector<Plan> &plans, const CallSites &calls) {
  std::set<FuncGraphPtr> level;
  for (auto &p : plans) {
    if (AsWeight(p.weight) == nullptr) level.insert(p.graph);
  }
  // Innermost first: with parameter groups the shared update graph is called from each group's hyper_map
  // graph, itself called from the top graph; once the update graph is inlined, the hyper_map graph is
  // straight-line too and is inlined in turn.
  size_t inlined = 0;
  std::set<FuncGraphPtr> callers, done;
  for (int depth = 0; depth < 8 && !level.empty(); ++depth) {
    std::set<FuncGraphPtr> next;
    for (auto &fg : level) {
      if (!done.insert(fg).second || !IsStraightLine(fg)) continue;
      auto it = calls.find(fg.get());
      if (it == calls.end()) continue;
      for (auto &call : it->second) {
        auto caller = call->func_graph();
        if (caller == nullptr || caller == fg || level.count(caller) > 0) continue;
        if (call->size() != fg->parameters().size() + 1) continue;
        mindspore::AnfNodePtrList args(call->inputs().begin() + 1, call->inputs().end());
        auto result = mindspore::InlineClone(fg, caller, args, call);
        manager->Replace(call, result);
        callers.insert(caller);
        inlined++;
        if (calls.count(caller.get()) > 0) next.insert(caller);
      }
    }
    level = next;
  }
  // An inlined call leaves U_b = UpdateState(U_a, Depend(true, X)) with X = UpdateState(U_a, SGD) the
  // callee's last monad: U_b orders nothing X does not, so use X itself (one chain SGD -> X -> SGD ...).
  for (auto &caller : callers) {
    for (auto &node : mindspore::TopoSort(caller->get_return())) {
      auto ub = AsCNode(node);
      if (!IsPrim(ub, "UpdateState") || ub->size() != 3 || ub->func_graph() != caller) continue;
      auto dep = AsCNode(ub->input(2));
      if (!IsPrim(dep, "Depend") || dep->size() != 3 || !dep->input(1)->isa<ValueNode>()) continue;
      auto x = AsCNode(dep->input(2));
      if (!IsPrim(x, "UpdateState") || manager->node_users()[dep].size() != 1) continue;
      // X follows U_a directly, or through the callee's one fused update (U_a -> Assign -> Ua -> SGD -> X).
      Unit unit;
      const bool follows = x->input(1) == ub->input(1) ||
                           (x->size() == 3 && FindUnit(manager, AsCNode(x->input(2)), &unit) && unit.carrier == x &&
                            unit.start == ub->input(1));
      if (!follows) continue;
      manager->Replace(ub, x);
    }
  }
  // Merge the duplicated pure condition and cast nodes, first occurrence wins (topological order).
  for (auto &caller : callers) {
    std::map<std::string, AnfNodePtr> seen;
    for (auto &node : mindspore::TopoSort(caller->get_return())) {
      auto c = AsCNode(node);
      if (c == nullptr || c->func_graph() != caller) continue;
      auto name = PrimName(c);
      if (name != "EqScalar" && name != "Cast") continue;
      auto key = CseKey(c);
      auto found = seen.find(key);
      if (found == seen.end()) {
        seen[key] = c;
      } else {
        manager->Replace(c, found->second);
      }
    }
  }
  return inlined;
}

// Move each run of consecutive fused updates of a graph's monad chain into one called subgraph.
//
// Why: MindSpore's CPU runtime runs a kernel graph that writes its own weight Parameters in place far slower
// than one that does not -- measured with one runtime thread, 50 Dense 256x256 layers: forward + backward
// 4.4 ms, + 100 inline SGD updates 136 ms, + the same updates in one no_inline subgraph 19 ms (backward
// MatMuls ran ~9x slower next to the in-place writes). mint's unfused updates sit in control-flow subgraphs
// and so never hit this; fused in place they would make the whole step slower although the update itself
// is faster. So the fused updates become one call:
//
//   before: unit_1(..., U_s) -> U_1; unit_2(..., U_1) -> U_2; ... U_e = UpdateState(Ua_n, SGD_n, x...)
//   after:  c = sgdfuse_updates(w_1, g_1, buf_1, stat_1, mask, ..., U_s)   a no_inline FuncGraph, same chain
//           U_e = UpdateState(U_s, c, x...)
//
// Only runs whose intermediate monads and results are used by nothing but the chain are moved, so the
// side-effect order seen by everything outside the run is unchanged.
size_t OutlineUpdateRuns(const FuncGraphManagerPtr &manager) {
  size_t outlined = 0;
  std::vector<FuncGraphPtr> graphs(manager->func_graphs().begin(), manager->func_graphs().end());
  for (auto &g : graphs) {
    if (g->get_return() == nullptr) continue;
    auto &users = manager->node_users();
    std::set<const mindspore::AnfNode *> used;
    for (auto &node : mindspore::TopoSort(g->get_return())) {
      auto first_sgd = AsCNode(node);
      Unit first;
      if (first_sgd == nullptr || first_sgd->func_graph() != g || used.count(first_sgd.get()) ||
          !FindUnit(manager, first_sgd, &first)) {
        continue;
      }
      // Extend the run: unit_k's carrier U_k is used by exactly the next unit (StartUses).
      std::vector<Unit> run{first};
      while (run.back().carrier->size() == 3) {
        auto end = run.back().carrier;
        auto &u = users[end];
        Unit next;
        bool found = false;
        for (auto &use : u) {
          auto c = AsCNode(use.first);
          if (use.second == 7 && FindUnit(manager, c, &next) && next.start == end) found = true;
          if (found || !IsPrim(c, "UpdateState") || use.second != 1) continue;
          for (auto &use2 : users[c]) {
            auto s = AsCNode(use2.first);
            if (!found && use2.second == 7 && FindUnit(manager, s, &next) && next.start == end) found = true;
          }
        }
        if (!found || u.size() != StartUses(next)) break;
        run.push_back(next);
      }
      if (run.size() < 2) continue;
      for (auto &x : run) used.insert(x.sgd.get());
      const auto end = run.back().carrier;

      auto sub = std::make_shared<mindspore::FuncGraph>();
      sub->set_flag(mindspore::FUNC_GRAPH_FLAG_NO_INLINE, true);
      sub->debug_info()->set_name("sgdfuse_updates");
      std::vector<AnfNodePtr> args{mindspore::NewValueNode(sub)};
      std::map<const mindspore::AnfNode *, AnfNodePtr> params;
      auto param_for = [&](const AnfNodePtr &outer) -> AnfNodePtr {
        if (outer->isa<ValueNode>()) return outer;  // lr, momentum: constants stay constants
        auto found = params.find(outer.get());
        if (found != params.end()) return found->second;
        auto p = sub->add_parameter();
        p->set_abstract(outer->abstract());
        if (outer->isa<Parameter>()) {  // readable IR dumps: the subgraph's parameter carries the weight's name
          p->set_name(outer->cast<ParameterPtr>()->name());
          p->debug_info()->set_name(outer->cast<ParameterPtr>()->name());
        }
        args.push_back(outer);
        params[outer.get()] = p;
        return p;
      };
      std::vector<std::pair<Unit, UpdateInputs>> bodies;
      for (auto &x : run) {
        auto &s = x.sgd;
        // A learning rate read at run time is loaded again inside, at the same place of the chain.
        auto lr = x.lr_load != nullptr ? param_for(x.lr_load->input(1)) : param_for(s->input(3));
        bodies.emplace_back(x, UpdateInputs{param_for(s->input(1)), param_for(s->input(2)), lr,
                                            param_for(s->input(4)), param_for(s->input(5)), param_for(s->input(6)),
                                            x.fill != nullptr ? param_for(x.fill->input(2)) : nullptr});
      }
      auto u = sub->add_parameter();  // last, as its argument
      u->set_abstract(first.start->abstract());
      args.push_back(first.start);
      AnfNodePtr monad = u;
      for (auto &[x, in] : bodies) {
        if (x.lr_load != nullptr) {
          auto load = sub->NewCNode({PrimNode("Load"), in.lr, monad});
          load->set_abstract(x.lr_load->abstract());
          in.lr = load;
        }
        auto copy = EmitUpdate(sub, in, x.sgd->input(0), x.sgd->abstract(), TypeIdOf(x.sgd), monad,
                               in.weight->isa<Parameter>() ? in.weight->cast<ParameterPtr>()->name() : "?");
        auto us = sub->NewCNode({PrimNode("UpdateState"), copy->input(7), copy});
        us->set_abstract(u->abstract());
        monad = us;
      }
      auto done = mindspore::NewValueNode(mindspore::MakeValue(true));
      done->set_abstract(mindspore::MakeValue(true)->ToAbstract());
      auto depend = sub->NewCNode({PrimNode("Depend"), done, monad});
      depend->set_abstract(done->abstract());
      sub->set_output(depend);
      auto call = g->NewCNode(args);
      call->set_abstract(done->abstract());
      // U_e = UpdateState(Ua_n, SGD_n, x...) becomes UpdateState(U_s, call, x...).
      std::vector<AnfNodePtr> end_inputs(end->inputs().begin(), end->inputs().end());
      end_inputs[1] = first.start;
      end_inputs[2] = call;
      auto new_end = g->NewCNode(end_inputs);
      new_end->set_abstract(end->abstract());
      manager->AddFuncGraph(sub);
      manager->Replace(end, new_end);
      outlined++;
    }
  }
  return outlined;
}

class FuseMintSgdPass : public mindspore::opt::Pass {
 public:
  FuseMintSgdPass() : Pass(kPassName) {}

  bool Run(const FuncGraphPtr &root) override {
    const char *off = std::getenv("SGDFUSE_MINDSPORE_DISABLE");
    if (off != nullptr && std::string(off) == "1") return false;
    ReportWriter report;
    const std::string graph_name = root == nullptr ? "?" : root->ToString();
    try {
      if (root == nullptr || root->get_return() == nullptr) return false;
      // MindSpore runs the pass once per registration (register() for "cpu" and then "ascend", say): the
      // first run did the work.
      if (root->has_flag(kDoneFlag)) return false;
      root->set_flag(kDoneFlag, true);
      auto manager = root->manager();
      if (manager == nullptr) {
        manager = mindspore::Manage(root, true);
      }
      auto device = mindspore::MsContext::GetInstance()->get_param<std::string>(mindspore::MS_CTX_DEVICE_TARGET);
      // Only graphs compiled for a device the pass was registered for (register() lists them; MindSpore 2.10
      // runs a FULL_GRAPH pass whatever device it was registered for).
      const char *devices = std::getenv("SGDFUSE_MINDSPORE_DEVICES");
      if (devices != nullptr && *devices != '\0') {
        std::string lower;
        for (char c : device) lower += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
        std::set<std::string> wanted;
        std::stringstream list(devices);
        for (std::string item; std::getline(list, item, ',');) wanted.insert(item);
        if (wanted.count("all") == 0 && wanted.count(lower) == 0) {
          report.Skipped(graph_name, device, devices);
          return false;
        }
      }
      CallSites calls;
      Bindings bindings;
      for (auto &g : manager->func_graphs()) {
        if (g->get_return() == nullptr) continue;
        for (auto &node : mindspore::TopoSort(g->get_return())) {
          auto c = AsCNode(node);
          if (c == nullptr || c->size() == 0 || c->func_graph() != g) continue;
          for (size_t i = 0; i < c->size(); ++i) {
            auto callee = mindspore::GetValueNode<FuncGraphPtr>(c->input(i));
            if (callee == nullptr) continue;
            if (i == 0) {
              calls[callee.get()].push_back(c);
              bindings.sites[callee.get()].push_back({c, 1});
            } else if (i == 1 && IsPrim(c, "Partial")) {
              bindings.sites[callee.get()].push_back({c, 2});
            } else {
              bindings.escaped.insert(callee.get());
            }
          }
        }
      }
      Matcher matcher(manager, device, bindings);
      std::vector<Plan> plans;
      std::vector<Refusal> refusals;
      std::vector<FuncGraphPtr> graphs(manager->func_graphs().begin(), manager->func_graphs().end());
      for (auto &g : graphs) {
        if (g->get_return() == nullptr) continue;
        for (auto &node : mindspore::TopoSort(g->get_return())) {
          auto call = AsCNode(node);
          if (call == nullptr) continue;
          Plan plan;
          Refusal refusal;
          if (matcher.Match(g, call, &plan, &refusal)) {
            plans.push_back(plan);
          } else if (!refusal.reason.empty()) {
            refusals.push_back(refusal);
          } else if (Refusal plain; matcher.PlainUpdate(g, call, &plain)) {
            refusals.push_back(plain);
          }
        }
      }
      const auto before = CountNodes(manager);
      Rewriter rewriter(manager, ZeroFirstStep(device));
      for (auto &p : plans) rewriter.Apply(p);
      const size_t inlined = InlineSharedGraphs(manager, plans, calls);
      const char *outline = std::getenv("SGDFUSE_MINDSPORE_OUTLINE");
      // Measured on the CPU runtime only; on Ascend the updates stay where the rewrite put them.
      const bool want_outline = device == "CPU" && (outline == nullptr || std::string(outline) != "0");
      const size_t outlined = want_outline ? OutlineUpdateRuns(manager) : 0;
      const auto after = CountNodes(manager);
      // One record per parameter: an update in a shared graph stands for every parameter passed to it, and
      // an update reached along several paths (the code after an `if`, copied into both branches) for the
      // same parameter once.
      std::set<std::string> fused_names, refused_names;
      for (auto &p : plans) report.Fused(graph_name, p, device, &fused_names);
      for (auto &r : refusals) report.Refused(graph_name, r, fused_names, &refused_names);
      report.Summary(graph_name, fused_names.size(), refused_names.size(), before, after, inlined, outlined);
      return !plans.empty();
    } catch (const std::exception &e) {
      report.Error(graph_name, e.what());
      return false;
    }
  }
};

class SgdfusePlugin : public mindspore::opt::CustomPassPlugin {
 public:
  std::string GetPluginName() const override { return kPluginName; }
  std::vector<std::string> GetAvailablePassNames() const override { return {kPassName}; }
  std::shared_ptr<mindspore::opt::Pass> CreatePass(const std::string &pass_name) const override {
    if (pass_name == kPassName) return std::make_shared<FuseMintSgdPass>();
    return nullptr;
  }
};

}  // namespace sgdfuse_ms

EXPORT_CUSTOM_PASS_PLUGIN(sgdfuse_ms::SgdfusePlugin)
