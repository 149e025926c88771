// Command lines of Tandem's programs (tandem-run, the examples, the benchmarks), with CLI11 (Debian's libcli11-dev):
//
//   CLI::App app{"What the program does", "program_name"};
//   app.add_option("--epochs", args.epochs, "epochs to train");
//   tandem::tools::parse_flags(app, argc, argv);
//
// --help (and -h) prints every flag with its default and exits 0; an unknown flag, a missing or malformed value or a
// failed check prints the error and exits with CLI11's code for it (never 0). Flags take their value as the next
// argument or after '=' (--epochs 3, --epochs=3); given twice, the last value wins.
#pragma once

#include <CLI/CLI.hpp>

#include <cstdlib>

namespace tandem::tools {

// What --help shows for each option taking a value: its value before parsing (subcommands' options too); a flag given
// twice takes its last value, as the hand-written parsers did (bench/run.sh appends flags to the user's).
inline void capture_defaults(CLI::App& app) {
  for (CLI::Option* option : app.get_options()) {
    if (option->get_expected_min() > 0) {
      option->capture_default_str();
      option->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
    }
  }
  for (CLI::App* sub : app.get_subcommands([](CLI::App*) { return true; })) capture_defaults(*sub);
}

inline void parse_flags(CLI::App& app, int argc, const char* const* argv) {
  capture_defaults(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    std::exit(app.exit(e));
  }
}

}  // namespace tandem::tools
