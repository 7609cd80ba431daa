// The entry points shared by the fuzz/sanitizer drivers: libFuzzer's LLVMFuzzerTestOneInput when
// built with -DBEA_LIBFUZZER, else a main() that runs every file named on the command line (or
// standard input when none is) through the driver's run_one().
#pragma once

#include <cstdint>
#include <fstream>
#include <iostream>
#include <iterator>
#include <vector>

namespace bea_fuzz {

// Runs `run_one` over each input; returns how many inputs were checked.
template <class RunOne>
int run_inputs(int argc, char** argv, RunOne run_one) {
  int n = 0;
  for (int k = 1; k < argc; ++k) {
    std::ifstream f(argv[k], std::ios::binary);
    std::vector<uint8_t> buf((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    run_one(buf);
    ++n;
  }
  if (argc == 1) {
    std::vector<uint8_t> buf((std::istreambuf_iterator<char>(std::cin)), std::istreambuf_iterator<char>());
    run_one(buf);
    ++n;
  }
  return n;
}

}  // namespace bea_fuzz

#ifdef BEA_LIBFUZZER
#define BEA_FUZZ_ENTRY(run_one)                                              \
  extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) { \
    std::vector<uint8_t> buf(data, data + size);                             \
    return run_one(buf);                                                     \
  }
#else
#define BEA_FUZZ_ENTRY(run_one)
#endif
