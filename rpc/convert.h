// Conversions between C++ values and c10::IValue, the form in which arguments and results cross the wire.
//
// Supported C++ types: c10::IValue itself, at::Tensor, bool, every integral and floating type, c10::complex<double>,
// std::string (and const char* on the way out), std::vector<T>, std::map<K,V> / std::unordered_map<K,V>,
// std::tuple<T...>, c10::optional<T> / std::optional<T>, and nesting of these.
//
// from_ivalue<T> accepts any list whose elements convert to T (typed or generic), so a value sent as List[Any] still
// converts to std::vector<int64_t>. A mismatch throws tandem::Error (INVALID_ARGUMENT) with a message naming both
// types; the RPC layer turns it into an INVALID_ARGUMENT error reply.
#pragma once

#include <ATen/core/ivalue.h>
#include <ATen/core/jit_type.h>

#include <limits>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <vector>

namespace tandem::rpc {

template <typename T, typename = void>
struct IValueConverter;

template <typename T>
c10::IValue to_ivalue(T&& value) {
  return IValueConverter<std::decay_t<T>>::to(std::forward<T>(value));
}

template <typename T>
std::decay_t<T> from_ivalue(const c10::IValue& value) {
  return IValueConverter<std::decay_t<T>>::from(value);
}

// The TorchScript type a C++ type converts to: used to type lists and dicts, so typed consumers (TorchScript) accept
// them.
template <typename T>
c10::TypePtr static_type() {
  return IValueConverter<std::decay_t<T>>::type();
}

namespace detail {
[[noreturn]] void conversion_error(const char* expected, const c10::IValue& got);
}

template <>
struct IValueConverter<c10::IValue> {
  static c10::IValue to(c10::IValue v) { return v; }
  static c10::IValue from(const c10::IValue& v) { return v; }
  static c10::TypePtr type() { return c10::AnyType::get(); }
};

template <>
struct IValueConverter<at::Tensor> {
  static c10::IValue to(at::Tensor v) { return c10::IValue(std::move(v)); }
  static at::Tensor from(const c10::IValue& v) {
    if (!v.isTensor()) detail::conversion_error("Tensor", v);
    return v.toTensor();
  }
  static c10::TypePtr type() { return c10::TensorType::get(); }
};

template <>
struct IValueConverter<bool> {
  static c10::IValue to(bool v) { return c10::IValue(v); }
  static bool from(const c10::IValue& v) {
    if (!v.isBool()) detail::conversion_error("bool", v);
    return v.toBool();
  }
  static c10::TypePtr type() { return c10::BoolType::get(); }
};

template <typename T>
struct IValueConverter<T, std::enable_if_t<std::is_integral_v<T> && !std::is_same_v<T, bool>>> {
  static c10::IValue to(T v) { return c10::IValue(static_cast<int64_t>(v)); }
  static T from(const c10::IValue& v) {
    if (!v.isInt()) detail::conversion_error("int", v);
    const int64_t i = v.toInt();
    if constexpr (std::is_unsigned_v<T>) {
      if (i < 0 || static_cast<uint64_t>(i) > std::numeric_limits<T>::max())
        detail::conversion_error("in-range int", v);
    } else {
      if (i < std::numeric_limits<T>::min() || i > std::numeric_limits<T>::max()) {
        detail::conversion_error("in-range int", v);
      }
    }
    return static_cast<T>(i);
  }
  static c10::TypePtr type() { return c10::IntType::get(); }
};

template <typename T>
struct IValueConverter<T, std::enable_if_t<std::is_floating_point_v<T>>> {
  static c10::IValue to(T v) { return c10::IValue(static_cast<double>(v)); }
  static T from(const c10::IValue& v) {
    if (v.isDouble()) return static_cast<T>(v.toDouble());
    if (v.isInt()) return static_cast<T>(v.toInt());
    detail::conversion_error("float", v);
  }
  static c10::TypePtr type() { return c10::FloatType::get(); }
};

template <>
struct IValueConverter<c10::complex<double>> {
  static c10::IValue to(c10::complex<double> v) { return c10::IValue(v); }
  static c10::complex<double> from(const c10::IValue& v) {
    if (!v.isComplexDouble()) detail::conversion_error("complex", v);
    return v.toComplexDouble();
  }
  static c10::TypePtr type() { return c10::ComplexType::get(); }
};

template <>
struct IValueConverter<std::string> {
  static c10::IValue to(std::string v) { return c10::IValue(std::move(v)); }
  static std::string from(const c10::IValue& v) {
    if (!v.isString()) detail::conversion_error("str", v);
    return v.toStringRef();
  }
  static c10::TypePtr type() { return c10::StringType::get(); }
};

template <>
struct IValueConverter<const char*> {
  static c10::IValue to(const char* v) { return c10::IValue(std::string(v)); }
  static c10::TypePtr type() { return c10::StringType::get(); }
};
template <>
struct IValueConverter<char*> : IValueConverter<const char*> {};

template <typename T>
struct IValueConverter<std::vector<T>> {
  static c10::IValue to(const std::vector<T>& v) {
    c10::impl::GenericList list(static_type<T>());
    list.reserve(v.size());
    for (const auto& e : v) list.push_back(to_ivalue(e));
    return c10::IValue(std::move(list));
  }
  static std::vector<T> from(const c10::IValue& v) {
    if (!v.isList()) detail::conversion_error("List", v);
    std::vector<T> out;
    const auto items = v.toListRef();
    out.reserve(items.size());
    for (const auto& e : items) out.push_back(from_ivalue<T>(e));
    return out;
  }
  static c10::TypePtr type() { return c10::ListType::create(static_type<T>()); }
};

template <typename Map>
struct MapConverter {
  using K = typename Map::key_type;
  using V = typename Map::mapped_type;
  static c10::IValue to(const Map& m) {
    c10::impl::GenericDict dict(static_type<K>(), static_type<V>());
    for (const auto& [k, val] : m) dict.insert_or_assign(to_ivalue(k), to_ivalue(val));
    return c10::IValue(std::move(dict));
  }
  static Map from(const c10::IValue& v) {
    if (!v.isGenericDict()) detail::conversion_error("Dict", v);
    Map out;
    for (const auto& entry : v.toGenericDict()) out.emplace(from_ivalue<K>(entry.key()), from_ivalue<V>(entry.value()));
    return out;
  }
  static c10::TypePtr type() { return c10::DictType::create(static_type<K>(), static_type<V>()); }
};
template <typename K, typename V>
struct IValueConverter<std::map<K, V>> : MapConverter<std::map<K, V>> {};
template <typename K, typename V>
struct IValueConverter<std::unordered_map<K, V>> : MapConverter<std::unordered_map<K, V>> {};

template <typename... Ts>
struct IValueConverter<std::tuple<Ts...>> {
  static c10::IValue to(const std::tuple<Ts...>& t) {
    return std::apply([](const auto&... e) { return c10::IValue(c10::ivalue::Tuple::create({to_ivalue(e)...})); }, t);
  }
  static std::tuple<Ts...> from(const c10::IValue& v) {
    if (!v.isTuple()) detail::conversion_error("Tuple", v);
    const auto& elems = v.toTupleRef().elements();
    if (elems.size() != sizeof...(Ts)) detail::conversion_error("Tuple of matching size", v);
    return from_elems(elems, std::index_sequence_for<Ts...>{});
  }
  static c10::TypePtr type() { return c10::TupleType::create({static_type<Ts>()...}); }

 private:
  template <size_t... I>
  static std::tuple<Ts...> from_elems(c10::ArrayRef<c10::IValue> elems, std::index_sequence<I...>) {
    return std::tuple<Ts...>(from_ivalue<Ts>(elems[I])...);
  }
};

template <typename Opt, typename T>
struct OptionalConverter {
  static c10::IValue to(const Opt& v) { return v ? to_ivalue(*v) : c10::IValue(); }
  static Opt from(const c10::IValue& v) {
    if (v.isNone()) return Opt();
    return Opt(from_ivalue<T>(v));
  }
  static c10::TypePtr type() { return c10::OptionalType::create(static_type<T>()); }
};
template <typename T>
struct IValueConverter<std::optional<T>> : OptionalConverter<std::optional<T>, T> {};
template <typename T>
struct IValueConverter<c10::optional<T>> : OptionalConverter<c10::optional<T>, T> {};

}  // namespace tandem::rpc
