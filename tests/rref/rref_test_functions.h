#pragma once
namespace tandem::test {
// Functions and classes every RRef test worker serves.
void register_rref_test_functions();
}  // namespace tandem::test
