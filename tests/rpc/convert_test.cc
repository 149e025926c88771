#include "tandem/rpc/convert.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <functional>

#include "tandem/rpc/errors.h"
#include "tandem/rpc/registry.h"
#include "tests/common/test_env.h"

namespace tandem::rpc {
namespace {

using test::thrown_code;

TEST(UnitConvert, NestedContainersRoundTrip) {
  std::map<std::string, std::vector<std::tuple<int, double>>> m = {{"a", {{1, 0.5}, {2, 1.5}}}, {"b", {}}};
  auto back = from_ivalue<decltype(m)>(to_ivalue(m));
  EXPECT_EQ(back, m);
  EXPECT_EQ(to_ivalue(m).type()->annotation_str(), "Dict[str, List[Tuple[int, float]]]");
  std::optional<std::string> none;
  EXPECT_FALSE(from_ivalue<std::optional<std::string>>(to_ivalue(none)).has_value());
  EXPECT_EQ(
      from_ivalue<std::vector<std::vector<int64_t>>>(to_ivalue(std::vector<std::vector<int64_t>>{{1}, {2, 3}}))[1][1],
      3);
}

TEST(UnitConvert, GenericListsConvertToTypedVectors) {
  c10::impl::GenericList any(c10::AnyType::get());
  any.push_back(c10::IValue(int64_t{4}));
  any.push_back(c10::IValue(int64_t{5}));
  EXPECT_EQ(from_ivalue<std::vector<int>>(c10::IValue(any)), (std::vector<int>{4, 5}));
}

TEST(UnitConvert, MismatchesNameBothTypes) {
  try {
    from_ivalue<at::Tensor>(c10::IValue(int64_t{3}));
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(e.status().message(), "expected Tensor, got Int 3");
  }
  EXPECT_EQ(thrown_code([] { from_ivalue<int8_t>(c10::IValue(int64_t{300})); }), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(thrown_code([] { from_ivalue<uint32_t>(c10::IValue(int64_t{-1})); }), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(thrown_code([] { from_ivalue<std::string>(c10::IValue(1.0)); }), absl::StatusCode::kInvalidArgument);
}

TEST(UnitRegistry, TypedFunctionsCheckArityAndTypes) {
  register_function("unit_mul", [](int64_t a, double b) { return a * b; });
  Handler h = find_function("unit_mul");
  ASSERT_TRUE(h);
  EXPECT_DOUBLE_EQ(h({c10::IValue(int64_t{3}), c10::IValue(0.5)}).value().toDouble(), 1.5);
  try {
    h({c10::IValue(int64_t{3})});
    FAIL() << "no arity error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(e.status().message(), "expects 2 arguments, got 1");
  }
  try {
    h({c10::IValue("x"), c10::IValue(0.5)});
    FAIL() << "no type error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(e.status().message(), "argument 1: expected int, got String");
  }
  EXPECT_THROW(register_function("unit_mul", [] {}), RpcError);
  EXPECT_TRUE(unregister_function("unit_mul"));
  EXPECT_FALSE(find_function("unit_mul"));
}

TEST(UnitRegistry, VoidAndFutureResults) {
  register_function("unit_void", [](std::string) {});
  EXPECT_TRUE(find_function("unit_void")({c10::IValue("x")}).value().isNone());
  Future pending;
  register_function("unit_async", [pending] { return pending; });
  Future f = find_function("unit_async")({});
  EXPECT_FALSE(f.completed());
  pending.set_value(7);
  EXPECT_EQ(f.get<int>(), 7);
  unregister_function("unit_void");
  unregister_function("unit_async");
}

}  // namespace
}  // namespace tandem::rpc
